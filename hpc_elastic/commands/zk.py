"""``hpc-elastic zk start|status|stop|serve``: the user's own ZooKeeper ensemble.

The Typer signatures only; ``hpc_elastic.ensemble`` does the work and is imported when a
command runs, so ``hpc-elastic --help`` loads nothing of it. ``supervise``, ``server`` and
``clean`` are what the ensemble's Slurm job runs (hidden from ``--help``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from hpc_elastic import contract
from hpc_elastic.errors import UsageError
from hpc_elastic.spec import (
    count_parser,
    parse_mem,
    parse_sbatch_arg,
    parse_sbatch_value,
    parse_time,
    seconds_parser,
)

zk_app = typer.Typer(
    name="zk",
    help="Your own ZooKeeper ensemble for the rendezvous: start it as a Slurm job (or serve "
    "it in the foreground), see it, stop it. See docs/cluster-setup.md.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)


def _servers(text: str) -> int:
    text = str(text)  # Typer runs the default (an int) through the parser too
    if text.strip() not in {str(count) for count in contract.ZK_SERVER_COUNTS}:
        raise UsageError(
            f"--servers '{text}' is not one of {', '.join(map(str, contract.ZK_SERVER_COUNTS))}; "
            "give 3 to survive one lost server, 5 to survive two, or 1 for none."
        )
    return int(text)


def _ports(text: str) -> tuple[int, int]:
    from hpc_elastic.ensemble.zoocfg import parse_ports  # noqa: PLC0415

    return parse_ports(text)


def _checked_ports(text: str) -> str:
    """``--ports`` stays text for Typer (a tuple would be two arguments); checked here."""
    _ports(text)
    return text


def _say(text: str) -> None:
    typer.echo(text)


DEFAULT_PORTS = f"{contract.DEFAULT_ZK_PORTS[0]}:{contract.DEFAULT_ZK_PORTS[1]}"


@zk_app.command("start")
def start_command(
    *,
    servers: Annotated[
        int,
        typer.Option(
            parser=_servers,
            metavar="1|3|5",
            help="Servers, one per node: 3 survive losing one, 5 survive losing two.",
        ),
    ] = contract.DEFAULT_ZK_SERVERS,
    partition: Annotated[
        str | None,
        typer.Option(
            parser=lambda text: parse_sbatch_value("--partition", text),
            metavar="NAME",
            help="A partition that never preempts (refused otherwise). Default: Slurm's.",
        ),
    ] = None,
    time: Annotated[
        str | None,
        typer.Option(parser=parse_time, metavar="TIME", help="Time limit; outlive your jobs."),
    ] = None,
    account: Annotated[
        str | None,
        typer.Option(
            parser=lambda text: parse_sbatch_value("--account", text),
            metavar="NAME",
            help="Slurm account to charge.",
        ),
    ] = None,
    mem: Annotated[
        str, typer.Option(parser=parse_mem, metavar="SIZE", help="Memory per server node.")
    ] = contract.DEFAULT_ZK_MEMORY,
    data_dir: Annotated[
        str,
        typer.Option(
            metavar="DIR",
            help="Node-local directory for each server's data and transaction logs.",
            show_default="$TMPDIR, else /tmp",
        ),
    ] = "",
    ports: Annotated[
        str,
        typer.Option(
            parser=_checked_ports, metavar="LOW:HIGH", help="Where servers pick their ports."
        ),
    ] = DEFAULT_PORTS,
    restarts: Annotated[
        int,
        typer.Option(
            parser=count_parser("--restarts", zero_ok=True),
            metavar="N",
            help="Times a server whose step died starts again in place.",
        ),
    ] = contract.DEFAULT_ZK_RESTARTS,
    spares: Annotated[
        int,
        typer.Option(
            parser=count_parser("--spares", zero_ok=True),
            metavar="N",
            help="Spare nodes held in the job, each ready to replace a server whose node is "
            f"lost (0..{contract.ZK_MAX_SPARES}; needs --servers 3 or 5).",
        ),
    ] = contract.DEFAULT_ZK_SPARES,
    timeout: Annotated[
        float,
        typer.Option(
            parser=seconds_parser("--timeout"),
            metavar="S",
            help="Seconds the running job may take to serve.",
        ),
    ] = contract.DEFAULT_ZK_START_TIMEOUT,
    allow_preemption: Annotated[
        bool,
        typer.Option(
            "--allow-preemption", help="Start even in a partition that may preempt the job."
        ),
    ] = False,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Return once the ensemble serves.")
    ] = True,
    python: Annotated[
        str | None,
        typer.Option(metavar="PATH", help="Python on the nodes.", show_default="this one"),
    ] = None,
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option(
            parser=parse_sbatch_arg,
            metavar="OPTION",
            help="Any other sbatch option, e.g. '--qos=service'. Repeatable.",
        ),
    ] = None,
) -> None:
    """Start a ZooKeeper ensemble as one Slurm job, one server per node, and wait until it
    serves; then submit, doctor, nodes and the Python API use it when no --zk is given.

    \b
    Examples:
      hpc-elastic zk start --servers 3 --spares 1 --partition service --time 7-00
      hpc-elastic zk start --servers 1 --no-wait
    """
    from hpc_elastic.ensemble import files, lifecycle  # noqa: PLC0415

    request = lifecycle.StartRequest(
        servers=servers,
        partition=partition,
        time=time,
        account=account,
        memory=mem,
        data_root=data_dir,
        ports=_ports(ports),
        restarts=restarts,
        spares=spares,
        timeout=timeout,
        allow_preemption=allow_preemption,
        wait=wait,
        python=python or sys.executable,
        sbatch_args=tuple(sbatch_arg or ()),
    )
    lifecycle.start(request, files.Layout.of(), _say)


@zk_app.command("status")
def status_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show each server (node, address, leader/follower/down, clients, latency, its Slurm
    step), whether the ensemble is serving or degraded, and which of your jobs use it."""
    from hpc_elastic.ensemble import files, lifecycle  # noqa: PLC0415

    view = lifecycle.gather(files.find())
    if as_json:
        typer.echo(json.dumps(view.to_json(), indent=2))
    else:
        for line in lifecycle.render(view):
            typer.echo(line)
    for warning in view.warnings:
        typer.echo(f"warning: {warning}", err=True)


