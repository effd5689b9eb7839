"""``hpc-elastic cancel JOB``: the Typer signature; ``hpc_elastic.ops.cancel`` does it."""

from __future__ import annotations

from typing import Annotated

import typer

from hpc_elastic.commands._job import JobArg, LogDir, log_dir_of
from hpc_elastic.ops import jobs
from hpc_elastic.ops.cancel import cancel_job


def cancel_command(
    job: JobArg,
    log_dir: LogDir = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing.")] = False,
) -> None:
    """End every slot of a job (running and pending), close its rendezvous; checkpoints stay."""
    record = jobs.resolve(job, log_dir_of(log_dir))
    done = cancel_job(record)
    if not quiet:
        summary = "; ".join(done) if done else "nothing was running"
        typer.echo(f"Job '{record.run_id}': {summary}.")
