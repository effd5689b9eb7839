"""The collective marker: what a rank writes beside its heartbeat while it waits in a
collective, so that a hang's agents can tell the ranks that wait from the one that stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from hpc_elastic.train.heartbeat import (
    MARKER_BYTES,
    CollectiveMarker,
    collective_path,
    read_collective,
)


def test_a_rank_in_a_collective_says_so_and_says_when_it_left(tmp_path: Path) -> None:
    beat = tmp_path / "heartbeat_3"
    marker = CollectiveMarker(beat)
    marker.enter("all_reduce")
    inside = read_collective(collective_path(beat))
    assert inside is not None
    expected = (True, "all_reduce", 1, os.getpid())
    assert (inside.inside, inside.op, inside.seq, inside.pid) == expected
    marker.leave("all_reduce")
    with marker.marked("broadcast"):
        pass
    after = read_collective(collective_path(beat))
    assert after is not None
    assert (after.inside, after.op, after.seq) == (False, "broadcast", 2)
    assert after.since >= inside.since
    assert collective_path(beat).stat().st_size == MARKER_BYTES, "one record, rewritten in place"


def test_nested_and_concurrent_collectives_keep_the_rank_inside_until_the_last_leaves(
    tmp_path: Path,
) -> None:
    marker = CollectiveMarker(tmp_path / "heartbeat_0")
    marker.enter("gather")
    marker.enter("all_reduce")
    marker.leave("all_reduce")
    still = read_collective(collective_path(tmp_path / "heartbeat_0"))
    assert still is not None
    assert still.inside
    marker.leave("gather")
    out = read_collective(collective_path(tmp_path / "heartbeat_0"))
    assert out is not None
    assert not out.inside


def test_no_marker_a_torn_one_and_a_strange_name_read_as_nothing_or_are_made_safe(
    tmp_path: Path,
) -> None:
    path = collective_path(tmp_path / "heartbeat_1")
    assert read_collective(path) is None
    path.write_text("in all_red")  # caught half-written
    assert read_collective(path) is None
    CollectiveMarker(tmp_path / "heartbeat_1").enter("my op/with spaces")
    record = read_collective(path)
    assert record is not None
    assert record.op == "my_op_with_spaces"


def test_outside_a_job_nothing_is_written(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HPC_ELASTIC_HEARTBEAT_FILE"}
    script = "from hpc_elastic.train import collective\nwith collective('x'):\n    pass\n"
    subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, check=True)
    assert list(tmp_path.iterdir()) == []


def test_watched_torch_collectives_are_marked_and_async_ones_are_not(tmp_path: Path) -> None:
    beat = tmp_path / "heartbeat_0"
    script = textwrap.dedent(
        f"""
        import os, torch, torch.distributed as dist
        import hpc_elastic.train as elastic
        from hpc_elastic.train.heartbeat import collective_path, read_collective
        dist.init_process_group("gloo", init_method="file://{tmp_path / "init"}",
                                rank=0, world_size=1)
        elastic.watch_collectives()
        elastic.watch_collectives()  # twice: still marked once per call
        dist.all_reduce(torch.ones(1))
        first = read_collective(collective_path(os.environ["HPC_ELASTIC_HEARTBEAT_FILE"]))
        dist.all_reduce(torch.ones(1), async_op=True).wait()
        dist.barrier()
        last = read_collective(collective_path(os.environ["HPC_ELASTIC_HEARTBEAT_FILE"]))
        print(first.op, first.seq, first.inside, last.op, last.seq, last.inside)
        dist.destroy_process_group()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "HPC_ELASTIC_HEARTBEAT_FILE": str(beat)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["all_reduce", "1", "False", "barrier", "2", "False"]
