"""The health preflight as the agent runs it before joining, and what follows from it in a
Slurm array: the requeue away from bad nodes, stragglers moved the same way, held tasks
reported. Slurm is faked at its one subprocess call (``slurm_fake.mocked_slurm``); the
checks are plain functions, as any plugged-in check is."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from slurm_fake import array_slot, mocked_slurm

from hpc_elastic import events, notify
from hpc_elastic.agent import command
from hpc_elastic.agent.api import AgentSpec
from hpc_elastic.agent.health import Check, Result, Status
from hpc_elastic.rendezvous.badnode import BadNode
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.elastic import ElasticSlot

NOW_RECORD_UNTIL = 4e9
"""An expiry far in the future: the remembered node is still bad whenever the test runs."""


class Book:
    """The user's bad-node memory kept in a list: no rules of its own (expiry and the
    ExcNodeList value are the real ``badnodes`` rules, applied by ``health.preflight``)."""

    def __init__(self, *records: BadNode) -> None:
        self.saved = list(records)

    def remember(self, record: BadNode) -> None:
        self.saved.append(record)

    def records(self) -> list[BadNode]:
        return list(self.saved)


def failing_gpu() -> Result:
    return Result("gpu", Status.FAILED, "GPU 1 has 12 uncorrectable ECC errors.")


def passing_disk() -> Result:
    return Result("disk", Status.OK, "The job directory has room and writes fast.")


def spec(job_dir: Path, **fields: object) -> AgentSpec:
    return AgentSpec(job_dir=job_dir, command=("python", "-c", "pass"), **fields)  # type: ignore[arg-type]


def preflight(
    job_dir: Path,
    checks: dict[str, Check],
    slot: ElasticSlot | None,
    book: Book | None = None,
    node: str = "n3",
) -> int | None:
    """The agent's preflight for job ``job`` on ``node``: what ``run_agent`` calls before
    joining, with the real rules, a one-hour memory of bad nodes and the real event file."""
    return command.check_before_joining(
        checks,
        node=node,
        run_id="job",
        array_slot=slot,
        book=book,
        ttl=3600.0,
        emit=command._emitter(spec(job_dir), "job", slot),
    )


def recorded(job_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (job_dir / "events.jsonl").read_text().splitlines()]


def test_an_unhealthy_node_never_joins_and_its_slot_requeues_away_from_every_bad_node(
    tmp_path: Path,
) -> None:
    slot = array_slot(tmp_path)
    earlier = BadNode("n7", "GPU 0 fell off the bus.", since=0.0, until=NOW_RECORD_UNTIL)
    book = Book(earlier)
    with mocked_slurm() as fake:
        fake.answer("scontrol", "requeue")
        fake.answer("scontrol", "update")
        code = preflight(tmp_path, {"gpu": failing_gpu, "disk": passing_disk}, slot, book=book)
    assert code == 75, "the slot must exit as requeued, to run elsewhere"
    assert fake.ran("scontrol") == [
        ["scontrol", "requeue", "9_2"],
        ["scontrol", "update", "JobId=9_2", "ExcNodeList=n3,n7"],
    ]
    assert [record.host for record in book.saved] == ["n7", "n3"]
    assert book.saved[1].reason == "GPU 1 has 12 uncorrectable ECC errors."
    said = recorded(tmp_path)
    assert [event["kind"] for event in said] == ["health", "exclude", "requeue"]
    health = said[0]["details"]
    assert isinstance(health, dict)
    assert health["healthy"] is False
    assert health["reason"] == "GPU 1 has 12 uncorrectable ECC errors."
    assert health["checks"] == {"gpu": "failed", "disk": "ok"}
    requeue = said[2]["details"]
    assert isinstance(requeue, dict)
    assert (requeue["cause"], requeue["excluded"]) == ("unhealthy", ["n3", "n7"])


def test_a_node_the_user_remembers_as_bad_is_kept_out_though_its_checks_pass(
    tmp_path: Path,
) -> None:
    slot = array_slot(tmp_path)
    book = Book(BadNode("n3", "GPU 1 has ECC errors.", since=0.0, until=NOW_RECORD_UNTIL))
    with mocked_slurm() as fake:
        fake.answer("scontrol", "requeue")
        fake.answer("scontrol", "update")
        code = preflight(tmp_path, {"disk": passing_disk}, slot, book=book)
    assert code == 75
    assert fake.ran("scontrol")[-1] == ["scontrol", "update", "JobId=9_2", "ExcNodeList=n3"]


def test_a_healthy_node_joins_without_a_word_to_slurm(tmp_path: Path) -> None:
    slot = array_slot(tmp_path)
    with mocked_slurm() as fake:
        code = preflight(tmp_path, {"disk": passing_disk}, slot, book=Book())
    assert code is None
    assert fake.calls == []
    assert [event["kind"] for event in recorded(tmp_path)] == ["health"]


def test_outside_slurm_an_unhealthy_node_fails_with_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = preflight(tmp_path, {"gpu": failing_gpu}, None, node="laptop")
    assert code == 1
    message = capsys.readouterr().err.strip()
    assert message == (
        "hpc-elastic agent: node 'laptop' failed its health check, so it does not join job "
        "'job': GPU 1 has 12 uncorrectable ECC errors. Fix the node or run the job elsewhere."
    )


class Runner:
    """Records the stop the bad-node watch asks for (the real ``Agent.request_stop`` drains)."""

    def __init__(self) -> None:
        self.stops: list[int] = []

    def request_stop(self, signum: int) -> None:
        self.stops.append(signum)


@pytest.mark.parametrize("exclude", [True, False])
def test_a_straggling_node_is_left_like_a_bad_one_only_when_asked(
    tmp_path: Path, exclude: bool
) -> None:
    slot = array_slot(tmp_path)
    slot.arrive()
    runner = Runner()
    watch = command._bad_node_watch(slot, runner, spec(tmp_path, exclude_stragglers=exclude))  # type: ignore[arg-type]
    watch(events.Event(kind=events.Kind.STRAGGLER, details={"rank": 1, "score": 3.0}))
    assert runner.stops == ([signal.SIGUSR2] if exclude else [])
    assert slot.placed_badly() is exclude
    if not exclude:
        return
    running = (
        "JobId=9 ArrayJobId=9 ArrayTaskId=2 JobState=RUNNING Reason=None RunTime=00:01:10 "
        "TimeLimit=UNLIMITED PreemptTime=None NodeList=n3\n"
    )
    with mocked_slurm() as fake:
        fake.answer("scontrol", "-o", "show", "job", stdout=running)
        fake.answer("scontrol", "requeue")
        fake.answer("scontrol", "update")
        said: list[str] = []
        assert slot.settle(75, 30.0, lambda kind, **details: said.append(kind)) == 75
    assert fake.ran("scontrol")[-1] == ["scontrol", "update", "JobId=9_2", "ExcNodeList=n3"]
    assert said == ["exclude", "requeue"]


def test_a_hang_blamed_elsewhere_or_on_nobody_never_counts_against_this_node(
    tmp_path: Path,
) -> None:
    """The soak's hang blamed the waiting ranks' node, and the bad-node memory could then
    exclude a healthy node: only a failure that is this node's own counts towards its
    exclusion (``--exclude-after``, 2 by default)."""
    slot = array_slot(tmp_path)
    slot.arrive()
    runner = Runner()
    watch = command._bad_node_watch(slot, runner, spec(tmp_path))  # type: ignore[arg-type]
    elsewhere = events.FailureDetails(
        rank=2, hung=True, sentence="Rank 2 on n1 ...", node_fault=False
    )
    for _ in range(5):
        watch(events.Event(kind=events.Kind.FAILURE, details=elsewhere.to_details()))
    assert runner.stops == []
    assert not slot.placed_badly()
    own = events.FailureDetails(rank=0, hung=True, sentence="Rank 0 on n3 ...")
    for _ in range(2):
        watch(events.Event(kind=events.Kind.FAILURE, details=own.to_details()))
    assert runner.stops == [signal.SIGUSR2]
    assert slot.placed_badly()


def test_a_task_slurm_holds_raises_one_alert_from_the_lowest_running_slot(
    tmp_path: Path,
) -> None:
    # An admin's hold: only reported (a JobHoldMaxRequeue hold is released, test_holds.py).
    held = commands.parse_squeue("9|1|REQUEUE_HOLD|JobHeldAdmin|\n9|0,2|RUNNING|None|n1\n")
    lowest = array_slot(tmp_path, node="n1", task=0)
    other = array_slot(tmp_path)
    said: list[tuple[str, dict[str, object]]] = []
    on_lowest = lowest.holds.watch(lambda kind, **details: said.append((kind, details)))
    on_other = other.holds.watch(lambda kind, **details: said.append((kind, details)))
    for _ in range(3):
        on_lowest(held)
        on_other(held)
    assert said == [("held", {"task": 1, "slurm_job": "9_1", "reason": "JobHeldAdmin"})]
    on_lowest(commands.parse_squeue("9|0-2|RUNNING|None|n1\n"))
    on_lowest(held)
    assert len(said) == 2, "a task released and held again is reported again"
    alert = notify.alert_for(
        events.Event(kind=events.Kind.HELD, job="job", details=said[0][1]), False
    )
    assert alert is not None
    assert alert.kind == "held"
    assert "Slurm holds task 1 (REQUEUE_HOLD)" in alert.message


def test_a_healthy_slot_still_keeps_away_from_the_users_bad_nodes_when_it_moves_later(
    tmp_path: Path,
) -> None:
    slot = array_slot(tmp_path)
    book = Book(BadNode("n7", "GPU 0 fell off the bus.", since=0.0, until=NOW_RECORD_UNTIL))
    emit = command._emitter(spec(tmp_path), "job", slot)
    assert preflight(tmp_path, {"disk": passing_disk}, slot, book=book) is None
    with mocked_slurm() as fake:
        fake.answer("scontrol", "requeue")
        fake.answer("scontrol", "update")
        assert slot.move_away("straggler", emit) == 75
    assert fake.ran("scontrol")[-1] == ["scontrol", "update", "JobId=9_2", "ExcNodeList=n3,n7"]
