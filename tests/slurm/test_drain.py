"""Drain awareness (slurm/drain.py): the rules on plain values, the watch with a fake clock,
and the slot's departure with Slurm faked at its one subprocess call."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from slurm_fake import array_slot, mocked_slurm

from hpc_elastic import events
from hpc_elastic.errors import SlurmError
from hpc_elastic.events import Event, Kind
from hpc_elastic.jobdir import JobDir
from hpc_elastic.slurm import drain
from hpc_elastic.slurm.commands import NodeDrain, parse_drains, parse_squeue
from hpc_elastic.slurm.departure import Departure

SINFO = (
    "n2|drained|2026-12-03T07:18:34|root|disk replacement | ticket 42\n"
    "n2|drained|2026-12-03T07:18:34|root|disk replacement | ticket 42\n"
    "n3|draining|2026-12-03T07:18:36|root|maint\n"
    "n3|draining|2026-12-03T07:18:36|root|maint\n"
    "n4|failing|2026-12-03T07:18:43|slurm|gpu xid 79\n"
)
N3 = NodeDrain("n3", "draining", "2026-12-03T07:18:36", "root", "maint")


def test_sinfo_lists_each_drained_node_once_with_its_whole_reason() -> None:
    drained = parse_drains(SINFO)
    assert sorted(drained) == ["n2", "n3", "n4"]
    assert drained["n2"].reason == "disk replacement | ticket 42"
    assert drained["n3"] == N3


def test_a_line_sinfo_would_never_print_is_one_sentence() -> None:
    with pytest.raises(SlurmError, match="sinfo printed 'garbage', which is not"):
        parse_drains("garbage\n")


def test_a_failing_node_is_left_at_once_a_draining_one_at_the_next_checkpoint() -> None:
    failing = NodeDrain("n4", "failing", "", "slurm", "gpu xid 79")
    assert drain.leave_reason(failing, 10, 10, 0.0, 600.0) == "node n4 is failing"
    assert drain.leave_reason(N3, 10, 10, 5.0, 600.0) is None
    assert drain.leave_reason(N3, 10, 15, 5.0, 600.0) == "checkpoint step 15 is committed"
    assert drain.leave_reason(N3, None, 5, 5.0, 600.0) == "checkpoint step 5 is committed"
    assert drain.leave_reason(N3, 10, 10, 600.0, 600.0) == "no checkpoint within 600 s"
    assert drain.leave_reason(N3, None, None, 0.0, 600.0) == (
        "the job has committed no checkpoint to wait for"
    )


def test_patience_is_twice_the_recent_checkpoint_interval_within_bounds() -> None:
    assert drain.patience([]) == drain.MAX_PATIENCE
    assert drain.patience([0.0, 100.0, 200.0, 300.0]) == 200.0
    assert drain.patience([0.0, 1.0, 2.0]) == drain.MIN_PATIENCE
    assert drain.patience([0.0, 5000.0]) == drain.MAX_PATIENCE


def test_a_stale_or_foreign_board_shows_no_drain(tmp_path: Path) -> None:
    board = tmp_path / "drained.json"
    drain.write_board(board, {"n3": N3}, now=1000.0)
    assert drain.drain_of(drain.read_board(board), "n3", 1000.0 + drain.POLL_S) == N3
    assert drain.drain_of(drain.read_board(board), "n1", 1000.0) is None
    late = 1000.0 + drain.BOARD_MAX_AGE + 1
    assert drain.drain_of(drain.read_board(board), "n3", late) is None
    board.write_text('{"at": "yesterday", "drained": {}}')
    assert drain.read_board(board) is None
    board.write_text('{"at": 1, "drained": {"n3": {"node": ["n3"]}}}')
    assert drain.read_board(board) is None


def checkpoint(path: Path, step: int, at: float, tier: str | None = None) -> None:
    details: dict[str, object] = {"step": step, "path": f"ckpt-{step}"}
    if tier is not None:
        details["tier"] = tier
    events.append(path, Event(kind=Kind.CHECKPOINT, slot="0", details=details, time=at))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch_of(
    tmp_path: Path, elected: bool, asked: list[str], left: list[str], said: list[dict[str, object]]
) -> tuple[drain.DrainWatch, Clock]:
    clock = Clock()

    def query() -> dict[str, NodeDrain]:
        asked.append("sinfo")
        return {"n3": N3}

    watch = drain.DrainWatch(
        "n3",
        tmp_path / "drained.json",
        tmp_path / "events.jsonl",
        elected=lambda: elected,
        query=query,
        leave=lambda found, why: left.append(why),
        emit=lambda kind, **details: said.append({"kind": kind, **details}),
        clock=clock,
    )
    return watch, clock


def test_only_the_elected_agent_asks_slurm_once_per_interval_and_all_read_its_board(
    tmp_path: Path,
) -> None:
    asked: list[str] = []
    left: list[str] = []
    leader, clock = watch_of(tmp_path, True, asked, left, [])
    follower, follower_clock = watch_of(tmp_path, False, asked, [], [])
    for _ in range(3):
        leader.poll()
        follower.poll()
        clock.now += 1.0
        follower_clock.now += 1.0
    assert asked == ["sinfo"]  # one query in this interval, for both agents
    clock.now += drain.POLL_S
    leader.poll()
    assert asked == ["sinfo", "sinfo"]


def test_a_drained_slot_says_why_and_leaves_at_the_next_committed_checkpoint(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    checkpoint(log, 10, 900.0)
    left: list[str] = []
    said: list[dict[str, object]] = []
    watch, clock = watch_of(tmp_path, True, [], left, said)
    watch.poll()
    assert said == [{"kind": Kind.DRAIN, **vars(N3), "action": "leaving at the next checkpoint"}]
    clock.now += 5.0
    checkpoint(log, 11, clock.now, tier="local")  # one rank's local tier: not the job's commit
    watch.poll()
    assert left == []
    checkpoint(log, 15, clock.now)
    watch.poll()
    assert left == ["checkpoint step 15 is committed"]
    watch.poll()
    assert left == ["checkpoint step 15 is committed"], "it leaves once"
    assert len(said) == 1


QUEUE = parse_squeue("9|0|RUNNING|None|n1\n9|2|RUNNING|None|n3\n9|3|PENDING|Resources|\n")


def test_the_lowest_running_slot_is_the_one_elected_to_ask(tmp_path: Path) -> None:
    slot = array_slot(tmp_path)  # task 2
    assert not slot.arrays.elected()  # no squeue answer yet
    observe = slot.holds.watch(lambda kind, **details: None)
    observe(QUEUE)
    assert not slot.arrays.elected()  # task 0 runs
    observe(parse_squeue("9|2|RUNNING|None|n3\n"))
    assert slot.arrays.elected()


def test_a_slot_that_left_for_a_drain_requeues_for_it_away_from_drained_nodes(
    tmp_path: Path,
) -> None:
    drain.write_board(JobDir(tmp_path).drained, {"n3": N3}, now=time.time())
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as slurm:
        slurm.answer(
            "scontrol", "-o", "show", "job",
            stdout="JobId=12 JobState=RUNNING PreemptTime=None RunTime=00:05:00 "
            "TimeLimit=UNLIMITED Restarts=0\n",
        )  # fmt: skip
        slurm.answer("scontrol", "requeue")
        slurm.answer("scontrol", "update")
        slot = array_slot(tmp_path)
        slot.arrive()
        slot.drain.left_for = N3  # what the watch's leave() sets before it stops the agent
        assert slot.settle(75, 30.0, lambda kind, **d: said.append((kind, d))) == 75
    assert ["scontrol", "requeue", "9_2"] in slurm.calls
    assert ["scontrol", "update", "JobId=9_2", "ExcNodeList=n3"] in slurm.calls
    [details] = [d for kind, d in said if kind == Kind.REQUEUE]
    assert details["cause"] == Departure.DRAIN.value
    assert details["slurm"]["reason"] == "maint"  # type: ignore[index]
    assert slot.ledger.preemptions == 0, "a drain spends no requeue budget"


def test_a_slot_granted_a_node_drained_meanwhile_leaves_before_joining(tmp_path: Path) -> None:
    drain.write_board(JobDir(tmp_path).drained, {"n3": N3}, now=time.time())
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as slurm:
        slurm.answer("scontrol", "requeue")
        slurm.answer("scontrol", "update")
        slot = array_slot(tmp_path)
        found = slot.drain.here()
        assert found == N3
        assert slot.leave_drained(found, lambda kind, **d: said.append((kind, d))) == 75
    assert [kind for kind, _ in said] == [Kind.DRAIN, Kind.REQUEUE]
    assert said[0][1]["action"] == "leaving before joining"
    assert array_slot(tmp_path, node="n1").drain.here() is None
