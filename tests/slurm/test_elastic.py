"""The Slurm side of elastic slots, on text captured from Slurm 22.05 and fake Slurm calls."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from slurm_fake import FakeSlurm, Reply, mocked_slurm
from slurm_fake import array_slot as slot

from hpc_elastic import events
from hpc_elastic.agent import command
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.cli import app
from hpc_elastic.errors import SlurmError
from hpc_elastic.ops import cancel
from hpc_elastic.ops.jobs import JobRecord
from hpc_elastic.slurm import commands, elastic, queue
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.slurm.elastic import (
    Departure,
    ElasticSlot,
    SlotLedger,
    SlotLimits,
)

# After a preemption: two requeued tasks wait out the requeue delay, one was just granted.
AFTER_PREEMPTION = """\
9|2-3|PENDING|BeginTime|
9|1|PENDING|None|
9|0|RUNNING|None|n1
"""
RUNNING_JOB = (
    "JobId=9 ArrayJobId=9 ArrayTaskId=2 JobName=train JobState={state} Reason=None "
    "RunTime=00:01:10 TimeLimit={limit} PreemptEligibleTime=2026-11-29T10:00:00 "
    "PreemptTime={preempt} SuspendTime=None NodeList=n3\n"
)


def statuses(text: str) -> list[JobStatus]:
    return commands.parse_squeue(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:01:10", 70.0), ("1-02:00:00", 93600.0), ("05:00", 300.0), ("UNLIMITED", None)],
)
def test_parse_duration(text: str, seconds: float | None) -> None:
    assert elastic.parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("limit", "preempt", "why"),
    [
        ("UNLIMITED", "2026-11-29T10:01:10", Departure.PREEMPTION),
        ("00:02:00", "None", Departure.TIME_LIMIT),
        ("01:00:00", "None", Departure.BY_HAND),
        ("UNLIMITED", "None", Departure.BY_HAND),
    ],
)
def test_departure_tells_causes_apart(limit: str, preempt: str, why: Departure) -> None:
    record = commands.parse_scontrol_record(
        RUNNING_JOB.format(state="RUNNING", limit=limit, preempt=preempt)
    )
    assert elastic.departure(record, warning_s=30) is why


@pytest.mark.parametrize(
    ("state", "preempt", "why"),
    [
        ("SIGNALING", "2026-12-01T07:31:03", Departure.PREEMPTION),
        ("SIGNALING", "None", Departure.BY_HAND),
        ("COMPLETING", "None", Departure.CANCELLED),
        ("CANCELLED", "None", Departure.CANCELLED),
    ],
)
def test_a_task_signalled_for_its_preemption_is_preempted_whatever_its_state_says(
    state: str, preempt: str, why: Departure
) -> None:
    """The 30-min soak's task read ``JobState=SIGNALING`` with a ``PreemptTime``: taken for a
    cancel, it was not requeued and the job lost the slot for good."""
    record = commands.parse_scontrol_record(
        RUNNING_JOB.format(state=state, limit="UNLIMITED", preempt=preempt)
    )
    assert elastic.departure(record, warning_s=30) is why


def test_ledger_counts_each_cause_against_its_own_limit() -> None:
    limits = SlotLimits(max_preemptions=1, max_time_limits=0)
    once = SlotLedger().requeued(Departure.PREEMPTION)
    assert once.over_limit(limits) is None
    assert "preempted 2 times" in str(once.requeued(Departure.PREEMPTION).over_limit(limits))
    assert "time limit 1 times" in str(
        SlotLedger().requeued(Departure.TIME_LIMIT).over_limit(limits)
    )


@pytest.fixture
def slurm() -> Iterator[FakeSlurm]:
    """squeue answers AFTER_PREEMPTION, ``scontrol show job`` a preempted job; scancel,
    ``scontrol requeue`` and ``scontrol update`` succeed (``acts`` lists them)."""
    with mocked_slurm() as fake:
        fake.answer("squeue", stdout=AFTER_PREEMPTION)
        fake.answer(
            "scontrol",
            "-o",
            "show",
            "job",
            stdout=RUNNING_JOB.format(
                state="RUNNING", limit="UNLIMITED", preempt="2026-11-29T10:01:10"
            ),
        )
        fake.answer("scancel")
        fake.answer("scontrol", "requeue")
        fake.answer("scontrol", "update")
        yield fake


def acts(fake: FakeSlurm) -> list[list[str]]:
    """The Slurm calls that change something, in order: every scancel and every scontrol but
    ``scontrol -o show`` (a question)."""
    return [
        argv
        for argv in fake.calls
        if argv[0] == "scancel" or (argv[0] == "scontrol" and argv[1] != "-o")
    ]


REQUEUE = ["scontrol", "requeue", "9_2"]
EXCLUDE = ["scontrol", "update", "JobId=9_2", "ExcNodeList=n3"]


def test_only_array_tasks_are_elastic_slots(tmp_path: Path) -> None:
    plain = {"SLURM_JOB_ID": "4", "SLURMD_NODENAME": "n1"}
    assert ElasticSlot.from_env(plain, tmp_path, SlotLimits()) is None
    task = {**plain, "SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "2"}
    assert ElasticSlot.from_env(task, tmp_path, SlotLimits()) is not None


def test_a_preempted_slot_is_requeued_and_says_why(tmp_path: Path, slurm: FakeSlurm) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    code = slot(tmp_path).settle(75, 30.0, lambda kind, **details: said.append((kind, details)))
    assert code == 75
    assert acts(slurm) == [REQUEUE]
    evidence = {
        "JobState": "RUNNING",
        "PreemptTime": "2026-11-29T10:01:10",
        "RunTime": "00:01:10",
        "TimeLimit": "UNLIMITED",
        "asked": "after the drain",
    }
    assert said == [
        (
            "requeue",
            {"cause": "preemption", "slurm": evidence, "slurm_job": "9_2", "excluded": []},
        )
    ]
    assert elastic.load_ledger(tmp_path / "slots" / "2.json").preemptions == 1


@pytest.mark.parametrize(("restarts", "requeued"), [("1", True), ("0", False)])
def test_a_requeue_that_kills_its_own_scontrol_counts_when_slurm_did_it(
    tmp_path: Path,
    slurm: FakeSlurm,
    restarts: str,
    requeued: bool,
) -> None:
    """The requeue signals every process of the step, the scontrol that asked for it too."""
    slurm.answer("scontrol", "requeue", returncode=1)  # killed: it says nothing
    record = (
        RUNNING_JOB.format(state="RUNNING", limit="UNLIMITED", preempt="2026-11-29T10:01:10")
        .strip()
        .replace("NodeList=n3", f"Restarts={restarts} NodeList=n3")
    )
    slurm.answer("scontrol", "-o", "show", "job", stdout=record)
    said: list[str] = []
    code = slot(tmp_path).settle(75, 30.0, lambda kind, **details: said.append(kind))
    assert acts(slurm) == [REQUEUE]
    assert (code, said) == ((75, ["requeue"]) if requeued else (1, ["leave"]))


def test_a_slot_over_its_preemption_limit_is_not_requeued(tmp_path: Path, slurm: FakeSlurm) -> None:
    said: list[str] = []
    code = slot(tmp_path, limits=SlotLimits(max_preemptions=0)).settle(
        75, 30.0, lambda kind, **details: said.append(f"{kind} {details}")
    )
    assert code == 1
    assert acts(slurm) == []
    assert "preempted 1 times (--max-preemptions 0)" in said[0]


def test_a_node_that_fails_the_slot_twice_is_excluded(tmp_path: Path, slurm: FakeSlurm) -> None:
    first = slot(tmp_path)
    first.arrive()
    assert not first.count_failure()
    assert first.count_failure()
    said: list[str] = []
    assert first.settle(75, 30.0, lambda kind, **details: said.append(kind)) == 75
    assert acts(slurm) == [REQUEUE, EXCLUDE]
    assert said == ["exclude", "requeue"]


@pytest.mark.parametrize(("shown", "tries"), [("n3", 1), ("(null)", 3)])
def test_an_exclusion_that_dies_after_the_requeue_is_tried_again_and_never_loses_the_slot(
    tmp_path: Path, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch, shown: str, tries: int
) -> None:
    """The soak's requeued task came back, yet its agent said "not requeued" and exited 1:
    the ``scontrol update`` that sets ``ExcNodeList`` died as the requeue's own may. A try
    whose effect Slurm shows is done; else the slot is requeued all the same, with a warning."""
    slurm.answer("scontrol", "update", returncode=1)  # killed: it says nothing
    record = (
        RUNNING_JOB.format(state="PENDING", limit="UNLIMITED", preempt="2026-11-29T10:01:10")
        .strip()
        .replace("NodeList=n3", f"ExcNodeList={shown} NodeList=n3")
    )
    slurm.answer("scontrol", "-o", "show", "job", stdout=record)
    monkeypatch.setattr(elastic, "SCONTROL_PAUSE", 0.0)
    first = slot(tmp_path)
    first.arrive()
    first.count_failure()
    first.count_failure()
    said: list[tuple[str, dict[str, object]]] = []
    assert first.settle(75, 30.0, lambda kind, **details: said.append((kind, details))) == 75
    assert acts(slurm) == [REQUEUE] + [EXCLUDE] * tries
    kinds = [kind for kind, _ in said]
    if tries == 1:
        assert kinds == ["exclude", "requeue"]
    else:
        assert kinds == ["exclude", "warning", "requeue"]
        assert "requeued without keeping away from n3" in str(said[1][1]["message"])


def test_an_incarnation_that_died_with_its_node_counts_as_a_failure(tmp_path: Path) -> None:
    slot(tmp_path, "n4").arrive()
    again = slot(tmp_path, "n1")
    assert again.arrive().node_failure == "n4"
    again.leave()
    assert slot(tmp_path, "n2").arrive() == elastic.Arrival()
    assert elastic.load_ledger(again.ledger_path).node_failures == {"n4": 1}


@pytest.mark.parametrize("why", [Departure.PREEMPTION, Departure.TIME_LIMIT])
def test_a_slot_killed_after_gracetime_while_leaving_is_no_node_failure(why: Departure) -> None:
    """Slurm SIGKILLs a slot still saving when GraceTime ends: its node did nothing wrong."""
    leaving = SlotLedger(running_on="n4", leaving_for=why.value)
    ledger, arrival = leaving.arrived("n1")
    assert arrival == elastic.Arrival(crashed_on="n4", killed_leaving=why)
    assert arrival.node_failure is None
    assert ledger.node_failures == {}
    assert ledger == replace(SlotLedger().requeued(why), running_on="n1")


@pytest.mark.parametrize("later", ["RUNNING", "PENDING"], ids=["preempt-time-gone", "requeued"])
def test_the_cause_is_what_slurm_said_when_the_signal_arrived(
    tmp_path: Path, slurm: FakeSlurm, later: str
) -> None:
    """After the drain Slurm may have moved on (no PreemptTime, or requeued already): the
    cause it gave when the signal arrived is the one that counts."""
    answers = [
        RUNNING_JOB.format(state="RUNNING", limit="UNLIMITED", preempt="2026-11-29T10:01:10"),
        RUNNING_JOB.format(state=later, limit="UNLIMITED", preempt="None"),
    ]
    slurm.respond("scontrol", "-o", "show", "job", responder=lambda argv: Reply(answers.pop(0)))
    preempted = slot(tmp_path)
    preempted.arrive()
    watch = preempted.watch_departure(30.0)
    watch.signalled(12)
    assert watch.answer(30.0) is not None
    said: list[tuple[str, object, object]] = []
    assert (
        preempted.settle(
            75, 30.0, lambda kind, **d: said.append((kind, d.get("cause"), d["slurm"]["asked"]))
        )
        == 75
    )
    assert said == [("requeue", "preemption", "at the signal")]
    assert acts(slurm) == [REQUEUE]


def test_a_slurm_too_busy_to_answer_at_the_signal_is_asked_again(
    tmp_path: Path, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slurmctld, busy with the very preemption, may drop a request: retry, then settle asks."""
    busy_slurm = Reply(
        stderr="slurm_load_jobs error: Socket timed out on send/recv operation\n", returncode=1
    )
    preempted = Reply(
        RUNNING_JOB.format(state="RUNNING", limit="UNLIMITED", preempt="2026-11-29T10:01:10")
    )
    answers = [busy_slurm, busy_slurm, busy_slurm, busy_slurm, preempted]
    slurm.respond("scontrol", "-o", "show", "job", responder=lambda argv: answers.pop(0))
    monkeypatch.setattr(elastic, "SCONTROL_PAUSE", 0.0)
    busy = slot(tmp_path)
    watch = busy.watch_departure(30.0)
    watch.signalled(12)
    assert watch.answer(30.0) is None, "three failed tries at the signal give no answer"
    said: list[tuple[str, object, object]] = []
    code = busy.settle(
        75, 30.0, lambda kind, **d: said.append((kind, d.get("cause"), d["slurm"]["asked"]))
    )
    assert code == 75
    assert said == [("requeue", "preemption", "after the drain")]


