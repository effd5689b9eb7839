"""``hpc-elastic events JOB``: the Typer signature; ``Job.events`` of the Python API reads the
timeline, ``hpc_elastic.ops.timeline`` tells it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from hpc_elastic import api, contract, samples
from hpc_elastic.commands._job import JobArg, LogDir
from hpc_elastic.errors import one_line
from hpc_elastic.ops import phases as restart_phases
from hpc_elastic.ops import timeline


def events_command(
    job: JobArg,
    *,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON lines.")] = False,
    every: Annotated[
        bool, typer.Option("--all", help="One line per agent report, not one per happening.")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(metavar="PNG", help="Draw world size and step over time to this file."),
    ] = None,
    phases: Annotated[
        bool, typer.Option("--phases", help="Where each restart's seconds went, phase by phase.")
    ] = False,
    data: Annotated[
        bool,
        typer.Option(
            "--data",
            help="Check the sample log (HPC_ELASTIC_SAMPLE_LOG=1): was any sample trained "
            "twice, or never, in an epoch. Exit 1 if so.",
        ),
    ] = False,
    log_dir: LogDir = None,
) -> None:
    """Print the job's single timeline across requeues; --plot draws it."""
    found = api.Job.find(job, log_dir)
    if data:
        check_samples(found.job_dir / contract.SAMPLES_DIR)
        return
    history = found.events()
    if phases:
        for row in restart_phases.table(restart_phases.restarts(history)):
            typer.echo(row)
        return
    if plot is not None:
        from hpc_elastic.ops.plot import plot as draw  # noqa: PLC0415 (matplotlib: lazily)

        draw(history, plot, found.run_id)
        typer.echo(f"Wrote {plot}.", err=True)
        return
    if not history:
        typer.echo(f"Job '{found.run_id}' has no events yet.", err=True)
    if as_json:
        for event in history:
            typer.echo(json.dumps(asdict(event), sort_keys=True))
    elif every:
        for event in history:
            typer.echo(one_line(timeline.line(event)))
    else:
        story = [event for event in history if event.kind not in restart_phases.MARKERS]
        for event, places in timeline.compact(story):
            typer.echo(one_line(timeline.compact_line(event, places)))


def check_samples(where: Path) -> None:
    """The sample log's verdict, epoch by epoch; exit 1 when a sample was trained twice or
    never (``hpc_elastic.samples``)."""
    if not where.is_dir():
        typer.echo(
            f"No sample log in '{where}': run the job with {contract.SAMPLE_LOG_ENV}=1 and "
            f"call state.log_samples(ids) at every step.",
            err=True,
        )
        raise typer.Exit(1)
    report = samples.check(samples.read(where))
    for line in report.lines:
        typer.echo(one_line(line))
    if report.problems:
        raise typer.Exit(1)
