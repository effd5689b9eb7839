"""Slurm's side of an elastic job's slots (array tasks): the one object the agent of a slot holds.

An elastic job is one array of MAX one-node tasks (docs/design.md). ``ElasticSlot`` is what
the agent of one task holds for its dealings with Slurm. Its own job is the slot's life across
incarnations: the ledger (``slurm/ledger.py``: its arrival, failures and bad nodes) and the
requeue, away from which nodes and for which cause, or none once the job is over. Each other
job is a part of its own, built from the same context and reached as an attribute:

- ``arrays`` (``slurm/arrays.py``): the job's arrays and the last squeue answer;
- ``holds`` (``slurm/holds.py``): sibling tasks Slurm holds, released or reported;
- ``departure`` (``slurm/departure.py``): why Slurm stops this task, asked at the signal;
- ``drain`` and ``grace`` (``slurm/watches.py``): leaving a drained node, and saves timed
  against the time Slurm leaves;
- ``job_end`` (``slurm/ending.py``): cancelling the siblings once the job is over.

What squeue's listing says (which tasks run, start, pend or are held, and the cached slot
count) is read in ``slurm/queue.py``, which the operator's commands share; ``scontrol`` on the
task itself, asked again on a busy slurmctld, is ``slurm/task.py``'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path

from hpc_elastic.contract import PREEMPTED_EXIT_CODE
from hpc_elastic.errors import SlurmError
from hpc_elastic.events import Kind
from hpc_elastic.jobdir import JobDir
from hpc_elastic.slurm import commands, drain
from hpc_elastic.slurm.arrays import SQUEUE_TIMEOUT, JobArrays
from hpc_elastic.slurm.commands import NodeDrain
from hpc_elastic.slurm.departure import Departure, StopInquiry
from hpc_elastic.slurm.ending import JobEnd
from hpc_elastic.slurm.env import SlurmContext
from hpc_elastic.slurm.holds import HELD_POLL_S, HeldTasks
from hpc_elastic.slurm.ledger import (
    KILLED_LEAVING_IS_EXPECTED,
    Arrival,
    SlotLedger,
    SlotLimits,
    load_ledger,
    save_ledger,
)
from hpc_elastic.slurm.queue import ComingSlots, QueueBoard, poll
from hpc_elastic.slurm.task import ArrayTask, requeue
from hpc_elastic.slurm.watches import SlotDrain, SlotGrace

log = logging.getLogger(__name__)

DEFAULT_LIMITS = SlotLimits()
"""The requeue budgets of a slot whose agent was given none (the contract's defaults)."""


class ElasticSlot:
    """One array task's dealings with Slurm, for the agent that runs in it.

    Its parts (the module's docstring lists them) take the task's context, job directory and
    environment at construction, so none of those changes afterwards (``context`` has no
    setter): a new incarnation of the slot is a new agent process with a new ``ElasticSlot``.
    Its own methods keep the ledger (``arrive``, ``count_failure``, ``mark_bad``, ``leave``)
    and requeue the slot (``requeue``, ``move_away``, ``leave_drained``, ``settle``).
    """

    def __init__(
        self,
        context: SlurmContext,
        job_dir: Path,
        limits: SlotLimits = DEFAULT_LIMITS,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.task = ArrayTask(context, job_dir, env)
        self.limits = limits
        self.problem: str | None = None
        """Why the ledger could not be read (its counts then start afresh), for a warning event."""
        self._lock = threading.Lock()
        """The departure watch writes the ledger from its own thread."""
        self.remembered_bad: tuple[str, ...] = ()
        """The user's bad nodes remembered across jobs (the health preflight read them): every
        requeue of this slot keeps away from them too, not only from the slot's own bad nodes."""
        try:
            self._ledger = load_ledger(self.ledger_path)
        except SlurmError as error:
            log.warning("%s", error)
            self.problem, self._ledger = str(error), SlotLedger()
        self.arrays = JobArrays(self.task)
        self.holds = HeldTasks(self.task, self.arrays)
        self.departure = StopInquiry(self.task, note=self._note_leaving)
        self.drain = SlotDrain(self.task, self.arrays.elected)
        self.grace = SlotGrace(self.task)
        self.job_end = JobEnd(self.task, self.arrays)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], job_dir: Path, limits: SlotLimits
    ) -> ElasticSlot | None:
        """None unless this process runs in a task of a job array (an elastic job)."""
        context = SlurmContext.from_env(environ)
        if context is None or context.array_job_id is None or context.array_task_id is None:
            return None
        return cls(context, job_dir, limits)

    @property
    def context(self) -> SlurmContext:
        return self.task.context

    @property
    def ledger_path(self) -> Path:
        return JobDir(self.task.job_dir).slot_ledger(str(self.context.array_task_id))

    @property
    def job_id(self) -> str:
        return self.task.job_id

    @property
    def node(self) -> str:
        return self.task.node

    @property
    def ledger(self) -> SlotLedger:
        return self._ledger

    def arrive(self) -> Arrival:
        """Record the start on this node, and how the previous incarnation ended: one that
        died with its node counts as a failure there (``Arrival.node_failure``)."""
        with self._lock:
            ledger, arrival = self._ledger.arrived(self.node)
            self._save(ledger)
        log.debug("slot %s arrives on %s after %s", self.job_id, self.node, arrival)
        return arrival

    def count_failure(self) -> bool:
        """A worker of this slot failed on this node; True once the node is bad for the slot."""
        with self._lock:
            self._save(self._ledger.failed_on(self.node))
        return self._ledger.is_bad(self.node, self.limits)

    def placed_badly(self) -> bool:
        return self._ledger.is_bad(self.node, self.limits) or self.node in self._ledger.excluded

    def expected_nodes(self, emit: Callable[..., None] | None = None) -> ComingSlots:
        """The slot count for the rendezvous, already asking Slurm: the first answer is
        likely in by the time the first round is decided. With ``emit``, the same squeue
        answers also report tasks Slurm holds (``HeldTasks.watch``)."""
        assert self.context.array_job_id is not None
        coming = ComingSlots(
            self.context.array_job_id,
            lambda ids: commands.squeue(ids, self.task.env, timeout=SQUEUE_TIMEOUT),
            on_statuses=self.holds.watch(emit) if emit is not None else None,
            also=self.arrays.others,
            board=QueueBoard(JobDir(self.task.job_dir).queue_board) if emit is not None else None,
            elected=self.arrays.elected,
        )
        coming()
        if emit is not None:
            poll(coming, HELD_POLL_S, self.arrays.elected)
        return coming

    def _note_leaving(self, why: Departure) -> None:
        """What Slurm said at the stop signal, in the ledger at once: a slot that Slurm
        SIGKILLs while it saves for this cause is no node failure (``SlotLedger.arrived``)."""
        if why in KILLED_LEAVING_IS_EXPECTED:
            with self._lock:
                self._save(replace(self._ledger, leaving_for=why.value))

    def why_stopping(self, warning_s: float) -> tuple[Departure, dict[str, str]]:
        """Workers stopped to be requeued (exit 75): why. The answer Slurm gave when the stop
        signal arrived, if one did (see ``DepartureWatch``); else Slurm is asked now, as when
        the bad-node watch or the workers themselves stopped the slot."""
        recorded = self.departure.recorded()
        warning_s = max(warning_s, self.grace.moved_lead or 0.0)
        why, evidence = recorded if recorded is not None else self.departure.ask(warning_s)
        evidence = {**evidence, "asked": "at the signal" if recorded else "after the drain"}
        if why is not Departure.CANCELLED and self.placed_badly():
            return Departure.BAD_NODE, evidence
        if why is Departure.BY_HAND and self.drain.left_for is not None:
            # Nothing else from Slurm (no preemption, no time limit): we left for the drain.
            left = self.drain.left_for
            return Departure.DRAIN, {**evidence, "state": left.state, "reason": left.reason}
        return why, evidence

    def requeue(self, why: Departure, emit: Callable[..., None] | None = None) -> str | None:
        """Requeue this task (away from its bad nodes); returns why it may not, if so. With
        ``emit``, a requeue that Slurm answered with a hold is announced
        (``HeldTasks.announce_own``)."""
        with self._lock:
            ledger = self._ledger.requeued(why)
            if why is Departure.BAD_NODE:
                ledger = ledger.exclude(self.node)
            refused = ledger.over_limit(self.limits)
            self._save(replace(ledger, running_on=None, leaving_for=None))
        if refused is not None:
            return refused
        try:
            warning = requeue(
                self.job_id, self.excluded(), self.task.env, restarts=self.context.restart_count
            )
        except SlurmError as error:
            return str(error)
        if warning is not None:
            log.warning("%s", warning)
        if emit is not None:
            if warning is not None:
                emit(Kind.WARNING, message=warning)
            self.holds.announce_own(emit)
        return None

    def excluded(self) -> list[str]:
        """The requeue's ``ExcNodeList``: the slot's own bad nodes and the user's, and the
        nodes Slurm drains now (``drain.drained_now``): a node resumed while the task pends is
        avoided until its next requeue, the price of never landing on one drained meanwhile."""
        drained = drain.drained_now(JobDir(self.task.job_dir).drained)
        return sorted({*self._ledger.excluded, *self.remembered_bad, *drained})

    def leave_drained(self, found: NodeDrain, emit: Callable[..., None]) -> int:
        """Requeue the slot off a node drained before it joined; the exit code (75, or 1 if
        Slurm refused)."""
        emit(Kind.DRAIN, **asdict(found), action="leaving before joining")
        self.drain.left_for = found
        return self._requeued(Departure.DRAIN, emit)

    def move_away(self, cause: str, emit: Callable[..., None], **details: object) -> int:
        """Leave this node for good and requeue the slot elsewhere, before or instead of
        running: the health preflight failed here (``cause`` "unhealthy"), or a rank here
        straggles. Returns the slot's exit code: 75 once requeued, 1 if Slurm refused."""
        emit(Kind.EXCLUDE, node=self.node, cause=cause, **details)
        log.debug("slot %s leaves %s (%s)", self.job_id, self.node, cause)
        return self._requeued(Departure.BAD_NODE, emit, cause=cause)

    def mark_bad(self) -> None:
        """This node must not host the slot again (a straggler here): the next settle sees
        ``placed_badly`` and requeues the slot away from it, as after repeated failures."""
        with self._lock:
            self._save(self._ledger.exclude(self.node))

    def leave(self) -> None:
        """A clean exit: the next incarnation must not count this one as a crash."""
        with self._lock:
            self._save(replace(self._ledger, running_on=None, leaving_for=None))

    def settle(self, exit_code: int, warning_s: float, emit: Callable[..., None]) -> int:
        """After the agent: requeue a slot that stopped to be moved, or, once the job is over
        (0: done, 1: failed), cancel the array's pending tasks. Returns the slot's exit code."""
        why, evidence = (
            self.why_stopping(warning_s) if exit_code == PREEMPTED_EXIT_CODE else (None, {})
        )
        if why is not None and why is not Departure.CANCELLED:
            if why is Departure.BAD_NODE:
                emit(
                    Kind.EXCLUDE, node=self.node, failures=self._ledger.node_failures.get(self.node)
                )
            return self._requeued(why, emit, slurm=evidence)
        if why is Departure.CANCELLED:
            emit(Kind.CANCELLED, slurm=evidence, slurm_job=self.job_id)
        self.leave()  # First: a sibling ending the job reads it, and never cancels this task.
        if exit_code in (0, 1):
            self.job_end.end_siblings(exit_code, warning_s, emit)
        return exit_code

    def _requeued(
        self, why: Departure, emit: Callable[..., None], cause: str = "", **details: object
    ) -> int:
        """Requeue the slot for ``why`` and say so (a ``requeue`` event, its cause ``cause`` or
        ``why``'s), or, when Slurm refuses, say that the slot leaves. The slot's exit code: 75
        once requeued, 1 if Slurm refused."""
        refused = self.requeue(why, emit)
        if refused is not None:
            emit(Kind.LEAVE, reason=f"slot {self.context.array_task_id} is not requeued: {refused}")
            return 1
        emit(
            Kind.REQUEUE,
            cause=cause or why.value,
            **details,
            slurm_job=self.job_id,
            excluded=self.excluded(),
        )
        return PREEMPTED_EXIT_CODE

    def _save(self, ledger: SlotLedger) -> None:
        self._ledger = ledger
        save_ledger(self.ledger_path, ledger)
