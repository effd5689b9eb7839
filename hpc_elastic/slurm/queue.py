"""Readings of squeue's listing of an elastic job: which tasks run, start, pend or are held.

squeue lists an elastic job's array tasks (``commands.JobStatus``, one line per task or range
of tasks). The pure functions here read that listing: the slots that run or start at once
(the rendezvous' ``expected_nodes``), each task's array, the tasks in which no agent runs, the
tasks Slurm holds and why, and which running slot speaks for the job. ``ComingSlots`` is the
cached, rate-limited squeue behind that slot count, and ``poll`` asks it on a timer.

**One squeue a job, not one a slot.** Each agent's rendezvous asks for the count as it
decides, at most once in ``SQUEUE_INTERVAL``: a round change of a job of 4,096 slots sent
slurmctld thousands of squeues within seconds, each listing the whole array. So in a job of
``BOARD_FROM`` slots or more, the lowest running slot (the one that releases held tasks)
publishes each count it gets in the job directory (``QueueBoard``, ``slots/queue.json``) and
asks on a clock of ``SQUEUE_INTERVAL`` to keep it fresh; every other agent reads that board
instead of asking. A board older than ``BOARD_MAX_AGE`` (its writer is gone, or Slurm did not
answer it) is not read: the agents then ask for themselves, as in a small job, and from their
answers the next lowest running slot learns that it speaks for the job.

They are apart from ``slurm/elastic.py`` because more than the agent reads the same listing:
the agent's slot (``ElasticSlot`` and its parts) decides and acts on them (requeues, excludes,
releases and hold records in ``holds.py``, the end of the job in ``ending.py``), and
``ops/status.py`` (``hpc-elastic status`` and the Python API's ``Job.state``) tells a job whose
every task is held. Reading the queue needs none of the agent's actions or ledgers, and those
stay with the slot.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hpc_elastic.errors import SlurmError
from hpc_elastic.slurm.commands import JobStatus

log = logging.getLogger(__name__)

SQUEUE_INTERVAL = 2.0
"""Seconds between two squeue calls of one agent: the rendezvous asks on every change."""
BOARD_FROM = 16
"""Slots from which a job's agents read the count its lowest running slot publishes instead of
each asking squeue (``QueueBoard``); a smaller job's few squeues cost slurmctld nothing."""
BOARD_MAX_AGE = 5 * SQUEUE_INTERVAL
"""A board older than this (or dated later, by another node's clock) is not read."""
_STARTING = frozenset({"RUNNING", "CONFIGURING"})
ENDED = frozenset(
    {
        "COMPLETING",
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "PREEMPTED",
        "NODE_FAIL",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "REVOKED",
        "STAGE_OUT",
    }
)
"""Task states in which Slurm has ended the task or is ending it: nothing left to cancel."""
LIVE = frozenset({"RUNNING", "SIGNALING", "SUSPENDED", "STOPPED", "RESIZING"})
"""Task states in which an agent may run on a node. Every other state (PENDING, REQUEUED,
REQUEUE_HOLD, CONFIGURING, SPECIAL_EXIT, a state this version does not know) means that no
agent of the task runs: the end of the job cancels it at once."""


# --- pure readings -------------------------------------------------------------------------


def task_indices(text: str) -> list[int]:
    """Array task ids from squeue's %K: ``3``, ``0-3``, ``1,3-5`` or ``0-3%2`` (a throttle)."""
    indices: list[int] = []
    for part in text.split("%", maxsplit=1)[0].split(","):
        low, _, high = part.partition("-")
        if not low.strip().isdigit() or (high and not high.strip().isdigit()):
            raise SlurmError(
                f"squeue printed the array tasks '{text}', which are not ids like '0-3,5'; "
                "check that `squeue` is Slurm's and not a wrapper."
            )
        indices.extend(range(int(low), int(high or low) + 1))
    return indices


def coming_slots(statuses: Sequence[JobStatus]) -> int:
    """Slots that run or will start at once; those waiting for resources, priority or a
    requeue delay (``BeginTime``) are not counted, so a round does not wait for them."""
    count = 0
    for status in statuses:
        if status.array_task is None:
            continue
        soon = status.state in _STARTING or (status.state == "PENDING" and status.reason == "None")
        if soon:
            count += len(task_indices(status.array_task))
    return count


def task_arrays(statuses: Sequence[JobStatus]) -> dict[int, str]:
    """Each array task squeue lists -> the array job it belongs to. A job that grows
    elsewhere (``--grow-partition``/``--grow-qos``) is two arrays whose task ids never
    overlap (0..MIN-1 and MIN..), so a task id alone names a slot, and this its Slurm job."""
    return {
        index: str(status.job_id)
        for status in statuses
        if status.array_task is not None
        for index in task_indices(status.array_task)
    }


def pending_tasks(statuses: Sequence[JobStatus]) -> list[int]:
    """Tasks in which no agent runs and that Slurm has not ended: pending, requeued, held,
    configuring, or in a state this version does not know."""
    return sorted(
        index
        for status in statuses
        if status.state not in LIVE | ENDED and status.array_task is not None
        for index in task_indices(status.array_task)
    )


