"""The node-local tier: a lost node's ranks restore from a peer's copy, not the shared tier.

Two real gloo ranks under torchrun stand for two nodes: each rank's local tier is its own
directory, and "losing a node" deletes rank 1's. The decision rules (when the shared tier is
written, which tier a restart reads) are pure functions, tested directly.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from ranks import LEAVE, lines, torchrun, torchrun_ok

from hpc_elastic import contract
from hpc_elastic.errors import CheckpointError
from hpc_elastic.events import Event, Kind, LoadedDetails
from hpc_elastic.jobdir import JobDir
from hpc_elastic.ops import status
from hpc_elastic.train import Checkpointer, local_tier
from hpc_elastic.train.checkpoint import verify
from hpc_elastic.train.local_tier import (
    choose_shard_sources,
    choose_source,
    local_first_requested,
    owes_shared,
    persists,
    ring_neighbour,
    ring_predecessor,
)


@pytest.mark.parametrize(
    ("local_steps", "shared_step", "expected"),
    [
        ([30, 30], 20, ("local", 30, [0, 1])),
        ([30, None], 20, ("local", 30, [0])),
        ([20, 30], 30, ("local", 30, [1])),
        ([None, None], 20, ("shared", 20, [])),
        ([10, 10], 20, ("shared", 20, [])),
        ([None, None], None, ("shared", None, [])),
    ],
)
def test_a_restart_reads_the_newest_local_copy_unless_the_shared_tier_is_newer(
    local_steps: list[int | None], shared_step: int | None, expected: tuple[str, int, list[int]]
) -> None:
    assert choose_source(local_steps, shared_step) == expected


def test_the_shared_tier_is_written_at_every_persist_every_th_save() -> None:
    assert [number for number in range(1, 10) if persists(number, 3)] == [3, 6, 9]
    assert all(persists(number, 1) for number in range(1, 5))


def test_persist_every_below_one_is_refused_in_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="persist_every=0 would never write the shared"):
        Checkpointer(tmp_path, persist_every=0)


SCRIPT = (
    """
import datetime, shutil, sys, torch, torch.distributed as dist
from pathlib import Path
import hpc_elastic.train as elastic
from hpc_elastic.train.checkpoint import Checkpointer

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
asynchronous = sys.argv[1] == "async"


def checkpointer():
    return Checkpointer(
        Path("shared"), round=None, local_directory=Path("local"), persist_every=100,
        asynchronous=asynchronous,
    )


model = torch.nn.Linear(4, 4)
state = elastic.TrainState(model)
saver = checkpointer()
for step in range(1, 4):
    with torch.no_grad():
        model.weight.fill_(float(step))
    state.step = step
    saver.save(state)
saver.wait()
print(f"rank={rank} shared: {[path.name for path in saver.committed()]}", flush=True)
dist.barrier()
if rank == 1:
    shutil.rmtree("local/rank-1")  # rank 1's node is lost with its disk
