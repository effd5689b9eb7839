"""The end of an elastic job: once it is over, no other task of its arrays may start or go on.

Every agent that exits 0, or 1 because the job failed (``job_over``), ends its siblings
(``JobEnd.end_siblings``): one rule per task from squeue's answer, the task's ledger and the
job's timeline (``sibling_at_end``; docs/design.md, "End of the job"). A task in which no
agent runs is cancelled at once, and so is one whose agent the rendezvous dropped; a task
whose agent may still be on its clean way out is waited for, and cancelled only after its
``--grace`` and ``END_MARGIN_S``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from hpc_elastic import events
from hpc_elastic.errors import SlurmError
from hpc_elastic.events import Event, Kind
from hpc_elastic.jobdir import JobDir
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.arrays import JobArrays
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.slurm.ledger import SlotLedger, load_ledger
from hpc_elastic.slurm.queue import ENDED, LIVE, task_indices
from hpc_elastic.slurm.task import ArrayTask

log = logging.getLogger(__name__)

END_MARGIN_S = 60.0
"""Seconds a sibling's agent is given, beyond its workers' ``--grace``, to finish its own
clean exit once the job is over, before the end of the job cancels its task: on a busy
machine an agent's way out (the exit barrier's last read, its workers' drain, its events and
ledger) can take tens of seconds, and a task cancelled meanwhile ends CANCELLED instead of
COMPLETED, or loses the save its workers were making."""
END_POLL_S = 2.0
"""Seconds between two looks (squeue and the siblings' ledgers) while the end of the job
waits for siblings that may still be on their way out."""


class Sibling(enum.Enum):
    """What the end of the job does with one sibling task (``sibling_at_end``)."""

    GONE = "gone"
    """Slurm ended the task or is ending it: nothing to do."""
    WAITING = "waiting"
    """No agent runs in it (pending, requeued, held, configuring, ...): cancelled at once."""
    LOST = "lost"
    """Slurm shows it running, but the rendezvous dropped its agent (its session expired) and
    it wrote nothing since: the task of a crashed node that Slurm has not noticed yet (on
    22.05 that can take until the node's next registration, minutes). Cancelled at once."""
    LEFT = "left"
    """Its agent left cleanly (its ledger says so) or a new agent is starting in it, which
    finds the job over and exits by itself: never cancelled."""
    FINISHING = "finishing"
    """Its agent may still be on its clean way out (saving, its last barrier read, closing the
    job): given its ``--grace`` plus END_MARGIN_S to leave, then cancelled."""


def sibling_at_end(status: JobStatus, ledger: SlotLedger | None, lost: bool) -> Sibling:
    """The end of the job's rule for one sibling task.

    ``ledger``: the slot's ledger (None: unreadable); ``lost``: the job's timeline says the
    rendezvous dropped the slot's agent and heard nothing from it since (``lost_slots``).
    A clean exit clears the ledger's ``running_on`` before it cancels anything, so a sibling
    that did is never cancelled; a ledger that names another node than Slurm's is the last
    incarnation's, and the task Slurm shows is a new one that has not arrived yet.
    """
    if status.state in ENDED:
        return Sibling.GONE
    if status.state not in LIVE:
        return Sibling.WAITING
    if ledger is not None and (
        ledger.running_on is None or (status.nodes and ledger.running_on != status.nodes)
    ):
        return Sibling.LEFT
    return Sibling.LOST if lost else Sibling.FINISHING


def lost_slots(timeline: Iterable[Event]) -> set[str]:
    """Slots whose agent the rendezvous dropped (named by a ``node_lost`` event) and that
    wrote no event since: their agent's session expired, so it is gone, or cut off and fenced,
    with nothing left to save. A slot that came back (a new incarnation, or the same agent
    healed and rejoined) writes events again (its ``round``, ``join``) and is not lost."""
    dropped: dict[str, float] = {}
    heard: dict[str, float] = {}
    for event in timeline:
        if event.slot:
            heard[event.slot] = max(heard.get(event.slot, event.time), event.time)
        nodes = event.details.get("nodes") if event.kind == Kind.NODE_LOST else None
        for slot in nodes if isinstance(nodes, list) else ():
            dropped[str(slot)] = max(dropped.get(str(slot), event.time), event.time)
    return {slot for slot, at in dropped.items() if slot not in heard or heard[slot] < at}


def job_over(exit_code: int, timeline: Iterable[Event]) -> bool:
    """Whether the job is over for good, so that no sibling may start or go on.

    An agent exits 0 only when every member of the final round succeeded or the job was
    closed; it exits 1 when the job failed (then a ``failed`` event is in the timeline,
    written before the exit), but also when it gave up on its own (an ``error`` event: a bug,
    a rendezvous it may not read), and then the job goes on without it: nothing is cancelled.
    """
    if exit_code == 0:
        return True
    return exit_code == 1 and any(event.kind == Kind.FAILED for event in timeline)


@dataclass(frozen=True)
class EndPlan:
    """The end of the job's decision over every sibling, from one squeue answer."""

    cancel: tuple[int, ...]
    """Tasks to cancel now (``WAITING`` and ``LOST``)."""
    lost: tuple[int, ...]
    """Those of ``cancel`` that Slurm showed running (``LOST``)."""
    finishing: tuple[int, ...]
    """Tasks whose agent may still be on its way out (``FINISHING``)."""


def end_plan(
    statuses: Sequence[JobStatus],
    me: int,
    ledger_of: Callable[[int], SlotLedger | None],
    lost: set[str],
) -> EndPlan:
    """Sort every sibling task of the array but ``me`` by ``sibling_at_end``."""
    verdicts = {
        task: sibling_at_end(status, ledger_of(task), str(task) in lost)
        for status in statuses
        if status.array_task is not None
        for task in task_indices(status.array_task)
        if task != me
    }

    def tasks(*kinds: Sibling) -> tuple[int, ...]:
        return tuple(sorted(task for task, verdict in verdicts.items() if verdict in kinds))

    return EndPlan(
        tasks(Sibling.WAITING, Sibling.LOST), tasks(Sibling.LOST), tasks(Sibling.FINISHING)
    )


def cancel_tasks(array_job_id: str, tasks: Sequence[int], env: Mapping[str, str] | None) -> None:
    """One ``scancel`` for ``tasks`` of the array (none: no call)."""
    if tasks:
        commands.cancel(f"{array_job_id}_[{','.join(map(str, tasks))}]", env=env)


class JobEnd:
    """One slot's part in the end of the job: cancelling the siblings that may not go on.

    One job: ``end_siblings``, a loop over squeue's answers and the siblings' ledgers
    (``end_plan``) until no sibling is left on its way out or its time is up, each cancel one
    ``scancel`` per array of the job, said in one ``cancel_pending`` event.
    """

    def __init__(self, task: ArrayTask, arrays: JobArrays) -> None:
        self._task = task
        self._arrays = arrays

    def end_siblings(self, exit_code: int, grace: float, emit: Callable[..., None]) -> list[int]:
        """The job is over (done or failed): no other task of the array may start or go on.
        Returns the tasks cancelled.

        Tasks in which no agent runs are cancelled at once, and so is a task that Slurm shows
        running although the rendezvous dropped its agent: a crashed node's, which Slurm may
        not notice for minutes (until the node registers again). A task whose agent may
        still be on its way out is never cut short: by the time this agent gets here the
        job is failed, closed, or every member of its last round has succeeded (and the
        last of them closes it), so every live agent is leaving by itself. It is given
        ``grace`` (its workers' save) plus END_MARGIN_S, and cancelled only if Slurm still
        shows it running and its ledger still does not say it left. Nothing is cancelled
        when this agent exits 1 for a reason of its own: the job goes on without it.
        """
        timeline = list(events.read(JobDir(self._task.job_dir).events))
        if not job_over(exit_code, timeline):
            log.debug(
                "slot %s exits %d, the job goes on: nothing cancelled", self._task.job_id, exit_code
            )
            return []
        lost = lost_slots(timeline)
        deadline = time.monotonic() + grace + END_MARGIN_S
        tried: set[int] = set()
        cancelled: list[int] = []
        answered = False
        while True:
            plan = self._plan(lost)
            overdue = time.monotonic() >= deadline
            if plan is not None:
                answered = True
                due = set(plan.cancel) - tried
                if overdue:
                    due |= set(plan.finishing)
                if due:
                    tried |= due
                    running = due & {*plan.lost, *plan.finishing}
                    cancelled += self._cancel(sorted(due), sorted(running), emit)
                if overdue or not plan.finishing:
                    return cancelled
            elif overdue or not answered:
                return cancelled  # Slurm did not answer: nothing is known to be left to cancel
            log.debug("slot %s waits for its siblings to leave", self._task.job_id)
            time.sleep(END_POLL_S)

    def _plan(self, lost: set[str]) -> EndPlan | None:
        """``end_plan`` over squeue's answer now and the siblings' ledgers; None if squeue
        failed."""
        me = self._task.context.array_task_id
        assert me is not None
        try:
            statuses = self._arrays.squeue(bounded=False)
        except SlurmError as error:
            log.debug("no squeue answer at the end of the job: %s", error)
            return None
        return end_plan(statuses, me, self._sibling_ledger, lost)

    def _sibling_ledger(self, task: int) -> SlotLedger | None:
        try:
            return load_ledger(JobDir(self._task.job_dir).slot_ledger(str(task)))
        except SlurmError:
            return None

    def _cancel(self, tasks: list[int], running: list[int], emit: Callable[..., None]) -> list[int]:
        """Cancel ``tasks`` (``running``: those Slurm showed running), one scancel per array
        of the job; the event says which."""
        by_array: dict[str, list[int]] = {}
        for task in tasks:
            by_array.setdefault(self._arrays.array_of(task), []).append(task)
        cancelled: list[int] = []
        for array, group in sorted(by_array.items()):
            try:
                cancel_tasks(array, group, self._task.env)
            except SlurmError as error:
                # Another slot's agent got there first (scancel fails for a task already ended).
                log.debug("scancel of tasks %s of %s: %s", group, array, error)
                continue
            cancelled += group
        if not cancelled:
            return []
        shown = [task for task in running if task in cancelled]
        log.debug("slot %s cancelled tasks %s (running: %s)", self._task.job_id, cancelled, shown)
        emit(Kind.CANCEL_PENDING, tasks=cancelled, running=shown)
        return cancelled
