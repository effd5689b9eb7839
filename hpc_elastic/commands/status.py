"""``hpc-elastic status JOB``: the click command; ``Job.status`` of the Python API gathers,
``hpc_elastic.ops.status`` shows."""

from __future__ import annotations

import json
from pathlib import Path

import click

from hpc_elastic import api
from hpc_elastic.commands._job import job_argument, log_dir_option
from hpc_elastic.errors import one_line
from hpc_elastic.ops import status


@click.command("status")
@job_argument
@log_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status_command(job: str, log_dir: Path | None, as_json: bool) -> None:
    """Show what a job is doing: slots, round, world size, restarts, checkpoint, last failure."""
    view = api.Job.find(job, log_dir).status()
    if as_json:
        click.echo(json.dumps(view.to_json(), indent=2))
        return
    status.render(view)
    for warning in view.warnings:
        click.echo(f"warning: {one_line(warning)}", err=True)
