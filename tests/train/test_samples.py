"""The per-step sample log and its check (``hpc-elastic events JOB --data``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_elastic import samples
from hpc_elastic.errors import DataError
from hpc_elastic.jobdir import JobRecord
from hpc_elastic.samples import Record

REPO = Path(__file__).resolve().parents[2]


def epoch_records(
    inc: int, steps: range, world: int = 2, *, first_step: int = 1, skip: int | None = None
) -> list[Record]:
    """Epoch 0 of 12 samples, 3 steps of 4: step ``s`` trains ids ``4(s-1)`` to ``4s-1``,
    split over ``world`` ranks; ``skip`` is trained nowhere."""
    records = []
    for step in steps:
        ids = [i for i in range(4 * (step - first_step), 4 * (step - first_step + 1)) if i != skip]
        share = len(ids) // world
        for rank in range(world):
            mine = tuple(ids[rank * share : (rank + 1) * share if rank < world - 1 else None])
            records.append(
                Record(inc, step, world, rank, mine, epoch=0, pos=step - 1, steps=3, batch=4)
            )
    return records


@given(st.lists(st.integers(0, 50)))
def test_ids_travel_as_runs_and_come_back(ids: list[int]) -> None:
    assert samples.expand(samples.runs(ids)) == tuple(ids)


def test_an_epoch_trained_once_is_said_so() -> None:
    report = samples.check(epoch_records(1, range(1, 4)))
    assert report.problems == 0
    assert "Epoch 0: 3 steps, 12 samples, each trained once." in report.lines


def test_a_sample_trained_twice_is_named_with_its_steps() -> None:
    records = epoch_records(1, range(1, 4))
    records.append(Record(1, 3, 2, 1, (9, 2), epoch=0, pos=2, steps=3, batch=4))
    report = samples.check(records)
    assert report.problems
    assert any("2 (steps 1, 3)" in line and "more than once" in line for line in report.lines)


def test_a_sample_never_trained_is_counted() -> None:
    report = samples.check(epoch_records(1, range(1, 4), skip=5))
    assert report.problems
    assert any("1 of its 12 samples were never trained" in line for line in report.lines)


def test_steps_trained_again_after_a_restart_count_once() -> None:
    """Incarnation 1 trained steps 1 to 3 and died; incarnation 2 resumed from the checkpoint
    of step 1 and trained steps 2 and 3 again: their first records are set aside."""
    report = samples.check(epoch_records(1, range(1, 4)) + epoch_records(2, range(2, 4), 3))
    assert report.problems == 0, report.lines
    assert "(2 steps trained again after a restart" in report.lines[-1]


def test_a_step_trained_again_with_other_samples_shows() -> None:
    records = epoch_records(1, range(1, 4))
    redone = [Record(2, 3, 1, 0, (0, 1, 2, 3), epoch=0, pos=2, steps=3, batch=4)]
    report = samples.check(records + redone)
    assert report.problems
    assert any("more than once" in line for line in report.lines)
    assert any("never trained" in line for line in report.lines)


def test_only_the_last_step_may_lack_a_rank() -> None:
    last = [r for r in epoch_records(1, range(1, 4)) if not (r.step == 3 and r.rank == 1)]
    assert not any("logged by ranks" in line for line in samples.check(last).lines)
    middle = [r for r in epoch_records(1, range(1, 4)) if not (r.step == 2 and r.rank == 1)]
    assert "Epoch 0: step 2 was logged by ranks [0] of 2." in samples.check(middle).lines


def test_a_torn_line_is_skipped(tmp_path: Path) -> None:
    writer = samples.Writer(tmp_path, 1, 0)
    for record in epoch_records(1, range(1, 4), world=1):
        writer.write(record)
    writer.close()
    with writer.path.open("a") as file:
        file.write('{"inc": 1, "step": 4, "wor')
    assert len(samples.read(tmp_path)) == 3


def test_where_the_log_goes() -> None:
    assert samples.directory({}) is None
    assert samples.directory({"HPC_ELASTIC_SAMPLE_LOG": "0"}) is None
    assert samples.directory({"HPC_ELASTIC_SAMPLE_LOG": "/x/y"}) == Path("/x/y")
    job = {"HPC_ELASTIC_SAMPLE_LOG": "1", "HPC_ELASTIC_JOB_DIR": "/jobs/a"}
    assert samples.directory(job) == Path("/jobs/a/samples")
    with pytest.raises(DataError, match="outside a job; set HPC_ELASTIC_SAMPLE_LOG to a dir"):
        samples.directory({"HPC_ELASTIC_SAMPLE_LOG": "1"})


def events_data(job_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "events", str(job_dir), "--data"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_events_data_gives_the_verdict_and_exits_1_on_a_problem(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir(mode=0o700)
    JobRecord(
        run_id="data-job",
        job_dir=job_dir,
        job_id=None,
        local=True,
        zk="local:/nowhere",
        nodes="2",
        nproc_per_node=1,
        max_restarts=3,
        runner_pid=os.getpid(),
    ).write()
    missing = events_data(job_dir)
    assert missing.returncode == 1
    assert "No sample log in" in missing.stderr
    assert "HPC_ELASTIC_SAMPLE_LOG=1" in missing.stderr

    writer = samples.Writer(job_dir / "samples", 1, 0)
    for record in epoch_records(1, range(1, 4)):
        writer.write(record)
    clean = events_data(job_dir)
    assert clean.returncode == 0, clean.stderr
    assert "Epoch 0: 3 steps, 12 samples, each trained once." in clean.stdout
    writer.write(Record(1, 4, 2, 0, (0,), epoch=0, pos=2, steps=3, batch=4))
    writer.close()
    twice = events_data(job_dir)
    assert twice.returncode == 1
    assert "samples trained more than once: 0 (steps 1, 4)" in twice.stdout