def test_without_a_signal_slurm_is_asked_when_the_slot_settles(
    tmp_path: Path, slurm: FakeSlurm
) -> None:
    """Workers that stopped by themselves (exit 75), or the bad-node watch, send no signal."""
    quiet = slot(tmp_path)
    quiet.watch_departure(30.0)
    said: list[tuple[str, object]] = []
    assert quiet.settle(75, 30.0, lambda kind, **d: said.append((kind, d.get("cause")))) == 75
    assert said == [("requeue", "preemption")]


def test_a_slot_that_died_while_running_is_a_node_failure() -> None:
    ledger, arrival = SlotLedger(running_on="n4").arrived("n1")
    assert arrival.node_failure == "n4"
    assert ledger.node_failures == {"n4": 1}
    assert ledger.running_on == "n1"


def test_a_preemption_noted_at_the_signal_survives_slurms_sigkill(
    tmp_path: Path, slurm: FakeSlurm
) -> None:
    """The watch notes the cause in the ledger as soon as Slurm answers, before any drain."""
    first = slot(tmp_path, "n4")
    first.arrive()
    watch = first.watch_departure(30.0)
    watch.signalled(12)
    assert watch.answer(30.0) is not None
    # SIGKILLed here, after GraceTime: neither requeue() nor leave() ran.
    arrival = slot(tmp_path, "n1").arrive()
    assert arrival == elastic.Arrival(crashed_on="n4", killed_leaving=Departure.PREEMPTION)
    assert elastic.load_ledger(first.ledger_path).preemptions == 1