dist.barrier()
fresh = torch.nn.Linear(4, 4)
restored = elastic.TrainState(fresh)
loaded = checkpointer().load(restored)
same = bool(torch.equal(fresh.weight, torch.full((4, 4), 3.0)))
print(f"rank={rank} loaded: {restored.step} {same}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""
    + LEAVE
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_after_a_node_loss_the_peer_copy_restores_without_the_shared_tier(
    tmp_path: Path, mode: str
) -> None:
    (tmp_path / "node_loss.py").write_text(SCRIPT)
    events = tmp_path / "events.jsonl"
    output = torchrun_ok(
        tmp_path / "node_loss.py",
        mode,
        cwd=tmp_path,
        env={"HPC_ELASTIC_EVENTS_FILE": str(events)},
    )
    assert "rank=0 shared: []" in output  # persist_every=100: never written
    assert "rank=0 loaded: 3 True" in output
    assert "rank=1 loaded: 3 True" in output
    loaded = [
        event["details"]
        for event in map(json.loads, events.read_text().splitlines())
        if event["kind"] == "checkpoint_loaded"
    ]
    tiers = {detail["rank"]: detail["tier"] for detail in loaded}
    assert tiers == {0: "local", 1: "peer"}


def test_a_shard_s_peer_copy_goes_to_the_same_local_rank_on_the_next_node() -> None:
    # 3 nodes of 2 ranks: rank 1's copy lives on node 2 (rank 3), the last node's on node 1.
    assert [ring_neighbour(rank, 6, 2) for rank in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [ring_predecessor(ring_neighbour(rank, 6, 2) or 0, 6, 2) for rank in range(6)] == [
        *range(6)
    ]
    assert ring_neighbour(1, 4, 4) is None  # one node: a copy on it guards nothing


@pytest.mark.parametrize(
    ("holdings", "shared_step", "expected"),
    [
        # every rank holds its own shard of step 30 (and its neighbour's): all local
        ([{0: [20, 30], 1: [30]}, {1: [20, 30], 0: [30]}], 20, (30, {0: 0, 1: 1})),
        # rank 1's node was replaced: rank 0 holds rank 1's peer copy
        ([{0: [20, 30], 1: [20, 30]}, {}], 20, (30, {0: 0, 1: 0})),
        # rank 1's shard of 30 is nowhere: the newest complete step is 20
        ([{0: [20, 30]}, {1: [20]}], None, (20, {0: 0, 1: 1})),
        # the shared tier is newer than any complete local step
        ([{0: [20, 30]}, {1: [20]}], 30, (30, {})),
        # nothing local at all
        ([{}, {}], 10, (10, {})),
    ],
)
def test_each_shard_is_read_from_its_own_rank_else_a_peer_copy_else_the_shared_tier(
    holdings: list[dict[int, list[int]]],
    shared_step: int | None,
    expected: tuple[int | None, dict[int, int]],
) -> None:
    assert choose_shard_sources(holdings, shared_step) == expected


SHARDED_SCRIPT = (
    """
import datetime, shutil, sys, torch, torch.distributed as dist
from pathlib import Path
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import hpc_elastic.train as elastic
from hpc_elastic.train.checkpoint import Checkpointer

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
asynchronous = sys.argv[1] == "async"


def checkpointer():
    # Each rank stands for one node: its own node-local disk, one rank per node.
    return Checkpointer(
        Path("shared"), round=None, local_directory=Path(f"node-{rank}"), persist_every=2,
        asynchronous=asynchronous, ranks_per_node=1,
    )


def weights(step):
    return torch.randn(8, 3, generator=torch.Generator().manual_seed(step))


def state_at(step):
    return {
        "weight": distribute_tensor(weights(step), mesh, [Shard(0)]),
        "bias": torch.full((3,), float(step)),
        "extras": {"step": step, "name": f"s{step}"},
    }


def resume(label):
    restored = state_at(0)
    loaded = elastic.load_sharded(restored, checkpointer=checkpointer())
    step = restored["extras"]["step"]
    same = bool(torch.equal(restored["weight"].full_tensor(), weights(step)))
    same = same and bool(torch.equal(restored["bias"], torch.full((3,), float(step))))
    print(f"rank={rank} {label}: {step} {restored['extras']['name']} {same}", flush=True)
    dist.barrier()


saver = checkpointer()
for step in range(1, 4):
    elastic.save_sharded(state_at(step), step, checkpointer=saver)
saver.wait()
dist.barrier()
copies = sorted(str(path.relative_to(".")) for path in Path(".").glob("node-*/sharded/*/step-*"))
print(f"rank={rank} copies: {copies}", flush=True)
print(f"rank={rank} shared: {[path.name for path in saver.committed()]}", flush=True)
resume("whole")
if rank == 1:
    shutil.rmtree("node-1")  # rank 1's node is lost with its disk
dist.barrier()
resume("node lost")
if rank == 0:
    shutil.rmtree("node-0")  # every local disk is gone now
dist.barrier()
resume("all lost")
dist.destroy_process_group()
"""
    + LEAVE
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sharded_state_resumes_bitwise_from_its_node_a_peer_copy_or_the_shared_tier(
    tmp_path: Path, mode: str
) -> None:
    (tmp_path / "sharded_local.py").write_text(SHARDED_SCRIPT)
    events = tmp_path / "events.jsonl"
    output = torchrun_ok(
        tmp_path / "sharded_local.py",
        mode,
        cwd=tmp_path,
        env={"HPC_ELASTIC_EVENTS_FILE": str(events)},
    )
    # Steps 2 and 3 kept (LOCAL_KEEP); each node holds its own shard and its neighbour's.
    expected = [
        f"node-{node}/sharded/shard-{shard}/step-0000000{step}"
        for node in (0, 1)
        for shard in (0, 1)
        for step in (2, 3)
    ]
    assert f"rank=0 copies: {expected}" in output
    assert "rank=0 shared: ['step-00000002']" in output  # persist_every=2
    for rank in (0, 1):
        assert f"rank={rank} whole: 3 s3 True" in output
        assert f"rank={rank} node lost: 3 s3 True" in output
        assert f"rank={rank} all lost: 2 s2 True" in output
    loaded = [
        LoadedDetails.from_details(event["details"])
        for event in map(json.loads, events.read_text().splitlines())
        if event["kind"] == "checkpoint_loaded"
    ]
    seen = [(each.rank, each.tier, each.step) for each in loaded]
    # The loads are apart (barriers); within one, the two ranks' lines come in either order.
    assert len(seen) == 5
    assert set(seen[:2]) == {(0, "local", 3), (1, "local", 3)}
    assert set(seen[2:4]) == {(0, "local", 3), (1, "peer", 3)}
    assert seen[4] == (None, "shared", 2)


def loaded_event(round_: int | None, step: int, tier: str, rank: int | None) -> Event:
    details = LoadedDetails(step=step, tier=tier, rank=rank).to_details()
    return Event(Kind.CHECKPOINT_LOADED, job="j", round=round_, details=details)


def test_status_says_which_tier_each_restart_loaded_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    history = [
        Event(Kind.CHECKPOINT, round=1, details={"step": 10}),
        loaded_event(2, 10, "shared", None),
        *(loaded_event(3, 30, "local", rank) for rank in range(3)),
        loaded_event(3, 30, "peer", 3),
        loaded_event(4, 40, "remote", None),
        loaded_event(None, 50, "local", 0),
        loaded_event(None, 50, "local", 1),
    ]
    restores = status.restore_tiers(history)
    assert restores == [
        "round 2: step 10 from shared",
        "round 3: step 30 from local (3 ranks), peer (1 rank)",
        "round 4: step 40 from remote",
        "a restart: step 50 from local",
    ]
    view = status.JobView(
        run_id="r",
        job_id=None,
        job_dir="d",
        mode="local",
        nodes="2",
        nproc_per_node=1,
        state="running",
        round=5,
        world_size=2,
        members=["0", "1"],
        member_count=2,
        restarts_used=0,
        max_restarts=3,
        restarts=4,
        preemptions=0,
        requeues=0,
        last_checkpoint_step=None,
        last_checkpoint_time=None,
        last_failure=None,
        restores=restores,
    )
    status.render(view)
    shown = " ".join(capsys.readouterr().out.split())
    assert (
        "Restored round 3: step 30 from local (3 ranks), peer (1 rank); round 4: step 40 from "
        "remote; a restart: step 50 from local (the last 3 of 4)"
    ) in shown


SAVE_TWO_SHARDS = (
    """
import datetime, torch, torch.distributed as dist
from pathlib import Path
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import hpc_elastic.train as elastic
from hpc_elastic.train.checkpoint import Checkpointer

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
saver = Checkpointer(
    Path("shared"), round=None, local_directory=Path("node-0"), persist_every=2,
    ranks_per_node=dist.get_world_size(),  # one node: both shards on node-0's disk
)
for step in (1, 2, 3):
    weight = distribute_tensor(torch.full((8, 3), float(step)), mesh, [Shard(0)])
    elastic.save_sharded({"weight": weight}, step, checkpointer=saver)
dist.destroy_process_group()
"""
    + LEAVE
)

LOAD_ON_ONE_RANK = (
    """
import torch, torch.distributed as dist
from pathlib import Path
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import hpc_elastic.train as elastic
from hpc_elastic.train.checkpoint import Checkpointer

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,))
state = {"weight": distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])}
loaded = elastic.load_sharded(
    state, checkpointer=Checkpointer(Path("shared"), round=None, local_directory=Path("node-0"))
)
print("loaded", loaded.name, torch.equal(state["weight"].full_tensor(), torch.full((8, 3), 2.0)))
dist.destroy_process_group()
"""
    + LEAVE
)


def test_a_local_shard_written_at_another_world_size_is_passed_over_for_the_shared_tier(
    tmp_path: Path,
) -> None:
    (tmp_path / "save.py").write_text(SAVE_TWO_SHARDS)
    (tmp_path / "load.py").write_text(LOAD_ON_ONE_RANK)
    torchrun_ok(tmp_path / "save.py", cwd=tmp_path, nproc=2)
    assert sorted(path.name for path in (tmp_path / "node-0" / "sharded").iterdir()) == [
        "shard-0",
        "shard-1",
    ]
    # Local step 3 is newer than shared step 2, but its shards have the layout of 2 ranks.
    output = torchrun_ok(tmp_path / "load.py", cwd=tmp_path, nproc=1)
    assert "loaded step-00000002 True" in output


# --- --grace-action local: a stop's save goes to the local tier only, the shared copy follows

LOCAL_FIRST = """
import datetime, os, signal, sys, torch, torch.distributed as dist
from pathlib import Path
import hpc_elastic.train as elastic
from hpc_elastic.train.checkpoint import Checkpointer

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
phase, asynchronous, signum = sys.argv[1], sys.argv[2] == "async", sys.argv[3]


def checkpointer():
    # Each rank stands for one node: its own node-local disk.
    return Checkpointer(
        Path("shared"), round=None, local_directory=Path(f"node-{rank}"), persist_every=1,
        asynchronous=asynchronous,
    )


def shared():
    return [path.name for path in checkpointer().committed()]


model = torch.nn.Linear(4, 4)
state = elastic.TrainState(model)
saver = checkpointer()
if phase == "stop":
    for step in range(1, 10):
        with torch.no_grad():
            model.weight.fill_(float(step))
        state.step = step
        if step == 3 and rank == 1:
            os.kill(os.getpid(), signal.Signals[signum])  # the stop's signal reaches one rank
        stop = elastic.should_stop(step)
        if stop or step % 2 == 0:
            saver.save(state)
        if stop:
            saver.wait()
            dist.barrier()
            print(f"rank={rank} stopped: {step} shared: {shared()}", flush=True)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)  # the job is killed after its save
else:
    fresh = torch.nn.Linear(4, 4)
    restored = elastic.TrainState(fresh)
    saver.load(restored)
    same = bool(torch.equal(fresh.weight, torch.full((4, 4), float(restored.step))))
    print(f"rank={rank} resumed: {restored.step} {same} shared: {shared()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
"""


@pytest.mark.parametrize(
    ("owed", "step", "shared_step", "replicate"),
    [
        (True, 3, 2, True),
        (True, 3, None, True),
        (True, 3, 3, False),  # an earlier start wrote it already
        (False, 3, 2, False),  # persist_every: this step was never due for the shared tier
    ],
)
def test_a_restored_local_copy_owes_the_shared_tier_only_what_its_save_deferred(
    owed: bool, step: int, shared_step: int | None, replicate: bool
) -> None:
    assert owes_shared(owed, step, shared_step) is replicate


def test_the_local_first_request_is_the_job_directorys_file_and_a_deadlines_signal(
    tmp_path: Path,
) -> None:
    environ = {contract.JOB_DIR_ENV: str(tmp_path)}
    assert not local_first_requested(signal.SIGUSR2, environ)
    JobDir(tmp_path).local_first.parent.mkdir()
    JobDir(tmp_path).local_first.touch()
    assert local_first_requested(signal.SIGUSR2, environ)
    assert local_first_requested(signal.SIGUSR1, environ)
    assert not local_first_requested(signal.SIGUSR2, {}), "outside a job"
    assert not local_first_requested(None, environ), "no signal reached this rank"
    assert not local_first_requested(signal.SIGTERM, environ), "a cancel: maybe no next start"
    assert not local_first_requested(signal.SIGINT, environ)


def stop_with_local_first(
    tmp_path: Path, mode: str, requested: bool = True, stop: str = "SIGUSR2"
) -> dict[str, str]:
    """Two ranks train, save at step 2 and rank 1 gets the stop signal ``stop`` at step 3
    (SIGUSR2: a preemption's); with ``requested`` the job directory holds
    ``slots/local-first``, as an agent under ``--grace-action local`` creates it. Each rank is
    SIGKILLed right after its stop's save. The environment to resume in."""
    (tmp_path / "local_first.py").write_text(LOCAL_FIRST)
    job = tmp_path / "job"
    job.mkdir()
    if requested:
        (job / "slots").mkdir()
        JobDir(job).local_first.touch()
    env = {"HPC_ELASTIC_EVENTS_FILE": str(job / "events.jsonl"), contract.JOB_DIR_ENV: str(job)}
    stopped = torchrun(tmp_path / "local_first.py", "stop", mode, stop, cwd=tmp_path, env=env)
    assert stopped.returncode != 0, "killed after the save"
    local_first = requested and stop == "SIGUSR2"
    expected = "['step-00000002']" if local_first else "['step-00000003', 'step-00000002']"
    assert lines(stopped.stdout, "stopped") == [f"3 shared: {expected}"] * 2, stopped.stdout
    return env


def resumed(tmp_path: Path, mode: str, env: dict[str, str]) -> list[str]:
    script = tmp_path / "local_first.py"
    output = torchrun_ok(script, "resume", mode, "-", cwd=tmp_path, env=env)
    return sorted(line for line in output.splitlines() if " resumed: " in line)


def loaded_tiers(env: dict[str, str]) -> dict[int | None, str]:
    history = map(json.loads, Path(env["HPC_ELASTIC_EVENTS_FILE"]).read_text().splitlines())
    loaded = [event["details"] for event in history if event["kind"] == "checkpoint_loaded"]
    return {detail["rank"]: detail["tier"] for detail in loaded}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stop_saved_to_the_local_tier_first_resumes_there_and_then_reaches_the_shared_tier(
    tmp_path: Path, mode: str
) -> None:
    env = stop_with_local_first(tmp_path, mode)
    if mode == "async":
        shutil.rmtree(tmp_path / "node-1")  # rank 1's node was replaced: a peer's copy serves
    output = resumed(tmp_path, mode, env)
    shared = "['step-00000003', 'step-00000002']"
    assert output == [f"[default{r}]:rank={r} resumed: 3 True shared: {shared}" for r in (0, 1)]
    assert loaded_tiers(env) == (
        {0: "local", 1: "peer"} if mode == "async" else {0: "local", 1: "local"}
    )
    copy = tmp_path / "shared" / "step-00000003"
    assert verify(copy) is None
    assert local_tier.SHARED_OWED not in torch.load(copy / "state.pt", weights_only=True)
    events_file = Path(env["HPC_ELASTIC_EVENTS_FILE"])
    history = [json.loads(line) for line in events_file.read_text().splitlines()]
    replicated = [e["details"] for e in history if e["details"].get("replicated") == "local"]
    assert [detail["step"] for detail in replicated] == [3]


def test_a_stop_saved_to_the_local_tier_first_falls_back_to_the_shared_tier_when_every_node_is_new(
    tmp_path: Path,
) -> None:
    env = stop_with_local_first(tmp_path, "sync")
    for node in ("node-0", "node-1"):
        shutil.rmtree(tmp_path / node)
    shared = "['step-00000002']"
    assert resumed(tmp_path, "sync", env) == [
        f"[default{r}]:rank={r} resumed: 2 True shared: {shared}" for r in (0, 1)
    ]
    assert loaded_tiers(env) == {0: "shared", 1: "shared"}


@pytest.mark.parametrize(("requested", "stop"), [(False, "SIGUSR2"), (True, "SIGTERM")])
def test_without_the_request_or_a_deadline_a_stop_save_goes_to_both_tiers(
    tmp_path: Path, requested: bool, stop: str
) -> None:
    """SIGTERM is a cancel's (scancel): the job may never start again to write the shared copy."""
    stop_with_local_first(tmp_path, "sync", requested, stop)
