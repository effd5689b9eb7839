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
from typing import Annotated

import typer

from hpc_elastic import events
from hpc_elastic.errors import SlurmError
from hpc_elastic.ops import jobs
from hpc_elastic.ops.commands import JobArg, LogDir, _log_dir


def cancel(
    record: jobs.JobRecord,
    scancel: Callable[[str], None],
    close: Callable[[jobs.JobRecord], None],
) -> list[str]:
    """Cancel ``record``'s job; returns what was done, one phrase each, for the user."""
    done = []
    if record.local:
        if record.runner_alive() and record.runner_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.runner_pid, signal.SIGTERM)
            done.append(f"stopped the local run (pid {record.runner_pid})")
    elif record.job_id is not None:
        scancel(record.job_id)
        done.append(f"cancelled Slurm job {record.job_id} (every slot)")
    if record.zk is not None and not record.local:
        close(record)
        done.append("closed the rendezvous")
    events.append(
        record.events_file, events.Event(kind="cancel", job=record.run_id, details={"by": "user"})
    )
    return done


def _scancel(job_id: str) -> None:
    from hpc_elastic.slurm import commands  # noqa: PLC0415 (tests swap the module's functions)

    try:
        commands.cancel(job_id)
    except SlurmError:
        if commands.squeue([job_id]):
            raise


def _close(record: jobs.JobRecord) -> None:
    """Close the job's ZooKeeper rendezvous (kazoo imported only here)."""
    from hpc_elastic.rendezvous import zookeeper  # noqa: PLC0415
    from hpc_elastic.rendezvous.secret import read_secret_file  # noqa: PLC0415

    assert record.zk is not None
    secret = read_secret_file(record.secret_file) if record.secret_file.exists() else None
    zookeeper.close_job(record.zk, record.run_id, secret)


def cancel_command(
    job: JobArg,
    log_dir: LogDir = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing.")] = False,
) -> None:
    """End every slot of a job (running and pending), close its rendezvous; checkpoints stay."""
    record = jobs.resolve(job, _log_dir(log_dir))
    done = cancel(record, _scancel, _close)
    if not quiet:
        summary = "; ".join(done) if done else "nothing was running"
        typer.echo(f"Job '{record.run_id}': {summary}.")