CHURN_HOLD = "JobHoldMaxRequeue"
"""The reason squeue gives for a task Slurm held because it was requeued more often than the
site's ``MaxBatchRequeue``: the job's own churn, which a sibling slot may release."""
_HELD_REASONS = frozenset(
    {
        CHURN_HOLD,
        "JobHeldAdmin",
        "JobHeldUser",
        "launch_failed_requeued_held",
        "job_requeued_in_held_state",
    }
)
"""Reasons squeue gives for a pending task that will never start until someone releases it
(its priority is 0), spaces written as underscores (``held_reason``): the last two are the
texts Slurm shows in place of ``JobHeldUser`` after a failed launch or ``scontrol requeuehold``."""


def held_reason(status: JobStatus) -> str | None:
    """Why Slurm holds this task (its reason, spaces as underscores), or None if it does not.

    The reason decides, never the state. Slurm 22.05's ``scontrol release`` resets a hold's
    priority and reason but leaves the ``REQUEUE_HOLD`` state flag, which only the task's
    start clears: a task just released reads ``REQUEUE_HOLD`` with reason ``None``, then
    ``BeginTime`` while the requeue delay runs (seen on the dev cluster: about 5 s). Read by
    its state, the slot that released it took it for held again, and alerted.
    ``scontrol requeuehold``, the other way round, leaves a held task ``PENDING``.
    """
    reason = status.reason.replace(" ", "_")  # squeue prints a free-text reason as it is
    return reason if reason in _HELD_REASONS else None


def held_reasons(statuses: Sequence[JobStatus]) -> dict[int, str]:
    """Tasks Slurm holds (requeued too often, or held by hand), each with squeue's reason
    (``held_reason``): they wait for an ``scontrol release`` that nobody gives on a weekend."""
    return {
        index: reason
        for status in statuses
        if status.array_task is not None and (reason := held_reason(status)) is not None
        for index in task_indices(status.array_task)
    }


def every_task_held(statuses: Sequence[JobStatus]) -> bool:
    """Whether Slurm lists the job only as held tasks: nothing runs, nothing starts by itself,
    and no agent is left to release them (the one stall the job cannot end by itself)."""
    return bool(statuses) and all(held_reason(status) is not None for status in statuses)


def churn_held_tasks(statuses: Sequence[JobStatus]) -> list[int]:
    """Held tasks the job may release itself: held for too many requeues, and for nothing
    else. An admin's hold (``JobHeldAdmin``) or the user's own (``JobHeldUser``) is a person's
    decision, and a launch failure a broken node: those are only reported."""
    return sorted(task for task, reason in held_reasons(statuses).items() if reason == CHURN_HOLD)


def running_tasks(statuses: Sequence[JobStatus]) -> list[int]:
    return sorted(
        index
        for status in statuses
        if status.state in _STARTING and status.array_task is not None
        for index in task_indices(status.array_task)
    )


def reports_held(statuses: Sequence[JobStatus], me: int) -> bool:
    """Whether slot ``me`` is the one to release or report held tasks: the lowest running
    task, so a job of 64 slots raises one alert per held task, not 64."""
    running = running_tasks(statuses)
    return bool(running) and min(running) == me


# --- the cached squeue -----------------------------------------------------------------------


SlurmCall = Callable[[], None]
Spawn = Callable[[SlurmCall], None]
"""Runs one Slurm query away from the caller: a daemon thread in production."""


def in_background(work: SlurmCall) -> None:
    threading.Thread(target=work, name="hpc-elastic-slurm", daemon=True).start()


def publish(path: Path, record: Mapping[str, object]) -> None:
    """Write ``record`` for the job's other agents: to a temporary file of this node, process
    and thread (two slots may both think they speak for the job a moment), then renamed, so a
    reader never sees half of it. What it tells is asked again soon: no fsync."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = f"{socket.gethostname()}.{os.getpid()}.{threading.get_native_id()}"
    scratch = path.with_name(f".{path.name}.{writer}.tmp")
    scratch.write_text(json.dumps(record, sort_keys=True))
    scratch.replace(path)


class QueueBoard:
    """The slot count as the job's lowest running slot last heard it from squeue, in the job
    directory, where any process of the job's user may write: nothing in it is trusted but a
    count and a time of the right types, and a time neither old nor ahead."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def post(self, coming: int, now: float) -> None:
        publish(self.path, {"at": now, "coming": coming})

    def count(self, now: float) -> int | None:
        """The posted count, if the board is fresh; None if not (or there is none)."""
        try:
            raw = json.loads(self.path.read_bytes())
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(raw, dict):
            return None
        at, coming = raw.get("at"), raw.get("coming")
        if not isinstance(at, int | float) or not isinstance(coming, int):
            return None
        if isinstance(at, bool) or isinstance(coming, bool) or coming < 0:
            return None
        return coming if abs(now - at) <= BOARD_MAX_AGE else None


