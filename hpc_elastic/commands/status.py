"""``hpc-elastic status JOB``: the Typer signature; ``hpc_elastic.ops.status`` gathers and shows."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated

import typer

from hpc_elastic.commands._job import JobArg, LogDir, log_dir_of
from hpc_elastic.errors import one_line
from hpc_elastic.ops import jobs, status
from hpc_elastic.slurm.commands import JobStatus


def squeue(job_ids: Sequence[str]) -> list[JobStatus]:
    from hpc_elastic.slurm import commands  # noqa: PLC0415 (tests swap the module's functions)

    return commands.squeue(job_ids)


def status_command(
    job: JobArg,
    log_dir: LogDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show what a job is doing: slots, round, world size, restarts, checkpoint, last failure."""
    view = status.gather(jobs.resolve(job, log_dir_of(log_dir)), squeue)
    if as_json:
        typer.echo(json.dumps(view.to_json(), indent=2))
        return
    status.render(view)
    for warning in view.warnings:
        typer.echo(f"warning: {one_line(warning)}", err=True)
