"""``hpc-elastic cancel JOB``: the Typer signature; ``Job.cancel`` of the Python API does it."""

from __future__ import annotations

from typing import Annotated

import typer

from hpc_elastic import api
from hpc_elastic.commands._job import JobArg, LogDir


def cancel_command(
    job: JobArg,
    log_dir: LogDir = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing.")] = False,
) -> None:
    """End every slot of a job (running and pending), close its rendezvous; checkpoints stay."""
    found = api.Job.find(job, log_dir)
    done = found.cancel()
    if not quiet:
        summary = "; ".join(done) if done else "nothing was running"
        typer.echo(f"Job '{found.run_id}': {summary}.")
