"""``hpc-elastic logs JOB``: the click command; ``Job.write_logs`` of the Python API finds and
prints."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpc_elastic import api
from hpc_elastic.commands._job import job_argument, log_dir_option


@click.command("logs")
@job_argument
@click.option("--rank", type=int, metavar="R", help="Only this global rank.")
@click.option("--attempt", type=int, metavar="N", help="Only this attempt (rendezvous round).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output until the job ends.")
@log_dir_option
def logs_command(
    job: str, rank: int | None, attempt: int | None, follow: bool, log_dir: Path | None
) -> None:
    """Print per-rank logs across restarts and requeues, one attempt after the other."""
    found = api.Job.find(job, log_dir)
    write = _write_flushed if follow else sys.stdout.write
    if not found.write_logs(write, rank, attempt, follow=follow) and not follow:
        click.echo(f"Job '{found.run_id}' has no worker logs yet.", err=True)


def _write_flushed(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
