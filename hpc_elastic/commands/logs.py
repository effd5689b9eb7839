"""``hpc-elastic logs JOB``: the Typer signature; ``Job.write_logs`` of the Python API finds and
prints."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from hpc_elastic import api
from hpc_elastic.commands._job import JobArg, LogDir


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
    found = api.Job.find(job, log_dir)
    write = _write_flushed if follow else sys.stdout.write
    if not found.write_logs(write, rank, attempt, follow=follow) and not follow:
        typer.echo(f"Job '{found.run_id}' has no worker logs yet.", err=True)


def _write_flushed(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
