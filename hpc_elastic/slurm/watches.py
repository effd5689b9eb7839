"""A slot's two watches of its own node, beside the agent: Slurm drains it, or a save outgrows
the time Slurm leaves.

``SlotDrain`` leaves a node Slurm drains at the next committed checkpoint (the rules and the
thread are ``slurm/drain.py``'s); ``SlotGrace`` times this node's saves against what Slurm
leaves after its warning signal (``slurm/grace.py``'s), and with ``--grace-action lead`` stops
the slot early enough before its time limit. Both stop the slot through the agent's own stop,
as a preemption would; ``ElasticSlot.settle`` (slurm/elastic.py) then requeues it, reading
which drain it left for (``SlotDrain.left_for``) and how far it moved its lead
(``SlotGrace.moved_lead``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hpc_elastic.errors import SlurmError
from hpc_elastic.events import Kind
from hpc_elastic.jobdir import JobDir
from hpc_elastic.slurm import commands, drain, grace
from hpc_elastic.slurm.arrays import SQUEUE_TIMEOUT
from hpc_elastic.slurm.commands import NodeDrain
from hpc_elastic.slurm.ledger import claim
from hpc_elastic.slurm.task import SCONTROL_TIMEOUT, ArrayTask

log = logging.getLogger(__name__)


class SlotDrain:
    """This slot's side of drained nodes (slurm/drain.py).

    One job: leaving a drained node. ``watch`` starts the thread that stops the slot at the
    next committed checkpoint once Slurm drains the node (asking Slurm only while ``elected``
    says this slot speaks for the job); ``here`` reads the job's board when the slot arrives;
    ``left_for`` is the drain the slot left for, which tells ``settle`` to requeue it for
    ``Departure.DRAIN``.
    """

    def __init__(self, task: ArrayTask, elected: Callable[[], bool]) -> None:
        self._task = task
        self._elected = elected
        self.left_for: NodeDrain | None = None
        """The drain this slot left its node for (``watch``, or before it joined), for
        ``ElasticSlot.why_stopping``."""

    def watch(self, stop: Callable[[], None], emit: Callable[..., None]) -> drain.DrainWatch:
        """Start the thread that leaves this node once Slurm drains it (slurm/drain.py): at
        the next committed checkpoint it calls ``stop`` (the agent's stop, as for a
        preemption); ``settle`` then requeues the slot for ``Departure.DRAIN``."""
        paths = JobDir(self._task.job_dir)

        def leave(found: NodeDrain, why: str) -> None:
            self.left_for = found
            log.debug("slot %s leaves drained node %s: %s", self._task.job_id, found.node, why)
            stop()

        watch = drain.DrainWatch(
            self._task.node,
            paths.drained,
            paths.events,
            elected=self._elected,
            query=lambda: commands.drained_nodes(self._task.env, timeout=SQUEUE_TIMEOUT),
            leave=leave,
            emit=emit,
        )
        return watch.start()

    def here(self) -> NodeDrain | None:
        """Whether the job's board shows this node drained already, when the slot arrives: a
        task granted the node just before its drain leaves before it joins."""
        return drain.drain_of(
            drain.read_board(JobDir(self._task.job_dir).drained), self._task.node, time.time()
        )


class SlotGrace:
    """This slot's side of the grace time (slurm/grace.py).

    One job: whether a save still fits what Slurm leaves. ``watch`` starts the thread that
    times this node's saves, from what Slurm says of the task, its partition and QoS
    (``limits``), and acts on a save that outgrows it as ``--grace-action`` says; with
    ``lead`` it moves the slot's own stop before its time limit (``moved_lead``).
    """

    def __init__(self, task: ArrayTask) -> None:
        self._task = task
        self.moved_lead: float | None = None
        """The time-limit lead this slot moved itself to (``--grace-action lead``): a stop that
        comes within it of the time limit is the time limit's (``ElasticSlot.why_stopping``)."""

    def limits(self, lead_s: float) -> grace.Limits | None:
        """What Slurm leaves this slot to save in (``grace.limits_from``), or None if Slurm
        cannot say now (asked again after the next save)."""
        try:
            job = commands.scontrol_show_job(
                self._task.job_id, self._task.env, timeout=SCONTROL_TIMEOUT
            )
            config = commands.show_config(self._task.env)
            partition = (
                commands.partition_record(job.get("Partition") or None, self._task.env) or {}
            )
            table = {}
            if config.get("PreemptType") == "preempt/qos":
                rows = commands.qos_table(self._task.env, timeout=SCONTROL_TIMEOUT)
                table = {name: grace.QosRow(name, *row) for name, row in rows.items()}
        except SlurmError as error:
            log.debug("no grace limits from Slurm now: %s", error)
            return None
        return grace.limits_from(lead_s, job, config, partition, table)

    def watch(
        self,
        run_dir: Path,
        lead_s: float,
        action: str,
        stop: Callable[[], None],
        emit: Callable[..., None],
    ) -> grace.GraceWatch:
        """Start the thread that times this node's saves (slurm/grace.py): when a save and a
        step no longer fit what Slurm leaves, the job's timeline gets one ``grace`` event
        (the first agent to claim ``slots/grace-warned``), with ``action`` ``lead`` this
        slot stops itself (``stop``) early enough before its own time limit, and with
        ``local`` every stop's save goes to the node-local tier first (``slots/local-first``,
        which the workers read when their loop stops)."""
        paths = JobDir(self._task.job_dir)

        def warn(fit: grace.Fit) -> None:
            if action == "local" and claim(paths.local_first):
                log.debug(
                    "slot %s: the job's stop saves go to the local tier first", self._task.job_id
                )
            if claim(paths.slots / "grace-warned"):
                emit(
                    Kind.GRACE,
                    message=fit.sentence(),
                    advice=fit.advice(),
                    save_s=round(fit.save_s, 2),
                    step_s=round(fit.step_s, 2),
                    lead_s=fit.limits.lead_s,
                    grace_s=fit.limits.grace_s,
                    where=fit.limits.where,
                    preempt_mode=fit.limits.preempt_mode,
                    action=action,
                )
            log.warning("slot %s: %s", self._task.job_id, fit.sentence())

        def stop_at(lead: float) -> None:
            self.moved_lead = lead
            threading.Thread(
                target=self._stop_before_the_end,
                args=(lead, stop, emit),
                name="hpc-elastic-lead",
                daemon=True,
            ).start()

        watch = grace.GraceWatch(
            run_dir,
            limits=lambda: self.limits(lead_s),
            warn=warn,
            stop_at=stop_at if action == "lead" else None,
        )
        return watch.start()

    def _stop_before_the_end(
        self, lead: float, stop: Callable[[], None], emit: Callable[..., None]
    ) -> None:
        """``--grace-action lead``: sleep until ``lead`` seconds before this task's end (asked
        again before acting, in case its time limit changed), then stop the slot, which the
        time-limit path requeues (``moved_lead``)."""
        while True:
            try:
                job = commands.scontrol_show_job(
                    self._task.job_id, self._task.env, timeout=SCONTROL_TIMEOUT
                )
            except SlurmError as error:
                log.debug("no end time from Slurm, trying again: %s", error)
                time.sleep(grace.LEAD_MARGIN_S)
                continue
            end = grace.parse_end_time(job.get("EndTime", ""))
            if end is None or job.get("TimeLimit") in ("UNLIMITED", "Partition_Limit"):
                log.debug("slot %s has no end time: the lead is not moved", self._task.job_id)
                return
            wait = end - lead - time.time()
            if wait <= 0:
                log.debug(
                    "slot %s stops %.0f s before its end (moved lead)", self._task.job_id, lead
                )
                emit(
                    Kind.GRACE,
                    message=f"stopping {lead:.0f} s before the time limit",
                    action="lead",
                )
                stop()
                return
            time.sleep(min(wait, 60.0))