def test_when_the_job_is_over_pending_slots_are_cancelled(tmp_path: Path, slurm: FakeSlurm) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    assert slot(tmp_path).settle(0, 30.0, lambda kind, **d: said.append((kind, d))) == 0
    assert acts(slurm) == [["scancel", "9_[1,3]"]]
    assert said == [("cancel_pending", {"tasks": [1, 3], "running": []})]


def test_a_stopped_slot_cancels_nothing(tmp_path: Path, slurm: FakeSlurm) -> None:
    assert slot(tmp_path).settle(143, 30.0, lambda kind, **d: None) == 143
    assert acts(slurm) == []


def test_a_slot_that_lost_zookeeper_for_good_is_neither_requeued_nor_ends_the_job(
    tmp_path: Path, slurm: FakeSlurm
) -> None:
    """Exit 69 (``--zk-outage-limit``): a requeue would only join the same dead ensemble, and
    a partition of this node alone looks the same, so the job is left to the others."""
    said: list[str] = []
    code = slot(tmp_path).settle(ExitCode.UNREACHABLE, 30.0, lambda kind, **d: said.append(kind))
    assert code == ExitCode.UNREACHABLE
    assert acts(slurm) == [], "no scontrol requeue, no scancel of the pending tasks"
    assert said == []


# --- the end of the job: every sibling, whatever Slurm shows, but never one that is leaving ---

