"""The operating commands as Typer functions; ``hpc_elastic.cli`` registers them.

Each one parses, finds the job and delegates: status -> ``status``, logs -> ``logs``,
events -> ``timeline`` and ``plot``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from hpc_elastic.config import load_config
from hpc_elastic.ops import jobs, logs, status, timeline
from hpc_elastic.slurm.commands import JobStatus

LogDir = Annotated[
    Path | None,
    typer.Option(
        metavar="DIR",
        help="Where job directories live. Default: the config file's, else ./hpc-elastic-runs.",
    ),
]
JobArg = Annotated[
    str,
    typer.Argument(metavar="JOB", help="A run id, a job directory or a Slurm job id."),
]


def _log_dir(flag: Path | None) -> Path:
    if flag is not None:
        return flag
    configured = load_config(Path.cwd()).values.get("log_dir")
    return Path(str(configured)) if configured else jobs.DEFAULT_LOG_DIR


def _squeue(job_ids: Sequence[str]) -> list[JobStatus]:
    from hpc_elastic.slurm import commands  # noqa: PLC0415 (tests swap the module's functions)

    return commands.squeue(job_ids)


def status_command(
    job: JobArg,
    log_dir: LogDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show what a job is doing: slots, round, world size, restarts, checkpoint, last failure."""
    view = status.gather(jobs.resolve(job, _log_dir(log_dir)), _squeue)
    if as_json:
        typer.echo(json.dumps(view.to_json(), indent=2))
        return
    status.render(view)
    for warning in view.warnings:
        typer.echo(f"warning: {warning}", err=True)


def list_command(log_dir: LogDir = None) -> None:
    """List your hpc-elastic jobs, one line each, oldest first."""
    directory = _log_dir(log_dir)
    records = jobs.scan(directory)
    if not records:
        typer.echo(f"No hpc-elastic jobs under '{directory}'.", err=True)
        return
    for record in records:
        summary = timeline.summarize(record.events())
        outcome = summary.outcome
        if outcome == "running" and record.local and not record.runner_alive():
            outcome = "stopped"
        where = "local" if record.local else f"slurm {record.job_id or '-'}"
        started = timeline.clock(summary.first_time) if summary.first_time else "--:--:--"
        world = summary.world_size if summary.world_size is not None else "-"
        typer.echo(
            f"{record.run_id:<40} {where:<14} nodes {record.nodes:<6} {outcome:<10} "
            f"started {started}  world {world}  round {summary.round or '-'}"
        )


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
    record = jobs.resolve(job, _log_dir(log_dir))
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


def events_command(
    job: JobArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON lines.")] = False,
    every: Annotated[
        bool, typer.Option("--all", help="One line per agent report, not one per happening.")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(metavar="PNG", help="Draw world size and step over time to this file."),
    ] = None,
    log_dir: LogDir = None,
) -> None:
    """Print the job's single timeline across requeues; --plot draws it."""
    record = jobs.resolve(job, _log_dir(log_dir))
    history = record.events()
    if plot is not None:
        from hpc_elastic.ops.plot import plot as draw  # noqa: PLC0415 (matplotlib: lazily)

        draw(history, plot, record.run_id)
        typer.echo(f"Wrote {plot}.", err=True)
        return
    if not history:
        typer.echo(f"Job '{record.run_id}' has no events yet.", err=True)
    if as_json:
        for event in history:
            typer.echo(json.dumps(asdict(event), sort_keys=True))
    elif every:
        for event in history:
            typer.echo(timeline.line(event))
    else:
        for event, places in timeline.compact(history):
            typer.echo(timeline.compact_line(event, places))
