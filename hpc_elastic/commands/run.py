"""``hpc-elastic run``: the Typer signature of local mode; ``hpc_elastic.local`` runs it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, cast

import typer

from hpc_elastic.local import Churn, LocalRun, run_local
from hpc_elastic.logs import configure_from_env
from hpc_elastic.options import CHECKPOINT_OPTIONS, job_environment, option, resolve, with_options
from hpc_elastic.spec import NodeRange, default_job_name, parse_script, seconds_parser

RUN_HELP = """Run SCRIPT elastically on this machine: MAX local agents, no Slurm, no ZooKeeper.

\b
Examples:
  hpc-elastic run --nodes 1:3 --simulate-churn examples/train.py -- --sleep-per-step 0.1
  hpc-elastic run --nodes 2 --nproc-per-node 2 --tee train.py -- --lr 3e-4
"""


RUN_OPTIONS = (
    replace(option("nodes"), help="Local nodes (agents): N, or MIN:MAX to train on while MIN run."),
    replace(option("nproc_per_node"), help="Workers per node."),
    option("max_restarts"),
    replace(option("job_name"), show_default="the script's name", help="The run's name."),
    replace(option("log_dir"), help="Where the run's directory is made."),
    replace(
        option("prewarm"),
        help="Keep standby workers with torch imported: faster rounds after churn.",
    ),
    replace(
        option("in_place"),
        help="Keep surviving workers through churn and hand them the new round; for loops "
        "that use hpc_elastic.train.InPlace.",
    ),
    *CHECKPOINT_OPTIONS,
)
"""The rows ``run`` shares with ``submit``; ``run`` reads no config file, so the defaults apply."""


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
    run = LocalRun(
        script=path,
        script_args=tuple(script_args or ()),
        nodes=cast(NodeRange, settings["nodes"]),
        nproc_per_node=cast(int, settings["nproc_per_node"]),
        log_dir=cast(Path, settings["log_dir"]),
        job_name=cast("str | None", settings["job_name"]) or default_job_name(path),
        max_restarts=cast(int, settings["max_restarts"]),
        churn=Churn(Churn.parse(churn_every), churn_downtime) if simulate_churn else None,
        seed=seed,
        tee=tee,
        prewarm=cast(bool, settings["prewarm"]),
        in_place=cast(bool, settings["in_place"]),
        metrics_port=metrics_port,
        environment=tuple(job_environment(settings, CHECKPOINT_OPTIONS)),
    )
    raise typer.Exit(run_local(run, lambda text: typer.echo(text, err=True)))