SIBLINGS = "9|1|RUNNING|None|n2\n9|2|RUNNING|None|n3\n9|3|PENDING|BeginTime|\n"
"""Task 2 (the slot under test) ends the job; task 1 runs on n2, task 3 was requeued."""


def sibling_ran(job_dir: Path, task: int, node: str | None) -> None:
    """Task ``task``'s ledger as its agent left it: ``node`` while it ran, None once it left."""
    elastic.save_ledger(job_dir / "slots" / f"{task}.json", SlotLedger(running_on=node))


def said_at(job_dir: Path, kind: events.Kind, at: float, slot: str = "", **details: object) -> None:
    path = job_dir / "events.jsonl"
    events.append(path, events.Event(kind=kind, slot=slot, details=dict(details), time=at))


def ends(job_dir: Path, code: int = 0, grace: float = 0.0) -> tuple[int, list[dict[str, object]]]:
    """Slot 9_2 settles with ``code``; its exit code and the cancel_pending events it wrote."""
    said: list[tuple[str, dict[str, object]]] = []
    exit_code = slot(job_dir).settle(code, grace, lambda kind, **d: said.append((kind, d)))
    return exit_code, [details for kind, details in said if kind == "cancel_pending"]


@pytest.mark.parametrize(
    ("state", "verdict"),
    [
        ("PENDING", elastic.Sibling.WAITING),
        ("REQUEUED", elastic.Sibling.WAITING),
        ("REQUEUE_HOLD", elastic.Sibling.WAITING),
        ("CONFIGURING", elastic.Sibling.WAITING),
        ("SPECIAL_EXIT", elastic.Sibling.WAITING),
        ("A_STATE_OF_SLURM_27", elastic.Sibling.WAITING),
        ("COMPLETING", elastic.Sibling.GONE),
        ("COMPLETED", elastic.Sibling.GONE),
        ("CANCELLED", elastic.Sibling.GONE),
        ("RUNNING", elastic.Sibling.FINISHING),
        ("SIGNALING", elastic.Sibling.FINISHING),
        ("SUSPENDED", elastic.Sibling.FINISHING),
    ],
)
def test_every_state_slurm_shows_has_its_end(state: str, verdict: elastic.Sibling) -> None:
    [status] = statuses(f"9|1|{state}|None|n2\n")
    assert elastic.sibling_at_end(status, SlotLedger(running_on="n2"), lost=False) is verdict


@pytest.mark.parametrize(
    ("running_on", "lost", "verdict"),
    [
        ("n2", True, elastic.Sibling.LOST),
        ("n2", False, elastic.Sibling.FINISHING),
        (None, True, elastic.Sibling.LEFT),  # its agent left cleanly: Slurm just lags
        ("n4", True, elastic.Sibling.LEFT),  # a new incarnation on n2, not yet arrived
    ],
)
def test_a_running_sibling_is_cancelled_at_once_only_when_its_agent_is_known_gone(
    running_on: str | None, lost: bool, verdict: elastic.Sibling
) -> None:
    [status] = statuses("9|1|RUNNING|None|n2\n")
    assert elastic.sibling_at_end(status, SlotLedger(running_on=running_on), lost) is verdict
    unreadable = elastic.sibling_at_end(status, None, lost)
    assert unreadable is (elastic.Sibling.LOST if lost else elastic.Sibling.FINISHING)


def test_a_slot_is_lost_from_its_node_lost_until_it_is_heard_from_again() -> None:
    def event(kind: events.Kind, slot: str, at: float, **details: object) -> events.Event:
        return events.Event(kind=kind, slot=slot, details=dict(details), time=at)

    timeline = [
        event(events.Kind.CHECKPOINT, "1", 1.0),
        event(events.Kind.CHECKPOINT, "3", 1.0),
        event(events.Kind.NODE_LOST, "0", 2.0, nodes=["1", "3"]),
        event(events.Kind.JOIN, "3", 3.0),  # slot 3 came back
        event(events.Kind.NODE_LOST, "0", 4.0, nodes="garbage"),
    ]
    assert elastic.lost_slots(timeline) == {"1"}


def test_the_own_task_is_never_among_those_the_end_cancels() -> None:
    plan = elastic.end_plan(
        statuses(SIBLINGS), 2, lambda task: SlotLedger(running_on=f"n{task + 1}"), {"1", "2"}
    )
    assert plan == elastic.EndPlan(cancel=(1, 3), lost=(1,), finishing=())


def test_the_task_of_a_crashed_node_that_slurm_shows_running_is_cancelled_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm 22.05 notices a task missing from a node whose slurmd came back without a reboot
    only at the node's next registration (minutes): the end of the job must not leave it."""
    sibling_ran(tmp_path, 1, "n2")
    said_at(tmp_path, events.Kind.CHECKPOINT, 1.0, slot="1")
    said_at(tmp_path, events.Kind.NODE_LOST, 2.0, slot="2", nodes=["1"])
    monkeypatch.setattr(elastic, "END_POLL_S", 60.0)  # a wait would show as a hung test
    with mocked_slurm() as fake:
        fake.answer("squeue", stdout=SIBLINGS)
        fake.answer("scancel")
        code, cancelled = ends(tmp_path)
    assert code == 0
    assert fake.ran("scancel") == [["scancel", "9_[1,3]"]]
    assert cancelled == [{"tasks": [1, 3], "running": [1]}]