@zk_app.command("stop")
def stop_command(
    force: Annotated[
        bool, typer.Option("--force", help="Stop it even while your jobs still use it.")
    ] = False,
) -> None:
    """Stop your ensemble: every server, its Slurm job, its data and its records. Refused
    while a job of yours that Slurm still lists uses it, unless --force."""
    from hpc_elastic.ensemble import files, lifecycle  # noqa: PLC0415

    lifecycle.stop(files.find(), force, _say)


@zk_app.command("serve")
def serve_command(
    *,
    port: Annotated[
        int | None,
        typer.Option(
            parser=count_parser("--port"),
            metavar="PORT",
            help="Client port.",
            show_default="a free one",
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Data directory, kept across restarts (a service's).",
            show_default="a private one, removed at exit",
        ),
    ] = None,
    ports: Annotated[
        str,
        typer.Option(
            parser=_checked_ports, metavar="LOW:HIGH", help="Where a free port is picked."
        ),
    ] = DEFAULT_PORTS,
    publish: Annotated[
        bool,
        typer.Option(
            "--publish/--no-publish",
            help="Write your connect-string file, so that your commands use this server.",
        ),
    ] = True,
) -> None:
    """Run one ZooKeeper server in the foreground, on a login or service node, until Ctrl-C
    or SIGTERM (a systemd unit: docs/cluster-setup.md).

    \b
    Example:
      hpc-elastic zk serve --port 2181 --data-dir /var/lib/hpc-elastic-zk --no-publish
    """
    from hpc_elastic.ensemble import files, install, server  # noqa: PLC0415

    found = install.find_installation()
    record = files.StartRecord(
        servers=1, java=found.java, classpath=found.classpath, ports=_ports(ports)
    )
    request = server.ServeRequest(record, port, data_dir, publish)
    raise typer.Exit(server.serve(files.Layout.of(), request, _say))


RunDir = Annotated[Path, typer.Option(metavar="DIR", help="The ensemble's run directory.")]


@zk_app.command("supervise", hidden=True)
def supervise_command(run_dir: RunDir) -> None:
    """The ensemble's Slurm job script: runs, restarts and replaces its servers."""
    from hpc_elastic.ensemble import files, supervisor  # noqa: PLC0415
    from hpc_elastic.logs import configure_from_env  # noqa: PLC0415

    configure_from_env()
    raise typer.Exit(supervisor.run(files.Layout(run_dir.parent)))


@zk_app.command("server", hidden=True)
def server_command(
    run_dir: RunDir,
    myid: Annotated[int, typer.Option(metavar="N", help="This server's id, 1..N.")],
) -> None:
    """One server of the ensemble's Slurm job (its script runs this in every step)."""
    from hpc_elastic.ensemble import files, server  # noqa: PLC0415
    from hpc_elastic.logs import configure_from_env  # noqa: PLC0415

    configure_from_env()
    raise typer.Exit(server.run_slurm_server(files.Layout(run_dir.parent), myid))


@zk_app.command("clean", hidden=True)
def clean_command(run_dir: RunDir) -> None:
    """The job's last step, on every node: remove what a killed server left."""
    from hpc_elastic.ensemble import files, server  # noqa: PLC0415

    raise typer.Exit(server.clean_node(files.Layout(run_dir.parent)))
