"""``hpc-elastic logs JOB``: the Typer signature; ``hpc_elastic.ops.logs`` finds and prints."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from hpc_elastic.commands._job import JobArg, LogDir, log_dir_of
from hpc_elastic.ops import jobs, logs


def logs_command(
    job: JobArg,
    rank: Annotated[int | None, typer.Option(metavar="R", help="Only this global rank.")] = None,
    attempt: Annotated[
        int | None, typer.Option(metavar="N", help="Only this attempt (rendezvous round).")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new output until the job ends.")
    ] = False,
    log_dir: LogDir = None,
) -> None:
    """Print per-rank logs across restarts and requeues, one attempt after the other."""
    record = jobs.resolve(job, log_dir_of(log_dir))
    found = logs.find(record)
    chosen = logs.select(record, found, rank, attempt)
    if follow:
        logs.follow(record, rank, attempt, _write_flushed, logs.job_is_over(record))
        return
    if not chosen:
        typer.echo(f"Job '{record.run_id}' has no worker logs yet.", err=True)
        return
    logs.show(chosen, sys.stdout.write)


def _write_flushed(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