def test_a_sibling_still_on_its_way_out_is_waited_for_and_never_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job is closed before any agent cancels, so a live sibling leaves by itself: cut
    short, it would end CANCELLED instead of COMPLETED, or lose the save its workers make."""
    sibling_ran(tmp_path, 1, "n2")
    monkeypatch.setattr(elastic, "END_POLL_S", 0.0)

    def squeue(argv: list[str]) -> Reply:
        if len(fake.ran("squeue")) == 2:  # while this agent waits, the sibling settles:
            sibling_ran(tmp_path, 1, None)  # its ledger first, and Slurm still shows it running
        return Reply(stdout=SIBLINGS)

    with mocked_slurm() as fake:
        fake.respond("squeue", responder=squeue)
        fake.answer("scancel")
        code, cancelled = ends(tmp_path, grace=30.0)
    assert code == 0
    assert fake.ran("scancel") == [["scancel", "9_[3]"]]
    assert cancelled == [{"tasks": [3], "running": []}]
    assert len(fake.ran("squeue")) == 2, "it waited once, then saw the sibling's ledger"


def test_a_sibling_that_never_leaves_is_cancelled_after_its_grace_and_the_margin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that died with no round after it (a spare, or the last round's end): the
    rendezvous never said it was lost, so only the bounded wait ends it."""
    sibling_ran(tmp_path, 1, "n2")
    monkeypatch.setattr(elastic, "END_POLL_S", 0.01)
    monkeypatch.setattr(elastic, "END_MARGIN_S", 0.05)
    with mocked_slurm() as fake:
        fake.answer("squeue", stdout=SIBLINGS)
        fake.answer("scancel")
        _, cancelled = ends(tmp_path)
    assert fake.ran("scancel") == [["scancel", "9_[3]"], ["scancel", "9_[1]"]]
    assert cancelled == [{"tasks": [3], "running": []}, {"tasks": [1], "running": [1]}]


def test_an_agent_that_exits_1_on_its_own_cancels_nothing_since_the_job_goes_on(
    tmp_path: Path,
) -> None:
    said_at(tmp_path, events.Kind.ERROR, 1.0, slot="2", reason="a bug", exit_code=1)
    with mocked_slurm() as fake:  # told nothing: any Slurm call fails the test
        assert ends(tmp_path, code=1) == (1, [])
    assert fake.calls == []


def test_an_agent_that_exits_1_because_the_job_failed_ends_every_sibling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sibling_ran(tmp_path, 1, "n2")
    said_at(tmp_path, events.Kind.NODE_LOST, 2.0, slot="2", nodes=["1"])
    said_at(tmp_path, events.Kind.FAILED, 3.0, slot="2", reason="restart budget spent")
    monkeypatch.setattr(elastic, "END_POLL_S", 60.0)
    with mocked_slurm() as fake:
        fake.answer("squeue", stdout=SIBLINGS)
        fake.answer("scancel")
        assert ends(tmp_path, code=1) == (1, [{"tasks": [1, 3], "running": [1]}])


def test_an_unreadable_ledger_is_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / "2.json"
    path.write_text("{not json")
    with pytest.raises(SlurmError, match="start afresh") as raised:
        elastic.load_ledger(path)
    assert f"'{path}'" in str(raised.value)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"preemptions": "x"}', "\udcff"])
