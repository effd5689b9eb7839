"""The end of an elastic job (slurm/ending.py): which siblings are cancelled at once, which are
waited for, and which never, with Slurm faked at its one subprocess call."""

from __future__ import annotations

from pathlib import Path

import pytest
from slurm_fake import Reply, mocked_slurm
from slurm_fake import array_slot as slot
from test_elastic import statuses

from hpc_elastic import events
from hpc_elastic.slurm import ending
from hpc_elastic.slurm.ledger import SlotLedger, save_ledger

# --- the end of the job: every sibling, whatever Slurm shows, but never one that is leaving ---

SIBLINGS = "9|1|RUNNING|None|n2\n9|2|RUNNING|None|n3\n9|3|PENDING|BeginTime|\n"
"""Task 2 (the slot under test) ends the job; task 1 runs on n2, task 3 was requeued."""


def sibling_ran(job_dir: Path, task: int, node: str | None) -> None:
    """Task ``task``'s ledger as its agent left it: ``node`` while it ran, None once it left."""
    save_ledger(job_dir / "slots" / f"{task}.json", SlotLedger(running_on=node))


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
        ("PENDING", ending.Sibling.WAITING),
        ("REQUEUED", ending.Sibling.WAITING),
        ("REQUEUE_HOLD", ending.Sibling.WAITING),
        ("CONFIGURING", ending.Sibling.WAITING),
        ("SPECIAL_EXIT", ending.Sibling.WAITING),
        ("A_STATE_OF_SLURM_27", ending.Sibling.WAITING),
        ("COMPLETING", ending.Sibling.GONE),
        ("COMPLETED", ending.Sibling.GONE),
        ("CANCELLED", ending.Sibling.GONE),
        ("RUNNING", ending.Sibling.FINISHING),
        ("SIGNALING", ending.Sibling.FINISHING),
        ("SUSPENDED", ending.Sibling.FINISHING),
    ],
)
def test_every_state_slurm_shows_has_its_end(state: str, verdict: ending.Sibling) -> None:
    [status] = statuses(f"9|1|{state}|None|n2\n")
    assert ending.sibling_at_end(status, SlotLedger(running_on="n2"), lost=False) is verdict


@pytest.mark.parametrize(
    ("running_on", "lost", "verdict"),
    [
        ("n2", True, ending.Sibling.LOST),
        ("n2", False, ending.Sibling.FINISHING),
        (None, True, ending.Sibling.LEFT),  # its agent left cleanly: Slurm just lags
        ("n4", True, ending.Sibling.LEFT),  # a new incarnation on n2, not yet arrived
    ],
)
def test_a_running_sibling_is_cancelled_at_once_only_when_its_agent_is_known_gone(
    running_on: str | None, lost: bool, verdict: ending.Sibling
) -> None:
    [status] = statuses("9|1|RUNNING|None|n2\n")
    assert ending.sibling_at_end(status, SlotLedger(running_on=running_on), lost) is verdict
    unreadable = ending.sibling_at_end(status, None, lost)
    assert unreadable is (ending.Sibling.LOST if lost else ending.Sibling.FINISHING)


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
    assert ending.lost_slots(timeline) == {"1"}


def test_the_own_task_is_never_among_those_the_end_cancels() -> None:
    plan = ending.end_plan(
        statuses(SIBLINGS), 2, lambda task: SlotLedger(running_on=f"n{task + 1}"), {"1", "2"}
    )
    assert plan == ending.EndPlan(cancel=(1, 3), lost=(1,), finishing=())


def test_the_task_of_a_crashed_node_that_slurm_shows_running_is_cancelled_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm 22.05 notices a task missing from a node whose slurmd came back without a reboot
    only at the node's next registration (minutes): the end of the job must not leave it."""
    sibling_ran(tmp_path, 1, "n2")
    said_at(tmp_path, events.Kind.CHECKPOINT, 1.0, slot="1")
    said_at(tmp_path, events.Kind.NODE_LOST, 2.0, slot="2", nodes=["1"])
    monkeypatch.setattr(ending, "END_POLL_S", 60.0)  # a wait would show as a hung test
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
    monkeypatch.setattr(ending, "END_POLL_S", 0.0)

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
    monkeypatch.setattr(ending, "END_POLL_S", 0.01)
    monkeypatch.setattr(ending, "END_MARGIN_S", 0.05)
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
    monkeypatch.setattr(ending, "END_POLL_S", 60.0)
    with mocked_slurm() as fake:
        fake.answer("squeue", stdout=SIBLINGS)
        fake.answer("scancel")
        assert ends(tmp_path, code=1) == (1, [{"tasks": [1, 3], "running": [1]}])
