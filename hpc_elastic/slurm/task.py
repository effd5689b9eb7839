"""A slot's own array task: what its agent's parts know of it, and scontrol on it, made to
survive a busy slurmctld and its own requeue.

``ArrayTask`` is what every part of ``ElasticSlot`` (slurm/elastic.py) is built from: the
context Slurm gave the task, the job directory it shares with its siblings, and the
environment Slurm's tools run in.

Two things an agent asks of Slurm about its own task fail in ways a plain call does not
survive: ``scontrol show job`` at a stop signal, when slurmctld is busy with the very
preemption that sent it (``read_job`` tries again), and ``scontrol requeue``, which ends the
task at once and may kill the very ``scontrol`` that asked for it (``requeue`` checks what
Slurm shows before it calls a failed try a failure, and so does the ``ExcNodeList`` update
after it). The decisions of when and why to requeue are ``ElasticSlot``'s (slurm/elastic.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.errors import SlurmError
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.env import SlurmContext

log = logging.getLogger(__name__)

SCONTROL_TIMEOUT = 10.0
"""Seconds the agent waits for ``scontrol show job`` when it asks why it is being stopped."""
SCONTROL_TRIES = 3
SCONTROL_PAUSE = 0.5
"""Tries of that ``scontrol``, and seconds between two (well inside any GraceTime)."""


@dataclass(frozen=True)
class ArrayTask:
    """One array task of an elastic job, as its agent's slot and the slot's parts reach it."""

    context: SlurmContext
    job_dir: Path
    env: Mapping[str, str] | None = None
    """The environment Slurm's tools run in (None: this process's)."""

    @property
    def job_id(self) -> str:
        """``<array job id>_<array task id>``: what scontrol and scancel call this task."""
        return f"{self.context.array_job_id}_{self.context.array_task_id}"

    @property
    def node(self) -> str:
        """The node this incarnation runs on, as Slurm names it (what ``ExcNodeList`` takes)."""
        return self.context.node_name


def read_job(job_id: str, env: Mapping[str, str] | None) -> dict[str, str] | SlurmError:
    """``scontrol show job`` for this task, tried a few times: a slurmctld busy with the
    very preemption that signalled us may drop a first request."""
    error = SlurmError(f"scontrol was not asked about {job_id}.")
    for attempt in range(SCONTROL_TRIES):
        if attempt:
            time.sleep(SCONTROL_PAUSE)
        try:
            return commands.scontrol_show_job(job_id, env, timeout=SCONTROL_TIMEOUT)
        except SlurmError as failed:
            log.debug("scontrol show job %s, try %d: %s", job_id, attempt + 1, failed)
            error = failed
    return error


def requeue(
    job_id: str,
    exclude: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    restarts: int = 0,
) -> str | None:
    """Requeue a running task, away from ``exclude``; ``restarts`` is its restart count now.

    The requeue ends the task at once: Slurm signals every process of its step, and the
    ``scontrol requeue`` that the agent runs is one of them, so it may die before it can say
    that it worked (seen on 22.05: exit by signal, nothing on stderr, and the task requeued).
    A failed call therefore counts as done when the task's ``Restarts`` has moved on.
    Right after the requeue the task is PENDING (still completing), so its ``ExcNodeList``
    can be set by the very agent that is about to exit (checked on 22.05).
    Returns a warning when the task is requeued but its ``ExcNodeList`` could not be set.
    """
    try:
        commands.requeue(job_id, env)
    except SlurmError:
        if not requeued_since(job_id, restarts, env):
            raise
        log.debug("scontrol requeue %s died, but Slurm requeued the task", job_id)
    if not exclude:
        return None
    try:
        _set_excluded(job_id, exclude, env)
    except SlurmError as error:
        # Requeued all the same: the task comes back, maybe on a bad node, whose checks and
        # failure counts then move it again. Leaving instead would lose the slot for good.
        return f"slot {job_id} is requeued without keeping away from {','.join(exclude)}: {error}"
    return None


def _set_excluded(job_id: str, exclude: Sequence[str], env: Mapping[str, str] | None) -> None:
    """Set a just-requeued task's ``ExcNodeList``. The ``scontrol update`` can die like the
    requeue's own (the completing task's processes are still being signalled: seen in the
    30-min soak as "failed: no error message"), so it is tried again, and a failed try counts
    as done once Slurm shows the list."""
    wanted = ",".join(exclude)
    failed = SlurmError(f"scontrol update was not run for {job_id}.")
    for attempt in range(SCONTROL_TRIES):
        if attempt:
            time.sleep(SCONTROL_PAUSE)
        try:
            commands.update_job(job_id, env, ExcNodeList=wanted)
            return
        except SlurmError as error:
            log.debug(
                "scontrol update %s ExcNodeList=%s, try %d: %s", job_id, wanted, attempt + 1, error
            )
            failed = error
        if _excludes(job_id, exclude, env):
            return
    raise failed


def _excludes(job_id: str, exclude: Sequence[str], env: Mapping[str, str] | None) -> bool:
    """Whether Slurm shows every node of ``exclude`` in the task's ``ExcNodeList``."""
    try:
        record = commands.scontrol_show_job(job_id, env, timeout=SCONTROL_TIMEOUT)
    except SlurmError:
        return False
    shown = record.get("ExcNodeList", "")
    return all(node in shown.split(",") for node in exclude)


def requeued_since(job_id: str, restarts: int, env: Mapping[str, str] | None = None) -> bool:
    """Whether Slurm requeued the task since it had ``restarts`` restarts."""
    try:
        record = commands.scontrol_show_job(job_id, env, timeout=SCONTROL_TIMEOUT)
    except SlurmError:
        return False
    count = record.get("Restarts", "")
    return count.isdigit() and int(count) > restarts
