"""``hpc-elastic cancel``: end every slot of a job, close its rendezvous, keep its checkpoints.

Slurm first, so that no pending slot starts while the rendezvous closes; then the rendezvous
is closed: its state and membership are removed and a ``closed`` tombstone stays, so an agent
that was still starting exits 0 at once instead of waiting for company.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

from hpc_elastic import events
from hpc_elastic.errors import SlurmError, UsageError
from hpc_elastic.ops import jobs
from hpc_elastic.slurm import commands


def cancel(
    record: jobs.JobRecord,
    scancel: Callable[[str], None],
    close: Callable[[jobs.JobRecord], None],
) -> list[str]:
    """Cancel ``record``'s job; returns what was done, one phrase each, for the user."""
    done = []
    if record.local:
        # runner_alive checks the pid still carries this job's marker: a recycled or forged
        # pid in job.json must never be signalled.
        if jobs.runner_alive(record) and record.runner_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.runner_pid, signal.SIGTERM)
            done.append(f"stopped the local run (pid {record.runner_pid})")
    elif record.job_id is not None:
        for job_id in record.job_ids:  # the array, then the growth slots' array if any
            if not job_id.isdigit():  # parse_record already refuses it; never reach scancel
                raise UsageError(f"Slurm job id '{job_id}' is not a number; not cancelling.")
        for job_id in record.job_ids:
            scancel(job_id)
        done.append(f"cancelled Slurm job {' and '.join(record.job_ids)} (every slot)")
    if record.zk is not None and not record.local:
        close(record)
        done.append("closed the rendezvous")
    events.append(
        record.events_file,
        events.Event(kind=events.Kind.CANCEL, job=record.run_id, details={"by": "user"}),
    )
    return done


def cancel_job(record: jobs.JobRecord) -> list[str]:
    """``cancel`` with the real Slurm and ZooKeeper (``scancel_job``, ``close_rendezvous``):
    what ``Job.cancel`` of the Python API, and so the CLI's ``cancel``, does. Both are looked
    up when it runs, so a test with no ZooKeeper replaces ``close_rendezvous`` here for every
    caller; Slurm is faked at the Slurm layer's own subprocess call."""
    return cancel(record, scancel_job, close_rendezvous)


def scancel_job(job_id: str) -> None:
    """``scancel`` the job; a refusal is no error once Slurm no longer lists the job (it ended
    meanwhile)."""
    try:
        commands.cancel(job_id)
    except SlurmError:
        if commands.squeue([job_id]):
            raise


def close_rendezvous(record: jobs.JobRecord) -> None:
    """Close the job's ZooKeeper rendezvous (kazoo imported only here)."""
    from hpc_elastic.rendezvous import zookeeper  # noqa: PLC0415
    from hpc_elastic.rendezvous.secret import read_secret_file  # noqa: PLC0415

    assert record.zk is not None
    secret = read_secret_file(record.secret_file) if record.secret_file.exists() else None
    zookeeper.close_job(record.zk, record.run_id, secret)