class ComingSlots:
    """The rendezvous' ``expected_nodes``: slots of this array that run or start at once.

    The rendezvous asks on every change, from kazoo's watch and connection threads, and
    those must never block: a stuck watch thread delays every later watch and the session's
    pings, and squeue may take its whole timeout when slurmctld is busy. So a call never runs
    squeue itself. It returns the last answer (None before the first one) and, when that
    answer is older than ``interval``, starts one squeue through ``spawn`` (never two at once).
    When squeue fails or times out the answer is None: the rendezvous then waits the last call.
    With a ``board``, a slot of a job of ``BOARD_FROM`` slots or more reads the count there
    (in that thread too: a shared filesystem may stall) unless it is the one to post it
    (``elected``), which it does after each answer.
    """

    def __init__(
        self,
        array_job_id: str,
        squeue: Callable[[Sequence[str]], list[JobStatus]],
        interval: float = SQUEUE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        spawn: Spawn = in_background,
        *,
        on_statuses: Callable[[Sequence[JobStatus]], None] | None = None,
        also: Callable[[], Sequence[str]] = tuple,
        board: QueueBoard | None = None,
        elected: Callable[[], bool] = lambda: False,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._array_job_id = array_job_id
        self._also = also
        """The job's other arrays (the growth slots'), asked in the same squeue."""
        self._on_statuses = on_statuses
        """Also shown each squeue answer (the held-task report), from the squeue thread."""
        self._squeue = squeue
        self._interval = interval
        self._clock = clock
        self._spawn = spawn
        self._lock = threading.Lock()
        """Held only to read or swap the fields below, never while squeue runs."""
        self._asked_at: float | None = None
        self._asking = False
        self._answer: int | None = None
        self._board = board
        self._elected = elected
        """Whether this slot is the job's lowest running one, as its last answer said (called
        after ``on_statuses`` has seen that answer)."""
        self._wall = wall
        self._tasks = 0
        """The job's tasks, as this slot's last squeue listed them: whether it is large."""

    @property
    def posting(self) -> bool:
        """Whether this slot posts the job's count (so asks Slurm on ``poll``'s short clock)."""
        return self._on_board() and self._elected()

    def _on_board(self) -> bool:
        return self._board is not None and self._tasks >= BOARD_FROM

    def __call__(self) -> int | None:
        with self._lock:
            due = not self._asking and (
                self._asked_at is None or self._clock() - self._asked_at >= self._interval
            )
            if due:
                self._asking, self._asked_at = True, self._clock()
        if due:
            self._spawn(self._refresh)
        return self._answer  # Read after spawn: an inline spawn (tests) answers at once.

    def _refresh(self) -> None:
        posted = self._read_board()
        if posted is not None:
            answer: int | None = posted or None
        else:
            answer = self._ask()
        with self._lock:
            if answer != self._answer:
                log.debug("slots running or starting now: %s -> %s", self._answer, answer)
            self._answer, self._asking = answer, False

    def _read_board(self) -> int | None:
        """The count the job's lowest running slot posted, unless this slot posts it."""
        if self._board is None or not self._on_board() or self._elected():
            return None
        return self._board.count(self._wall())

    def _ask(self) -> int | None:
        """squeue; the count of its answer, posted when this slot speaks for a large job."""
        try:
            statuses = self._squeue([self._array_job_id, *self._also()])
            coming = coming_slots(statuses)
            if self._on_statuses is not None:
                self._on_statuses(statuses)
        except SlurmError as error:
            log.debug("squeue failed, no slot count until the next try: %s", error)
            return None
        self._tasks = sum(len(task_indices(s.array_task)) for s in statuses if s.array_task)
        if self._board is not None and self.posting:
            try:
                self._board.post(coming, self._wall())
            except OSError as error:
                log.debug("could not post the slot count at %s: %s", self._board.path, error)
        return coming or None


def poll(coming: ComingSlots, interval: float, elected: Callable[[], bool]) -> None:
    """Ask ``coming`` every ``interval`` s from a daemon thread while ``elected()`` (this is
    the job's lowest running slot, which alone acts on held tasks), so its squeue (and the
    held report) also runs while the rendezvous is quiet; the count it refreshes is harmless.
    Every slot asking was a squeue of the whole array per slot per interval, forever: 137 a
    second at 4,096 slots, each answering 4,096 tasks. The others ask when their rendezvous
    does, and a slot that becomes the lowest learns it from the answer it gets then. A slot
    that posts a large job's count asks every ``SQUEUE_INTERVAL``, to keep the board fresh:
    whether it posts is looked at every ``SQUEUE_INTERVAL``, since its first answer comes
    after the loop starts (a sleep of ``interval`` chosen before it left the board stale for
    20 s, and every agent of the job asked squeue at a round change meanwhile)."""

    def loop() -> None:
        asked = time.monotonic()
        while True:
            time.sleep(min(SQUEUE_INTERVAL, interval))
            if not elected():
                continue
            now = time.monotonic()
            if coming.posting or now - asked >= interval:
                asked = now
                coming()

    threading.Thread(target=loop, name="hpc-elastic-held", daemon=True).start()
