"""Sibling tasks Slurm holds: release a hold that churn caused, report every other one once.

Slurm holds a batch job requeued more than ``MaxBatchRequeue`` times (reason
``JobHoldMaxRequeue``), and an admin or a user may hold a task by hand. A held task never
starts again by itself, so one slot of the job acts on what squeue shows: the lowest running
one (``queue.reports_held``). It releases a churn hold under the no-progress breaker
(``may_release``: a later hold only after a newer committed checkpoint), and raises one
``held`` alert per hold, across every agent process, for the holds it does not release. A
slot whose own requeue got it held, with no sibling running to see it, announces its hold
itself before it leaves (``HeldTasks.announce_own``). The counts live in the job directory
(``JobDir.hold_record``), shared by every agent and surviving requeues.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hpc_elastic import events
from hpc_elastic.decoding import Check, JsonRecord, optional, whole
from hpc_elastic.errors import SlurmError
from hpc_elastic.events import CHECKPOINTS, CheckpointDetails, Event, Kind
from hpc_elastic.jobdir import JobDir
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.arrays import JobArrays
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.slurm.ledger import claim, save_json
from hpc_elastic.slurm.queue import (
    CHURN_HOLD,
    churn_held_tasks,
    held_reasons,
    reports_held,
    running_tasks,
)
from hpc_elastic.slurm.task import ArrayTask, read_job

log = logging.getLogger(__name__)

HELD_POLL_S = 30.0
"""Seconds between two looks for held siblings when nothing else makes the agent ask squeue:
a hold happens after the slot has left, when the rendezvous may see no change for hours."""


def will_be_held(restart_count: int, limit: int) -> bool:
    """Whether the requeue this slot is about to ask for gets it held: Slurm holds a batch job
    requeued more than ``MaxBatchRequeue`` times, and this requeue is number restart_count + 1."""
    return restart_count + 1 > limit


@dataclass(frozen=True)
class HoldRecord:
    """How often one slot was released from a ``JobHoldMaxRequeue`` hold, across agents."""

    releases: int = 0
    released_at: int | None = None
    """The job's progress (newest committed checkpoint step) at the last release."""
    ended: int = 0
    """Holds that ended otherwise (someone ran ``scontrol release``): seen gone, not released."""

    @property
    def hold(self) -> int:
        """The number of the slot's current (or next) hold: each ended hold starts a new one,
        so a task released and held again is reported again."""
        return self.releases + self.ended


def may_release(record: HoldRecord, progress: int | None) -> bool:
    """The no-progress breaker for releases: the first hold of a slot is released; a later
    one only if the job committed a newer checkpoint since the last release. A slot that
    crashes in a loop is then held for good (and reported) instead of revived forever."""
    if record.releases == 0:
        return True
    if progress is None:
        return False
    return record.released_at is None or progress > record.released_at


def newest_checkpoint_step(timeline: Iterable[Event]) -> int | None:
    """The job's progress: the step of its newest committed checkpoint (None: none yet)."""
    steps = [
        CheckpointDetails.from_details(event.details).step
        for event in timeline
        if event.kind == Kind.CHECKPOINT
    ]
    known = [step for step in steps if step is not None]
    return max(known) if known else None


HOLD_RECORD_FIELDS: dict[str, Check] = {
    "releases": whole(0),
    "released_at": optional(whole(0)),
    "ended": whole(0),
}
"""``HoldRecord``'s fields (``decoding``): counts, and the checkpoint step of the last release;
a field missing (an older record) takes its default."""
_HOLD_RECORD = JsonRecord(
    HoldRecord,
    HOLD_RECORD_FIELDS,
    SlurmError,
    "{subject} is not a hold record hpc-elastic writes ({why}); delete it if this keeps happening.",
    defaults=True,
)


def decode_hold_record(data: bytes, where: str) -> HoldRecord:
    """The hold record in ``data`` (read from ``where``), each field of its type, or one
    ``SlurmError`` sentence naming the field and its value."""
    return _HOLD_RECORD.decode(data, where)


def load_hold_record(path: Path) -> HoldRecord:
    """A slot's release record; missing or unreadable reads as never released (at worst one
    more release, which the next hold's breaker then bounds)."""
    try:
        return decode_hold_record(path.read_bytes(), str(path))
    except FileNotFoundError:
        return HoldRecord()
    except (OSError, SlurmError) as error:
        log.warning("%s It starts afresh.", error)
        return HoldRecord()


