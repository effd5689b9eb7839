"""``hpc-elastic events JOB``: the click command; ``Job.events`` of the Python API reads the
timeline, ``hpc_elastic.ops.timeline`` tells it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from hpc_elastic import api, contract, samples
from hpc_elastic.clicktools import exit_with
from hpc_elastic.commands._job import job_argument, log_dir_option
from hpc_elastic.errors import one_line
from hpc_elastic.ops import phases as restart_phases
from hpc_elastic.ops import timeline


@click.command("events")
@job_argument
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON lines.")
@click.option(
    "--all", "every", is_flag=True, help="One line per agent report, not one per happening."
)
@click.option(
    "--plot",
    type=click.Path(path_type=Path),
    metavar="PNG",
    help="Draw world size and step over time to this file.",
)
@click.option("--phases", is_flag=True, help="Where each restart's seconds went, phase by phase.")
@click.option(
    "--data",
    is_flag=True,
    help="Check the sample log (HPC_ELASTIC_SAMPLE_LOG=1): was any sample trained twice, or "
    "never, in an epoch. Exit 1 if so.",
)
@log_dir_option
def events_command(
    job: str,
    *,
    as_json: bool,
    every: bool,
    plot: Path | None,
    phases: bool,
    data: bool,
    log_dir: Path | None,
) -> None:
    """Print the job's single timeline across requeues; --plot draws it."""
    found = api.Job.find(job, log_dir)
    if data:
        check_samples(found.job_dir / contract.SAMPLES_DIR)
        return
    history = found.events()
    if phases:
        for row in restart_phases.table(restart_phases.restarts(history)):
            click.echo(row)
        return
    if plot is not None:
        from hpc_elastic.ops.plot import plot as draw  # noqa: PLC0415 (matplotlib: lazily)

        draw(history, plot, found.run_id)
        click.echo(f"Wrote {plot}.", err=True)
        return
    if not history:
        click.echo(f"Job '{found.run_id}' has no events yet.", err=True)
    if as_json:
        for event in history:
            click.echo(json.dumps(asdict(event), sort_keys=True))
    elif every:
        for event in history:
            click.echo(one_line(timeline.line(event)))
    else:
        story = [event for event in history if event.kind not in restart_phases.MARKERS]
        for event, places in timeline.compact(story):
            click.echo(one_line(timeline.compact_line(event, places)))


def check_samples(where: Path) -> None:
    """The sample log's verdict, epoch by epoch; exit 1 when a sample was trained twice or
    never (``hpc_elastic.samples``)."""
    if not where.is_dir():
        click.echo(
            f"No sample log in '{where}': run the job with {contract.SAMPLE_LOG_ENV}=1 and "
            f"call state.log_samples(ids) at every step.",
            err=True,
        )
        exit_with(1)
    report = samples.check(samples.read(where))
    for line in report.lines:
        click.echo(one_line(line))
    if report.problems:
        exit_with(1)
