"""``hpc-elastic run``: the click command of local mode; ``hpc_elastic.local`` runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from hpc_elastic.clicktools import Parsed, exit_with
from hpc_elastic.local import OPTIONS as LOCAL_OPTIONS
from hpc_elastic.local import Churn, LocalRun, run_local
from hpc_elastic.logs import configure_from_env
from hpc_elastic.options import CHECKPOINT_OPTIONS, job_environment, resolve, with_options
from hpc_elastic.spec import parse_script, seconds_parser

RUN_HELP = """Run SCRIPT elastically on this machine: MAX local agents, no Slurm, no ZooKeeper.

\b
Examples:
  hpc-elastic run --nodes 1:3 --simulate-churn examples/train.py -- --sleep-per-step 0.1
  hpc-elastic run --nodes 2 --nproc-per-node 2 --tee train.py -- --lr 3e-4
"""


RUN_OPTIONS = (*LOCAL_OPTIONS, *CHECKPOINT_OPTIONS)
"""``run``'s options read from fields: ``LocalRun``'s, then the checkpoint settings it shares
with ``submit``. ``run`` reads no config file, so the defaults apply."""


@with_options(RUN_OPTIONS)
@click.command("run", help=RUN_HELP)
@click.argument(
    "script", type=click.Path(path_type=Path), help="The training script, run with python -u."
)
@click.argument("script_args", nargs=-1, help="Arguments for SCRIPT, after '--'.")
@click.option(
    "--simulate-churn/--no-simulate-churn",
    default=False,
    help="Kill a random node now and then and start it again later.",
)
@click.option(
    "--churn-every",
    default="20:40",
    metavar="MIN:MAX",
    help="Seconds between two simulated node losses.",
)
@click.option(
    "--churn-downtime",
    type=Parsed(seconds_parser("--churn-downtime")),
    default=10.0,
    metavar="S",
    help="Seconds a killed node stays away.",
)
@click.option("--seed", type=int, default=0, metavar="N", help="Seed of the churn schedule.")
@click.option(
    "--metrics-port",
    type=int,
    metavar="PORT",
    help="Serve metrics: node i on PORT+i (0: any free port).",
)
@click.option("--tee/--no-tee", default=False, help="Show the agents' and workers' output.")
def run_command(
    script: Path,
    script_args: tuple[str, ...],
    *,
    simulate_churn: bool,
    churn_every: str,
    churn_downtime: float,
    seed: int,
    metrics_port: int | None,
    tee: bool,
    **values: Any,
) -> None:
    """The shared options are the table's (``RUN_OPTIONS``); ``values`` holds them by name."""
    configure_from_env()  # HPC_ELASTIC_LOG; the agents read it again from the environment
    path = parse_script(str(script))
    settings = resolve(RUN_OPTIONS, values, lambda _name: True, {})
    run = LocalRun.from_values(
        path,
        settings,
        script_args=script_args,
        churn=Churn(Churn.parse(churn_every), churn_downtime) if simulate_churn else None,
        seed=seed,
        tee=tee,
        metrics_port=metrics_port,
        environment=tuple(job_environment(settings, CHECKPOINT_OPTIONS)),
    )
    exit_with(run_local(run, lambda text: click.echo(text, err=True)))
