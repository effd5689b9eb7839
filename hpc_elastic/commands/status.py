"""``hpc-elastic status JOB``: the Typer signature; ``Job.status`` of the Python API gathers,
``hpc_elastic.ops.status`` shows."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from hpc_elastic import api
from hpc_elastic.commands._job import JobArg, LogDir
from hpc_elastic.errors import one_line
from hpc_elastic.ops import status


def status_command(
    job: JobArg,
    log_dir: LogDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show what a job is doing: slots, round, world size, restarts, checkpoint, last failure."""
    view = api.Job.find(job, log_dir).status()
    if as_json:
        typer.echo(json.dumps(view.to_json(), indent=2))
        return
    status.render(view)
    for warning in view.warnings:
        typer.echo(f"warning: {one_line(warning)}", err=True)
