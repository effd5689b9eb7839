"""squeue's listing of an elastic job read (slurm/queue.py), on text captured from Slurm 22.05:
which tasks run, start, pend or are held, and the cached, rate-limited slot count."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest
from cluster import wait_until
from test_elastic import AFTER_PREEMPTION, statuses
from test_holds import ADMIN_HELD, CHURN_HELD, RELEASED_STILL_SHOWN

from hpc_elastic.errors import SlurmError
from hpc_elastic.slurm import commands, queue
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.slurm.queue import ComingSlots

# A 1:4 array while another job holds 3 nodes: one task runs, three wait for resources.
HELD_BACK = """\
9|1-3|PENDING|Resources|
9|0|RUNNING|None|n1
"""


@pytest.mark.parametrize(
    ("text", "indices"),
    [("3", [3]), ("0-3", [0, 1, 2, 3]), ("1,3-4", [1, 3, 4]), ("0-3%2", [0, 1, 2, 3])],
)
def test_task_indices(text: str, indices: list[int]) -> None:
    assert queue.task_indices(text) == indices


def test_task_indices_refuses_garbage() -> None:
    with pytest.raises(SlurmError, match="'x-1'"):
        queue.task_indices("x-1")


def test_slots_waiting_for_resources_are_not_coming() -> None:
    assert queue.coming_slots(statuses(HELD_BACK)) == 1


def test_just_granted_slots_come_requeued_ones_do_not() -> None:
    assert queue.coming_slots(statuses(AFTER_PREEMPTION)) == 2
    assert queue.pending_tasks(statuses(AFTER_PREEMPTION)) == [1, 2, 3]


def test_a_task_held_after_too_many_requeues_is_cancelled_at_the_end() -> None:
    held = "9|1|REQUEUE_HOLD|JobHoldMaxRequeue|\n9|0|RUNNING|None|n1\n"
    assert queue.pending_tasks(statuses(held)) == [1]


def test_coming_slots_count_running_spares_but_a_round_never_exceeds_max() -> None:
    """Spares run like any slot: squeue counts them, and ``expected`` above MAX only means
    that a round need not wait (``next_action`` caps it at MAX)."""
    statuses = commands.parse_squeue("9|0-2|RUNNING|None|n[1-3]\n")
    assert queue.coming_slots(statuses) == 3


def inline(work: Callable[[], None]) -> None:
    """Runs the background squeue at once, so that rate-limit tests need no threads."""
    work()


def test_coming_slots_asks_squeue_at_most_once_per_interval() -> None:
    calls: list[list[str]] = []
    now = [0.0]

    def squeue(ids: Sequence[str]) -> list[JobStatus]:
        calls.append(list(ids))
        return statuses(HELD_BACK)

    coming = ComingSlots("9", squeue, interval=2.0, clock=lambda: now[0], spawn=inline)
    assert [coming(), coming()] == [1, 1]
    now[0] = 2.5
    assert coming() == 1
    assert calls == [["9"], ["9"]]


def test_coming_slots_falls_back_to_the_last_call_when_squeue_fails() -> None:
    def broken(ids: Sequence[str]) -> list[JobStatus]:
        raise SlurmError("squeue failed.")

    assert ComingSlots("9", broken, spawn=inline)() is None


def test_a_slow_squeue_never_blocks_the_rendezvous_thread_that_asks() -> None:
    """kazoo's watch threads ask; they get the last answer while one squeue runs elsewhere."""
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow(ids: Sequence[str]) -> list[JobStatus]:
        calls.append("squeue")
        entered.set()
        release.wait(60)
        return statuses(HELD_BACK)

    coming = ComingSlots("9", slow, interval=0.0)
    assert coming() is None, "the first call must not wait for squeue's answer"
    assert entered.wait(30)
    assert coming() is None
    assert calls == ["squeue"], "a second squeue started while the first still ran"
    release.set()
    assert wait_until(lambda: coming() == 1, 30)


def test_only_the_jobs_lowest_running_slot_asks_squeue_on_the_clock() -> None:
    """The clock's squeue is for held tasks, which only that slot acts on; every slot asking
    was 137 squeues a second at 4,096 slots, each of the whole array, while nothing changed."""
    calls: list[str] = []
    looks: list[bool] = []
    lowest = threading.Event()

    def squeue(ids: Sequence[str]) -> list[JobStatus]:
        calls.append("squeue")
        return statuses(HELD_BACK)

    def elected() -> bool:
        looks.append(lowest.is_set())
        return lowest.is_set()

    coming = ComingSlots("9", squeue, interval=0.0, spawn=inline)
    queue.poll(coming, 0.05, elected)
    assert wait_until(lambda: len(looks) >= 5, 30)
    assert calls == []
    lowest.set()
    assert wait_until(lambda: len(calls) >= 2, 30)
    lowest.clear()


# --- held tasks ----------------------------------------------------------------------------


def test_only_a_hold_for_too_many_requeues_is_the_jobs_to_release() -> None:
    assert queue.churn_held_tasks(statuses(CHURN_HELD)) == [1]
    assert queue.churn_held_tasks(statuses(ADMIN_HELD)) == []
    assert sorted(queue.held_reasons(statuses(ADMIN_HELD))) == [1, 3]


@pytest.mark.parametrize("shown", RELEASED_STILL_SHOWN[:2])
def test_a_released_task_waiting_to_start_is_not_held(shown: str) -> None:
    assert queue.held_reasons(statuses(shown)) == {}
    assert not queue.every_task_held(statuses(shown.splitlines()[0]))