def test_an_unreadable_ledger_starts_the_slot_afresh_with_a_warning(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "slots" / "2.json"
    path.parent.mkdir()
    path.write_text(text, errors="surrogateescape")
    fresh = slot(tmp_path)
    assert fresh.ledger == SlotLedger()
    assert fresh.problem is not None
    assert f"'{path}' is not a readable slot record" in fresh.problem
    assert fresh.arrive() == elastic.Arrival()
    assert elastic.load_ledger(path) == SlotLedger(running_on="n3")


def test_the_ledger_is_on_disk_before_and_after_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync the new record, rename it over the old one, fsync the directory that holds it."""
    steps: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        steps.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        steps.append(("rename", str(target)))
        rename(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    path = tmp_path / "slots" / "2.json"
    elastic.save_ledger(path, SlotLedger(preemptions=3))
    [(first, scratch), second, third] = steps
    assert first == "fsync"
    assert Path(scratch).parent == path.parent
    assert scratch != str(path)
    assert [second, third] == [("rename", str(path)), ("fsync", str(path.parent))]
    assert elastic.load_ledger(path) == SlotLedger(preemptions=3)


def test_cancel_ends_the_array_then_closes_the_rendezvous(tmp_path: Path) -> None:
    record = JobRecord(
        run_id="train-1",
        job_dir=tmp_path,
        job_id="9",
        local=False,
        zk="127.0.0.1:2181",
        nodes="1:4",
        nproc_per_node=2,
        max_restarts=3,
    )
    order: list[str] = []
    done = cancel.cancel(
        record,
        lambda job_id: order.append(f"scancel {job_id}"),
        lambda rec: order.append(f"close {rec.run_id}"),
    )
    assert order == ["scancel 9", "close train-1"]
    assert done == ["cancelled Slurm job 9 (every slot)", "closed the rendezvous"]
    assert [event.kind for event in record.events()] == ["cancel"]


def test_cancel_of_an_unknown_job_is_one_sentence(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["cancel", "nope", "--log-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "Job 'nope' is unknown" in result.output


def test_pending_slots_already_gone_are_no_error(tmp_path: Path, slurm: FakeSlurm) -> None:
    slurm.answer(
        "scancel",
        stderr="scancel: error: Kill job error on job id 9_[1,3]: Job has already finished\n",
        returncode=1,
    )
    assert slot(tmp_path).settle(0, 30.0, lambda kind, **d: None) == 0
    assert acts(slurm) == [["scancel", "9_[1,3]"]]


def test_a_cancelled_slot_is_not_requeued(tmp_path: Path, slurm: FakeSlurm) -> None:
    """scancel sends SIGTERM, which the workers also answer by saving and exiting 75."""
    cancelled = RUNNING_JOB.format(state="CANCELLED", limit="UNLIMITED", preempt="None")
    slurm.answer("scontrol", "-o", "show", "job", stdout=cancelled)
    said: list[tuple[str, object]] = []
    assert slot(tmp_path).settle(75, 30.0, lambda kind, **d: said.append((kind, d))) == 75
    assert acts(slurm) == []
    [(kind, details)] = said
    assert kind == "cancelled"
    assert details["slurm"]["JobState"] == "CANCELLED"  # type: ignore[index]


def test_an_unreadable_ledger_is_a_warning_event_and_the_agent_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "slots" / "2.json"
    path.parent.mkdir()
    path.write_text("{not json")
    spec = AgentSpec(job_dir=tmp_path, command=("train",))
    command._arrive(slot(tmp_path), spec, "run-1")
    [warning] = [event for event in events.read(spec.events_file) if event.kind == "warning"]
    assert f"'{path}' is not a readable slot record" in str(warning.details["message"])
    assert elastic.load_ledger(path).running_on == "n3"


# --- hot spares (submit --spares) -------------------------------------------------------------


def _rendered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> str:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPC_ELASTIC_ZK", raising=False)
    (tmp_path / "train.py").write_text("print('training')\n")
    result = CliRunner().invoke(app, ["render", *flags, "train.py"])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_spares_add_array_slots_beyond_max_and_make_a_fixed_job_an_array(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _rendered(tmp_path, monkeypatch, "--nodes", "2", "--spares", "1")
    assert "#SBATCH --array=0-2\n" in script
    assert "--no-kill" not in script
    assert "--nodes 2:2 \\\n" in script, "a fixed job with spares starts at N, not at 1"
    elastic_job = _rendered(tmp_path, monkeypatch, "--nodes", "1:4", "--spares", "2")
    assert "#SBATCH --array=0-5\n" in elastic_job
    assert "--nodes 1:4 \\\n" in elastic_job


def test_no_spares_leave_the_script_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "--no-kill" in _rendered(tmp_path, monkeypatch, "--nodes", "2", "--spares", "0")
    assert "#SBATCH --array=0-3\n" in _rendered(tmp_path, monkeypatch, "--nodes", "1:4")


def test_negative_spares_are_refused_in_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('training')\n")
    result = CliRunner().invoke(app, ["render", "--spares", "-1", "train.py"])
    assert result.exit_code != 0
    assert "--spares '-1'" in result.output
    assert "Traceback" not in result.output


# --- held tasks: release a churn hold under the no-progress breaker, announce the last ---

CHURN_HELD = "9|1|REQUEUE_HOLD|JobHoldMaxRequeue|\n9|0|RUNNING|None|n1\n"
ADMIN_HELD = "9|1|REQUEUE_HOLD|JobHeldAdmin|\n9|3|PENDING|JobHeldUser|\n9|0|RUNNING|None|n1\n"


@pytest.mark.parametrize(
    ("record", "progress", "allowed"),
    [
        (elastic.HoldRecord(), None, True),
        (elastic.HoldRecord(releases=1, released_at=40), 40, False),
        (elastic.HoldRecord(releases=1, released_at=40), 50, True),
        (elastic.HoldRecord(releases=1, released_at=None), None, False),
        (elastic.HoldRecord(releases=1, released_at=None), 10, True),
    ],
)
def test_a_hold_is_released_again_only_after_a_newer_checkpoint(
    record: elastic.HoldRecord, progress: int | None, allowed: bool
) -> None:
    assert elastic.may_release(record, progress) is allowed


@pytest.mark.parametrize(("restarts", "held"), [(4, False), (5, True), (9, True)])
def test_a_requeue_past_max_batch_requeue_is_held(restarts: int, held: bool) -> None:
    assert elastic.will_be_held(restarts, 5) is held


def test_the_site_limit_is_read_from_scontrol_show_config() -> None:
    config = commands.parse_scontrol_config("Configuration data\nMaxBatchRequeue         = 2\n")
    assert commands.max_batch_requeue(config) == 2
    assert commands.max_batch_requeue({}) == commands.DEFAULT_MAX_BATCH_REQUEUE


def test_progress_is_the_newest_committed_checkpoint_step() -> None:
    timeline = [
        events.Event(kind=events.Kind.CHECKPOINT, details={"step": 30}),
        events.Event(kind=events.Kind.CHECKPOINT, details={"step": 20}),
        events.Event(kind=events.Kind.ROUND, details={"round": 4}),
    ]
    assert elastic.newest_checkpoint_step(timeline) == 30
    assert elastic.newest_checkpoint_step(timeline[2:]) is None


def lowest_slot(job_dir: Path) -> ElasticSlot:
    """Task 0 of array 9, the lowest running slot in CHURN_HELD: the one that acts on holds."""
    lowest = slot(job_dir)
    lowest.context = replace(lowest.context, array_task_id=0, node_name="n1")
    return lowest


def checkpoint(job_dir: Path, step: int) -> None:
    path = job_dir / "events.jsonl"
    events.append(path, events.Event(kind=events.Kind.CHECKPOINT, details={"step": step}))


def test_a_churn_hold_is_released_until_the_job_stops_progressing(tmp_path: Path) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "release")
        observe = lowest_slot(tmp_path).watch_held(lambda kind, **d: said.append((kind, d)))
        checkpoint(tmp_path, 10)
        observe(statuses(CHURN_HELD))
        observe(statuses("9|0-1|RUNNING|None|n1\n"))
        observe(statuses(CHURN_HELD))  # held again, no checkpoint since: the breaker
        observe(statuses(CHURN_HELD))
        checkpoint(tmp_path, 20)
        observe(statuses(CHURN_HELD))  # progress again: released again
    assert fake.ran("scontrol") == [["scontrol", "release", "9_1"]] * 2
    assert [kind for kind, _ in said] == ["released", "held", "released"]
    assert said[0][1] == {"task": 1, "slurm_job": "9_1", "releases": 1, "progress": 10}
    assert said[1][1] == {"task": 1, "slurm_job": "9_1", "reason": "JobHoldMaxRequeue"}
    assert elastic.load_hold_record(tmp_path / "slots" / "1.holds.json") == elastic.HoldRecord(
        releases=2, released_at=20
    )


def test_an_admins_or_users_hold_is_reported_never_released(tmp_path: Path) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        observe = lowest_slot(tmp_path).watch_held(lambda kind, **d: said.append((kind, d)))
        observe(statuses(ADMIN_HELD))
    assert fake.ran("scontrol") == []
    assert [(kind, d["task"], d["reason"]) for kind, d in said] == [
        ("held", 1, "JobHeldAdmin"),
        ("held", 3, "JobHeldUser"),
    ]


def test_a_new_agent_does_not_repeat_the_alert_for_the_same_hold(tmp_path: Path) -> None:
    said: list[str] = []
    with mocked_slurm() as fake:
        for _incarnation in range(3):  # each new agent process starts with empty memory
            lowest_slot(tmp_path).watch_held(lambda kind, **d: said.append(kind))(
                statuses(ADMIN_HELD)
            )
    assert fake.ran("scontrol") == []
    assert said == ["held", "held"], "one alert per held task, not one per agent process"


def test_a_failed_release_is_reported_instead(tmp_path: Path) -> None:
    said: list[str] = []
    with mocked_slurm() as fake:
        fake.answer(
            "scontrol", "release", stderr="scontrol: error: Access/permission denied", returncode=1
        )
        lowest_slot(tmp_path).watch_held(lambda kind, **d: said.append(kind))(statuses(CHURN_HELD))
    assert said == ["held"]


# What squeue showed on the dev cluster (Slurm 22.05.8), polled every 0.1 s, for a task held
# for JobHoldMaxRequeue (CHURN_HELD) after an `scontrol release`, here as task 1: the
# REQUEUE_HOLD state the release leaves behind, with no reason, then with the requeue delay's
# (BeginTime, about 5 s), until the task starts.
RELEASED_STILL_SHOWN = (
    "9|1|REQUEUE_HOLD|None|\n9|0|RUNNING|None|n1\n",
    "9|1|REQUEUE_HOLD|BeginTime|\n9|0|RUNNING|None|n1\n",
    "9|0-1|RUNNING|None|n[1-2]\n",
)


def test_a_task_released_but_still_shown_requeue_hold_is_not_a_new_hold(tmp_path: Path) -> None:
    """Slurm 22.05's release clears the hold's priority and reason but not the REQUEUE_HOLD
    state flag, which stays until the task starts: counted as held, the releasing slot raised
    a second ``held`` alert (reason BeginTime) for a hold it had just ended, and counted one
    more ended hold when the task started."""
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "release")
        observe = lowest_slot(tmp_path).watch_held(lambda kind, **d: said.append((kind, d)))
        observe(statuses(CHURN_HELD))
        for shown in RELEASED_STILL_SHOWN:
            observe(statuses(shown))
    assert fake.ran("scontrol") == [["scontrol", "release", "9_1"]]
    assert [kind for kind, _ in said] == ["released"]
    assert elastic.load_hold_record(tmp_path / "slots" / "1.holds.json") == elastic.HoldRecord(
        releases=1
    )


def test_a_task_requeued_held_by_hand_is_held_whatever_its_state(tmp_path: Path) -> None:
    """``scontrol requeuehold`` leaves the task PENDING, its reason the text "job requeued in
    held state" (squeue prints the spaces): someone's decision, reported and never released."""
    shown = "9|1|PENDING|job requeued in held state|\n9|0|RUNNING|None|n1\n"
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        lowest_slot(tmp_path).watch_held(lambda kind, **d: said.append((kind, d)))(statuses(shown))
    assert fake.ran("scontrol") == []
    assert [(kind, d["task"], d["reason"]) for kind, d in said] == [
        ("held", 1, "job_requeued_in_held_state")
    ]


def preempted_at(job_dir: Path, restarts: int) -> ElasticSlot:
    moving = slot(job_dir)
    moving.context = replace(moving.context, restart_count=restarts)
    return moving


OWN_HELD = "JobId=9 ArrayJobId=9 ArrayTaskId=2 JobState=PENDING Reason=JobHoldMaxRequeue Restarts=6"
OWN_PENDING = "JobId=9 ArrayJobId=9 ArrayTaskId=2 JobState=PENDING Reason=BeginTime Restarts=6"
ALONE = "9|2|PENDING|JobHoldMaxRequeue|\n"


@pytest.mark.parametrize(
    ("restarts", "after", "siblings", "announced"),
    [
        (5, OWN_HELD, ALONE, True),
        (5, OWN_PENDING, ALONE, False),  # Slurm 22.05: an scontrol requeue never holds
        (5, OWN_HELD, ALONE + "9|0|RUNNING|None|n1\n", False),  # slot 0 will see it
    ],
)
def test_the_last_slot_announces_its_own_hold_before_it_leaves(
    tmp_path: Path, restarts: int, after: str, siblings: str, announced: bool
) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "show", "config", stdout="MaxBatchRequeue = 5\n")
        fake.answer("scontrol", "-o", "show", "job", stdout=after)
        fake.answer("squeue", stdout=siblings)
        fake.answer("scontrol", "requeue")
        moving = preempted_at(tmp_path, restarts)
        moving.requeue(Departure.PREEMPTION, lambda kind, **d: said.append((kind, d)))
        moving.requeue(Departure.PREEMPTION, lambda kind, **d: said.append((kind, d)))
    held = [d for kind, d in said if kind == "held"]
    expected = {
        "task": 2,
        "slurm_job": "9_2",
        "reason": "JobHoldMaxRequeue",
        "restarts": restarts + 1,
        "limit": 5,
        "last": True,
    }
    assert held == ([expected] if announced else [])
    configs = [argv for argv in fake.ran("scontrol") if argv[1:3] == ["show", "config"]]
    assert len(configs) == 1, "the site's limit is asked once per agent"


