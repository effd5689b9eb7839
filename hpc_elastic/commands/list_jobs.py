"""``hpc-elastic list``: the click command; ``jobs`` and ``listing`` of the Python API find
the jobs and their states."""

from __future__ import annotations

from pathlib import Path

import click

from hpc_elastic import api
from hpc_elastic.commands._job import log_dir_option
from hpc_elastic.errors import one_line
from hpc_elastic.ops import timeline


@click.command("list")
@log_dir_option
def list_command(log_dir: Path | None) -> None:
    """List your hpc-elastic jobs, one line each, oldest first: every job you submitted or ran,
    whatever its log directory, or with --log-dir only the jobs under that directory."""
    found = api.jobs(log_dir)
    if not found:
        where = f"under '{log_dir}'" if log_dir is not None else "in your job index"
        click.echo(f"No hpc-elastic jobs {where}.", err=True)
        return
    rows, warnings = api.listing(found)
    for row in rows:
        record, summary, state = row.job.record, row.summary, row.state
        where = "local" if record.local else f"slurm {record.job_id or '-'}"
        started = timeline.clock(summary.first_time) if summary.first_time else "--:--:--"
        world = summary.world_size if summary.world_size is not None else "-"
        click.echo(
            one_line(
                f"{record.run_id:<40} {where:<14} nodes {record.nodes:<6} {state:<10} "
                f"started {started}  world {world}  round {summary.round or '-'}"
            )
        )
    for warning in warnings:
        click.echo(f"warning: {one_line(warning)}", err=True)
