"""``hpc-elastic run``: the click command of local mode; ``hpc_elastic.local`` runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from hpc_elastic.clicktools import exit_with
from hpc_elastic.local import EXTRA_OPTIONS, LocalRun, run_local
from hpc_elastic.local import OPTIONS as LOCAL_OPTIONS
from hpc_elastic.logs import configure_from_env
from hpc_elastic.options import CHECKPOINT_OPTIONS, job_environment, resolve, with_options
from hpc_elastic.spec import parse_script

RUN_HELP = """Run SCRIPT elastically on this machine: MAX local agents, no Slurm, no ZooKeeper.

\b
Examples:
  hpc-elastic run --nodes 1:3 --simulate-churn examples/train.py -- --sleep-per-step 0.1
  hpc-elastic run --nodes 2 --nproc-per-node 2 --tee train.py -- --lr 3e-4
"""


RUN_OPTIONS = (*LOCAL_OPTIONS, *CHECKPOINT_OPTIONS, *EXTRA_OPTIONS)
"""``run``'s options, all read from fields: ``LocalRun``'s, the checkpoint settings it shares
with ``submit``, then its own (``local.RunExtras``). ``run`` reads no config file, so the
defaults apply."""


@with_options(RUN_OPTIONS)
@click.command("run", help=RUN_HELP)
@click.argument(
    "script", type=click.Path(path_type=Path), help="The training script, run with python -u."
)
@click.argument("script_args", nargs=-1, help="Arguments for SCRIPT, after '--'.")
def run_command(script: Path, script_args: tuple[str, ...], **values: Any) -> None:
    """The options are the table's (``RUN_OPTIONS``); ``values`` holds them by name."""
    configure_from_env()  # HPC_ELASTIC_LOG; the agents read it again from the environment
    settings = resolve(RUN_OPTIONS, values, lambda _name: True, {})
    run = LocalRun.from_values(
        parse_script(str(script)),
        settings,
        script_args=script_args,
        environment=tuple(job_environment(settings, CHECKPOINT_OPTIONS)),
    )
    exit_with(run_local(run, lambda text: click.echo(text, err=True)))
