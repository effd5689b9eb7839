"""``hpc-elastic cancel JOB``: the click command; ``Job.cancel`` of the Python API does it."""

from __future__ import annotations

from pathlib import Path

import click

from hpc_elastic import api
from hpc_elastic.commands._job import job_argument, log_dir_option


@click.command("cancel")
@job_argument
@log_dir_option
@click.option("--quiet", "-q", is_flag=True, help="Print nothing.")
def cancel_command(job: str, log_dir: Path | None, quiet: bool) -> None:
    """End every slot of a job (running and pending), close its rendezvous; checkpoints stay."""
    found = api.Job.find(job, log_dir)
    done = found.cancel()
    if not quiet:
        summary = "; ".join(done) if done else "nothing was running"
        click.echo(f"Job '{found.run_id}': {summary}.")
