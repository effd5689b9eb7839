"""squeue's listing of an elastic job read (slurm/queue.py), on text captured from Slurm 22.05:
which tasks run, start, pend or are held, and the cached, rate-limited slot count."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

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


def test_the_slot_that_posts_a_large_jobs_count_keeps_it_fresh_from_its_first_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first squeue answer comes in the background, after the clock has started: the
    clock chose its long sleep before the answer said this slot posts the count, so the board
    went stale after its first post, and at a round change meanwhile every agent of the job
    asked squeue (seen on the real Slurm: tests/integration/test_queue_cluster.py)."""
    monkeypatch.setattr(queue, "SQUEUE_INTERVAL", 0.05)
    answered = threading.Event()
    slurm = Slurm(running(20, pending=4))

    def slow_first(ids: Sequence[str]) -> list[JobStatus]:
        answered.wait(30)
        return slurm(ids)

    def in_thread(work: Callable[[], None]) -> None:
        threading.Thread(target=work, daemon=True).start()

    coming = ComingSlots(
        "9",
        slow_first,
        interval=0.0,
        spawn=in_thread,
        board=queue.QueueBoard(tmp_path / "queue.json"),
        elected=lambda: True,
    )
    assert coming() is None
    queue.poll(coming, 3600.0, lambda: True)  # the held-task clock's long interval
    answered.set()
    assert wait_until(lambda: slurm.asked >= 3, 30), "it asks every SQUEUE_INTERVAL"


def running(tasks: int, pending: int = 0) -> list[JobStatus]:
    """A job of ``tasks + pending`` slots: ``tasks`` running, the rest waiting for resources."""
    text = "".join(f"9|{task}|RUNNING|None|n{task}\n" for task in range(tasks))
    if pending:
        text += f"9|{tasks}-{tasks + pending - 1}|PENDING|Resources|\n"
    return statuses(text)


class Slurm:
    """squeue answers for one job, counted; the test changes ``answer`` as slots come and go."""

    def __init__(self, answer: list[JobStatus]) -> None:
        self.answer = answer
        self.asked = 0

    def __call__(self, ids: Sequence[str]) -> list[JobStatus]:
        self.asked += 1
        return self.answer


def slot(slurm: Slurm, board: Path, *, lowest: bool, wall: Callable[[], float]) -> ComingSlots:
    """A slot's cached squeue with the job's board, asking at every call (no rate limit)."""
    return ComingSlots(
        "9",
        slurm,
        interval=0.0,
        spawn=inline,
        board=queue.QueueBoard(board),
        elected=lambda: lowest,
        wall=wall,
    )


def test_in_a_large_job_only_the_lowest_running_slot_asks_squeue_and_the_others_read_its_count(
    tmp_path: Path,
) -> None:
    """Each agent asking as its rendezvous decides sent slurmctld thousands of squeues within
    seconds at a round change of 4,096 slots."""
    board, now = tmp_path / "queue.json", [1000.0]
    slurm = Slurm(running(20, pending=4))
    lowest = slot(slurm, board, lowest=True, wall=lambda: now[0])
    other = slot(slurm, board, lowest=False, wall=lambda: now[0])
    assert other() == 20  # its first answer, its own: it does not know the job's size yet
    assert lowest() == 20
    assert lowest.posting
    asked = slurm.asked
    slurm.answer = running(18, pending=6)
    assert lowest() == 18
    now[0] += queue.BOARD_MAX_AGE
    assert [other(), other()] == [18, 18]
    assert slurm.asked == asked + 1  # the lowest slot's, not the other's


def test_a_stale_board_is_not_read_and_each_slot_asks_for_itself(tmp_path: Path) -> None:
    board, now = tmp_path / "queue.json", [1000.0]
    slurm = Slurm(running(20))
    lowest = slot(slurm, board, lowest=True, wall=lambda: now[0])
    other = slot(slurm, board, lowest=False, wall=lambda: now[0])
    assert (lowest(), other()) == (20, 20)
    slurm.answer = running(19)
    now[0] += queue.BOARD_MAX_AGE + 1  # the lowest slot is gone, or Slurm did not answer it
    asked = slurm.asked
    assert other() == 19
    assert slurm.asked == asked + 1


def test_a_small_job_never_reads_a_board(tmp_path: Path) -> None:
    board = tmp_path / "queue.json"
    queue.QueueBoard(board).post(99, 1000.0)
    slurm = Slurm(running(queue.BOARD_FROM - 1))
    other = slot(slurm, board, lowest=False, wall=lambda: 1000.0)
    assert [other(), other()] == [queue.BOARD_FROM - 1] * 2
    assert slurm.asked == 2


@pytest.mark.parametrize(
    "planted",
    [
        "not json",
        "[1000, 5]",
        '{"at": true, "coming": 5}',
        '{"at": 1000, "coming": "5"}',
        '{"at": 1000, "coming": -1}',
        '{"at": 1000, "coming": false}',
        '{"at": 99999, "coming": 5}',
        '{"at": 1, "coming": 5}',
    ],
)
def test_a_board_is_read_only_for_a_count_and_a_time_neither_old_nor_ahead(
    tmp_path: Path, planted: str
) -> None:
    """The job directory is writable by any process of the job's user."""
    path = tmp_path / "queue.json"
    path.write_text(planted)
    assert queue.QueueBoard(path).count(1000.0) is None


# --- held tasks ----------------------------------------------------------------------------


def test_only_a_hold_for_too_many_requeues_is_the_jobs_to_release() -> None:
    assert queue.churn_held_tasks(statuses(CHURN_HELD)) == [1]
    assert queue.churn_held_tasks(statuses(ADMIN_HELD)) == []
    assert sorted(queue.held_reasons(statuses(ADMIN_HELD))) == [1, 3]


@pytest.mark.parametrize("shown", RELEASED_STILL_SHOWN[:2])
def test_a_released_task_waiting_to_start_is_not_held(shown: str) -> None:
    assert queue.held_reasons(statuses(shown)) == {}
    assert not queue.every_task_held(statuses(shown.splitlines()[0]))