def test_below_the_limit_slurm_is_not_even_asked(tmp_path: Path) -> None:
    said: list[str] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "show", "config", stdout="MaxBatchRequeue = 5\n")
        fake.answer("scontrol", "requeue")
        preempted_at(tmp_path, 4).requeue(Departure.PREEMPTION, lambda k, **d: said.append(k))
    assert fake.ran("squeue") == []
    assert [argv[1] for argv in fake.ran("scontrol")] == ["requeue", "show"]
    assert said == []


def test_a_hold_the_last_slot_announced_is_not_announced_again_by_the_slot_that_sees_it(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "show", "config", stdout="MaxBatchRequeue = 5\n")
        fake.answer("scontrol", "-o", "show", "job", stdout=OWN_HELD)
        fake.answer("squeue", stdout=ALONE)
        fake.answer("scontrol", "requeue")
        fake.answer("scontrol", "release", returncode=1, stderr="Access/permission denied")
        moving = preempted_at(tmp_path, 5)
        assert moving.requeue(Departure.PREEMPTION, lambda k, **d: said.append(k)) is None
        # Slurm starts slot 0 later; it cannot release the hold, and must not alert again.
        lowest_slot(tmp_path).watch_held(lambda kind, **d: said.append(kind))(
            statuses(ALONE + "9|0|RUNNING|None|n1\n")
        )
    assert said == ["held"]