class HeldTasks:
    """What one slot's agent does about the job's held tasks.

    One job: held siblings. ``watch`` is what the cached squeue hands each answer to: as the
    lowest running slot it releases a churn hold (``release``) or reports the hold once
    (``report``), and whoever sees a hold it did not end disappear counts it as ended by
    someone else. ``announce_own`` speaks for this slot's own hold right after its requeue,
    asking Slurm for the site's ``MaxBatchRequeue`` at most once (``requeue_limit``).
    """

    def __init__(self, task: ArrayTask, arrays: JobArrays) -> None:
        self._task = task
        self._arrays = arrays
        self._requeue_limit: int | None = None

    def watch(self, emit: Callable[..., None]) -> Callable[[Sequence[JobStatus]], None]:
        """What the lowest running slot (``reports_held``) does with each task Slurm holds:
        release a hold that churn caused, under the no-progress breaker (``release``),
        else raise one ``held`` alert per hold (``report``)."""
        me = self._task.context.array_task_id
        assert me is not None

        still_held: set[int] = set()
        """Tasks this process saw held and did not release: gone from the list, their hold ended."""

        def observe(statuses: Sequence[JobStatus]) -> None:
            self._arrays.seen(statuses)
            held = held_reasons(statuses)
            for task in sorted(still_held - set(held)):
                self._ended(task)
            still_held.intersection_update(held)
            if not reports_held(statuses, me):
                return
            churn = set(churn_held_tasks(statuses))
            for task, reason in sorted(held.items()):
                if task in churn and self.release(task, emit):
                    still_held.discard(task)  # Our release ended it: counted as a release.
                    continue
                if task not in still_held:
                    log.debug(
                        "slot %s sees task %s held by Slurm (%s)", self._task.job_id, task, reason
                    )
                    self.report(task, reason, emit)
                    still_held.add(task)

        return observe

    def _ended(self, task: int) -> None:
        path = JobDir(self._task.job_dir).hold_record(task)
        record = load_hold_record(path)
        save_json(path, asdict(replace(record, ended=record.ended + 1)))
        log.debug("the hold of task %s ended (released by someone else)", task)

    def release(self, task: int, emit: Callable[..., None]) -> bool:
        """Release task ``task`` from a churn hold unless the breaker says no; True once done.

        The progress figure is the newest committed checkpoint step in the job's events
        file: it lives in the job directory that every agent shares, survives requeues, needs
        no torch (the agent never imports it) and is what the restart breaker already trusts.
        """
        paths = JobDir(self._task.job_dir)
        record = load_hold_record(paths.hold_record(task))
        progress = newest_checkpoint_step(events.read(paths.events, CHECKPOINTS))
        if not may_release(record, progress):
            log.debug("task %s stays held: no progress (%s) since %s", task, progress, record)
            return False
        try:
            commands.release(self._arrays.job_id_of(task), self._task.env)
        except SlurmError as error:
            log.warning("could not release task %s: %s", task, error)
            return False
        record = replace(record, releases=record.releases + 1, released_at=progress)
        save_json(paths.hold_record(task), asdict(record))
        log.debug("slot %s released task %s (%s)", self._task.job_id, task, record)
        emit(
            Kind.RELEASED,
            task=task,
            slurm_job=self._arrays.job_id_of(task),
            releases=record.releases,
            progress=progress,
        )
        return True

    def report(self, task: int, reason: str, emit: Callable[..., None], **details: object) -> bool:
        """One ``held`` event per hold, across every agent process: the first to claim the
        hold's marker in the job directory writes it. A hold is numbered by the task's
        ended holds so far (``HoldRecord.hold``): released and held again, it is reported again."""
        paths = JobDir(self._task.job_dir)
        hold = load_hold_record(paths.hold_record(task)).hold
        if not claim(paths.hold_alert(task, hold)):
            log.debug("hold %d of task %s was already reported", hold, task)
            return False
        emit(Kind.HELD, task=task, slurm_job=self._arrays.job_id_of(task), reason=reason, **details)
        return True

    def requeue_limit(self) -> int:
        """The site's ``MaxBatchRequeue``, asked once per agent (Slurm's default if it cannot
        say: the alert may then come early, never late)."""
        if self._requeue_limit is None:
            try:
                self._requeue_limit = commands.max_batch_requeue(
                    commands.show_config(self._task.env)
                )
            except SlurmError as error:
                log.debug("no MaxBatchRequeue from Slurm, assuming the default: %s", error)
                self._requeue_limit = commands.DEFAULT_MAX_BATCH_REQUEUE
        return self._requeue_limit

    def announce_own(self, emit: Callable[..., None]) -> bool:
        """Right after this slot's own requeue: when Slurm answered it with a hold for too
        many requeues and no other slot runs to release or report it, raise the ``held``
        alert now, since after this slot leaves nobody may. True when announced.

        Slurm is asked only once the restart count (``SLURM_RESTART_COUNT``) has reached the
        site's ``MaxBatchRequeue``; the count alone would cry wolf, since Slurm 22.05 counts
        only node-failure requeues towards the hold, never an ``scontrol requeue``. So what
        Slurm says of the task right after the requeue decides (the agent is still alive
        then: it sets the task's ``ExcNodeList`` at that moment too).
        """
        restarts = self._task.context.restart_count
        if restarts == 0:
            # A first requeue is held only where MaxBatchRequeue is 0, a site on which no
            # elastic job can live; not asking spares slurmctld a call on every first requeue.
            return False
        limit = self.requeue_limit()
        if not will_be_held(restarts, limit):
            return False
        record = read_job(self._task.job_id, self._task.env)
        if isinstance(record, SlurmError) or record.get("Reason") != CHURN_HOLD:
            log.debug("slot %s reached %d restarts but is not held", self._task.job_id, limit)
            return False
        me = self._task.context.array_task_id
        assert me is not None
        try:
            statuses = self._arrays.squeue()
        except SlurmError:
            statuses = []  # Nobody known to be running: announce rather than stay silent.
        if [task for task in running_tasks(statuses) if task != me]:
            log.debug("slot %s is held; a running sibling will see it", self._task.job_id)
            return False
        return self.report(me, CHURN_HOLD, emit, restarts=restarts + 1, limit=limit, last=True)
