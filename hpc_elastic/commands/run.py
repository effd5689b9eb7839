"""``hpc-elastic run``: the Typer signature of local mode; ``hpc_elastic.local`` runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

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
def run_command(
    script: Annotated[
        Path,
        typer.Argument(metavar="SCRIPT", help="The training script, run with python -u."),
    ],
    script_args: Annotated[
        list[str] | None,
        typer.Argument(metavar="SCRIPT_ARGS", help="Arguments for SCRIPT, after '--'."),
    ] = None,
    *,
    simulate_churn: Annotated[
        bool,
        typer.Option(help="Kill a random node now and then and start it again later."),
    ] = False,
    churn_every: Annotated[
        str, typer.Option(metavar="MIN:MAX", help="Seconds between two simulated node losses.")
    ] = "20:40",
    churn_downtime: Annotated[
        float,
        typer.Option(
            parser=seconds_parser("--churn-downtime"),
            metavar="S",
            help="Seconds a killed node stays away.",
        ),
    ] = 10.0,
    seed: Annotated[int, typer.Option(help="Seed of the churn schedule.")] = 0,
    metrics_port: Annotated[
        int | None,
        typer.Option(metavar="PORT", help="Serve metrics: node i on PORT+i (0: any free port)."),
    ] = None,
    tee: Annotated[bool, typer.Option(help="Show the agents' and workers' output.")] = False,
    **values: Any,
) -> None:
    """The shared options are the table's (``RUN_OPTIONS``); ``values`` holds them by name."""
    configure_from_env()  # HPC_ELASTIC_LOG; the agents read it again from the environment
    path = parse_script(str(script))
    settings = resolve(RUN_OPTIONS, values, lambda _name: True, {})
    run = LocalRun.from_values(
        path,
        settings,
        script_args=tuple(script_args or ()),
        churn=Churn(Churn.parse(churn_every), churn_downtime) if simulate_churn else None,
        seed=seed,
        tee=tee,
        metrics_port=metrics_port,
        environment=tuple(job_environment(settings, CHECKPOINT_OPTIONS)),
    )
    raise typer.Exit(run_local(run, lambda text: typer.echo(text, err=True)))
