"""``hpc-elastic submit`` and ``hpc-elastic render``: the click command, then the domain.

The options come from the option table (``hpc_elastic.options``); the domain is
``hpc_elastic.submission`` (plan, then write the job directory and sbatch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import click

from hpc_elastic import api, sensitive
from hpc_elastic.clicktools import Parsed
from hpc_elastic.commands import Invocation
from hpc_elastic.ensemble.choice import require_alive
from hpc_elastic.jobdir import CodeSnapshot
from hpc_elastic.options import SUBMIT_OPTIONS, with_options
from hpc_elastic.snapshot import MB
from hpc_elastic.spec import parse_script
from hpc_elastic.submission import Plan

SUBMIT_HELP = """Render the sbatch script for SCRIPT and submit it with sbatch.

Prints the Slurm job id, the job directory and where the logs go. Defaults come from
hpc-elastic.toml or [tool.hpc-elastic] in pyproject.toml (searched upwards from the
current directory); flags beat the file.

\b
Examples:
  hpc-elastic submit --nodes 4 --nproc-per-node 8 train.py
  hpc-elastic submit --nodes 2:8 --partition gpu --time 1-00 --gpus-per-node 8 \\
      --setup 'module load cuda' --setup 'source .venv/bin/activate' \\
      train.py -- --lr 3e-4 --epochs 10
  hpc-elastic submit --nodes 1:4 --dry-run train.py     # print the script only
"""

RENDER_HELP = """Print the sbatch script that submit would send; calls nothing on Slurm.

Same options as submit. Example: hpc-elastic render --nodes 1:4 train.py > job.sh
"""


TYPED = frozenset({click.ParameterSource.COMMANDLINE, click.ParameterSource.ENVIRONMENT})
"""Where a value counts as the user's own: it beats the config file."""


def typed_in(ctx: click.Context) -> Callable[[str], bool]:
    """Whether the user gave option ``name`` on this command line (not click's default)."""
    return lambda name: ctx.get_parameter_source(name) in TYPED


@with_options(SUBMIT_OPTIONS)
@click.command("submit", help=SUBMIT_HELP)
@click.argument(
    "script", type=Parsed(parse_script), help="The training script, run with python -u."
)
@click.argument("script_args", nargs=-1, help="Arguments for SCRIPT, after '--'.")
@click.option("--dry-run", is_flag=True, help="Print the script; submit nothing.")
@click.pass_context
def submit_command(
    ctx: click.Context,
    /,
    script: Path,
    script_args: tuple[str, ...],
    *,
    dry_run: bool,
    **values: Any,
) -> None:
    """The options are the table's (``hpc_elastic.options``); ``values`` holds them by name."""
    argv = cast(Invocation, ctx.find_root().obj).argv
    job, zk = api.plan_given(
        script, script_args, values, typed_in(ctx), command_line=("hpc-elastic", *argv)
    )
    warn_of_secrets(argv, f"hpc-elastic {ctx.info_name}")
    if dry_run or ctx.info_name == "render":
        click.echo(job.shown(), nl=False, color=True)  # the exact scripts, escapes and all
        return
    require_alive(zk.address)
    _submit(job)
    click.echo(zk.line())


render_command = click.Command(
    "render",
    callback=submit_command.callback,
    params=list(submit_command.params),
    help=RENDER_HELP,
)
"""``submit`` under another name and help: it prints the script (``ctx.info_name``)."""


VALUE_FLAGS = tuple(option.cli_flag for option in SUBMIT_OPTIONS if option.type is not bool)
"""The flags that take a value, so that the word after one is known to be its value."""


def warn_of_secrets(argv: Sequence[str], command: str) -> None:
    """One ``warning:`` line for each value on the command line that looks like a token:
    ``ps`` shows the command line to every user (``hpc_elastic.sensitive``). After the plan,
    so that a command with a bad flag still says one ``error:`` line and nothing else."""
    for finding in sensitive.command_line_findings(argv, VALUE_FLAGS):
        click.echo(f"warning: {sensitive.warning(finding, command)}", err=True)


def _submit(job: Plan) -> None:
    """The Python API submits (``hpc_elastic.api.send``); this prints what it did."""
    submitted = api.send(job)
    nodes = job.spec.nodes
    shape = f"elastic {nodes} nodes" if nodes.is_elastic else f"{nodes} nodes"
    if job.spec.spares:
        shape += f" and {job.spec.spares} hot spare{'s' if job.spec.spares > 1 else ''}"
    click.echo(f"Submitted batch job {submitted.job_id} (run {job.context.run_id}, {shape}).")
    grow = submitted.record.grow_job_id
    if grow is not None:
        click.echo(f"Growth slots: {describe_growth(job)}, as Slurm job {grow}.")
    click.echo(f"Job directory: {job.job_dir}")
    logs = job.paths.slurm_output(str(submitted.job_id), elastic=job.spec.is_array)
    click.echo(f"Logs: {logs}")
    if grow is not None:
        click.echo(f"      {job.paths.slurm_output(grow, elastic=True)}")
    click.echo(f"Code: {describe_snapshot(submitted.record.snapshot)}")
    if job.code is not None and job.code.left_out:
        click.echo(f"Left out of the snapshot as secrets: {describe_left_out(job.code.left_out)}")


def describe_growth(job: Plan) -> str:
    """Which slots grow the job, and where: ``slots 2-3 with QoS scavenger``."""
    spec = job.spec
    part = spec.array_parts()[-1]
    where = [f"partition {spec.grow_partition}"] if spec.grow_partition else []
    where += [f"QoS {spec.grow_qos}"] if spec.grow_qos else []
    where += [f"--time-min {spec.grow_time_min} for backfill"] if spec.grow_time_min else []
    return f"slots {part.range} with {' and '.join(where)}"


def describe_snapshot(code: CodeSnapshot | None) -> str:
    """One line on what the job will run, from ``job.json``: the commit (short, as ``status``
    shows it), whether uncommitted changes came along, and the copy's size. Said at submit,
    because a dirty tree is worth knowing about before the job runs for days, not after."""
    if code is None:
        return "not snapshotted (--no-snapshot): each slot runs the script as it is on disk"
    size = f"{_count(code.files, 'file')}, {code.bytes / MB:.1f} MB"
    if not code.git:
        return f"snapshot of {code.source} ({code.version()}), {size}"
    return f"snapshot of {code.version()}, {size}"


def describe_left_out(left_out: tuple[str, ...]) -> str:
    """The first few paths the snapshot left out as secrets, and how many more."""
    shown = ", ".join(left_out[:SHOWN_LEFT_OUT])
    more = len(left_out) - SHOWN_LEFT_OUT
    return f"{shown} and {more} more" if more > 0 else shown


SHOWN_LEFT_OUT = 5
"""Paths named on submit's "Left out" line; the debug log has them all."""


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
