"""``hpc-elastic list``: the Typer signature; ``hpc_elastic.ops.jobs`` finds the jobs."""

from __future__ import annotations

import typer

from hpc_elastic.commands._job import LogDir, log_dir_of
from hpc_elastic.commands.status import squeue
from hpc_elastic.errors import one_line
from hpc_elastic.ops import jobs, status, timeline


def list_command(log_dir: LogDir = None) -> None:
    """List your hpc-elastic jobs, one line each, oldest first: every job you submitted or ran,
    whatever its log directory, or with --log-dir only the jobs under that directory."""
    directory = log_dir_of(log_dir)
    records = jobs.scan(directory) if log_dir is not None else jobs.everywhere(directory)
    if not records:
        where = f"under '{directory}'" if log_dir is not None else "in your job index"
        typer.echo(f"No hpc-elastic jobs {where}.", err=True)
        return
    summaries = [(record, timeline.summarize(record.events())) for record in records]
    states, warnings = status.job_states(summaries, squeue)
    for (record, summary), state in zip(summaries, states, strict=True):
        where = "local" if record.local else f"slurm {record.job_id or '-'}"
        started = timeline.clock(summary.first_time) if summary.first_time else "--:--:--"
        world = summary.world_size if summary.world_size is not None else "-"
        typer.echo(
            one_line(
                f"{record.run_id:<40} {where:<14} nodes {record.nodes:<6} {state:<10} "
                f"started {started}  world {world}  round {summary.round or '-'}"
            )
        )
    for warning in warnings:
        typer.echo(f"warning: {one_line(warning)}", err=True)
