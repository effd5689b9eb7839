"""A slot's view of its job in squeue: the job's arrays, which array each task is in, who speaks.

A job with growth slots (``--grow-partition``, ``--grow-qos``) is two arrays: the guaranteed
slots' and the growth slots' (docs/design.md). A slot asks squeue about both, acts on a task
by its own array's id (``<array>_<task>``), and takes the lowest running slot of the last
answer as the one that speaks for the job (``queue.reports_held``). ``JobArrays`` keeps what
that needs between two squeue answers; the readings of an answer are ``slurm/queue.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.jobdir import JobRecord
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.slurm.queue import reports_held, task_arrays
from hpc_elastic.slurm.task import ArrayTask

log = logging.getLogger(__name__)

SQUEUE_TIMEOUT = 10.0
"""Seconds one background squeue may take; the rendezvous does without the count meanwhile."""


class JobArrays:
    """The job's arrays and the last squeue answer, as one slot's agent saw them.

    One job: which arrays to ask squeue about (``ids``, from ``job.json``), which array a
    sibling task is in (``job_id_of``), and whether this slot is the job's lowest running one
    (``elected``). The held-task watch hands it every answer of the cached squeue (``seen``);
    the end of the job and a slot's own hold ask squeue through it (``squeue``).
    """

    def __init__(self, task: ArrayTask) -> None:
        self._task = task
        self._others: tuple[str, ...] | None = None
        """The job's other arrays, once ``job.json`` names them all (``others``)."""
        self._task_arrays: dict[int, str] = {}
        """Each sibling task's array job, from the last squeue answer (``task_arrays``)."""
        self._statuses: Sequence[JobStatus] = ()
        """The last squeue answer: who is the job's lowest running slot (``elected``)."""

    def others(self) -> tuple[str, ...]:
        """The job's arrays besides this task's own: the growth slots' (or, from a growth
        slot, the guaranteed ones'), from ``job.json``. ``submit`` writes the second job id
        once sbatch has answered, which a slot of the first array may start before: until
        then the answer is read again at every call."""
        if self._others is not None:
            return self._others
        try:
            record = JobRecord.load(self._task.job_dir)
        except HpcElasticError as error:
            log.debug("no job record to find the other arrays in: %s", error)
            return ()
        others = tuple(job for job in record.job_ids if job != self._task.context.array_job_id)
        if record.job_id is not None and (record.grow_job_id is not None or not record.grows):
            self._others = others
            log.debug("slot %s: the job's other arrays are %s", self._task.job_id, others)
        return others

    def ids(self) -> list[str]:
        """Every array of the job, this task's own first: what squeue is asked about."""
        assert self._task.context.array_job_id is not None
        return [self._task.context.array_job_id, *self.others()]

    def squeue(self, *, bounded: bool = True) -> list[JobStatus]:
        """squeue for every array of the job; notes which array each task is in. Unbounded
        (squeue's own timeout) at the end of the job, which has the time and may need it on a
        busy slurmctld; else within SQUEUE_TIMEOUT."""
        arrays = self.ids()
        if bounded:
            statuses = commands.squeue(arrays, self._task.env, timeout=SQUEUE_TIMEOUT)
        else:
            statuses = commands.squeue(arrays, self._task.env)
        self._task_arrays.update(task_arrays(statuses))
        return statuses

    def seen(self, statuses: Sequence[JobStatus]) -> None:
        """An answer of the cached squeue (``queue.ComingSlots``): note which array each task
        is in, and keep the answer for ``elected``."""
        self._task_arrays.update(task_arrays(statuses))
        self._statuses = statuses

    def array_of(self, task: int) -> str:
        """The array job that task ``task`` is in (this task's own, unless squeue said else)."""
        assert self._task.context.array_job_id is not None
        return self._task_arrays.get(task, self._task.context.array_job_id)

    def job_id_of(self, task: int) -> str:
        """``<array>_<task>``: what scontrol and scancel call task ``task``."""
        return f"{self.array_of(task)}_{task}"

    def elected(self) -> bool:
        """Whether this slot asks Slurm for the whole job (the drained nodes): the lowest
        running slot of the last squeue answer, as for held tasks (``reports_held``)."""
        me = self._task.context.array_task_id
        return me is not None and reports_held(self._statuses, me)