def test_a_hold_the_slot_reports_is_posted_to_the_notify_url_and_its_other_events_are_not(
    tmp_path: Path,
) -> None:
    # The slot's own events reach the notifier through the agent's emitter, not the Agent's
    # observers: the held report comes from the squeue thread, or from settle after the Agent.
    from hpc_elastic import notify  # noqa: PLC0415

    posted: list[bytes] = []
    delivered = threading.Event()

    def send(url: str, body: bytes, timeout: float) -> int:
        posted.append(body)
        delivered.set()
        return 200

    notifier = notify.Notifier("http://127.0.0.1:9/hook", send=send)
    emit = command._emitter(
        AgentSpec(job_dir=tmp_path, command=("train",)), "job", slot(tmp_path), notifier
    )
    emit(events.Kind.REQUEUE, cause="bad_node", slurm_job="9_2", excluded=["n3"])
    emit(events.Kind.HELD, task=1, slurm_job="9_1", reason=queue.CHURN_HOLD)
    assert delivered.wait(10), "the held alert was never posted"
    notifier.close()
    assert len(posted) == 1, posted
    body = json.loads(posted[0])
    assert (body["kind"], body["details"]["slurm_job"]) == ("held", "9_1")
    # The agent has no TORCHELASTIC_RUN_ID of its own: the job and slot are the event's.
    assert (body["job"], body["slot"]) == ("job", "2")
    assert [e.kind for e in events.read(tmp_path / "events.jsonl")] == ["requeue", "held"]
