"""``hpc-elastic zk start|status|stop|serve``: the user's own ZooKeeper ensemble.

The click commands only; ``hpc_elastic.ensemble`` does the work and is imported when a
command runs, so ``hpc-elastic --help`` loads nothing of it. ``supervise``, ``server`` and
``clean`` are what the ensemble's Slurm job runs (hidden from ``--help``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import click

from hpc_elastic import contract
from hpc_elastic.clicktools import Group, Parsed, exit_with
from hpc_elastic.commands._job import Decorated, count_option, seconds_option
from hpc_elastic.errors import UsageError
from hpc_elastic.spec import (
    parse_mem,
    parse_sbatch_arg,
    parse_sbatch_value,
    parse_time,
)

zk_app = Group(
    "zk",
    help="Your own ZooKeeper ensemble for the rendezvous: start it as a Slurm job (or serve "
    "it in the foreground), see it, stop it. See docs/cluster-setup.md.",
    no_args_is_help=True,
)


def _servers(text: str) -> int:
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
    """``--ports`` stays text for click (a tuple would be two arguments); checked here."""
    _ports(text)
    return text


def _say(text: str) -> None:
    click.echo(text)


DEFAULT_PORTS = f"{contract.DEFAULT_ZK_PORTS[0]}:{contract.DEFAULT_ZK_PORTS[1]}"


def ports_option(help: str) -> Callable[[Decorated], Decorated]:
    """``--ports LOW:HIGH``, the range a server picks its ports from (``start`` and ``serve``)."""
    return click.option(
        "--ports", type=Parsed(_checked_ports), default=DEFAULT_PORTS, metavar="LOW:HIGH", help=help
    )


@zk_app.command("start")
@click.option(
    "--servers",
    type=Parsed(_servers),
    default=contract.DEFAULT_ZK_SERVERS,
    metavar="1|3|5",
    help="Servers, one per node: 3 survive losing one, 5 survive losing two.",
)
@click.option(
    "--partition",
    type=Parsed(lambda text: parse_sbatch_value("--partition", text)),
    metavar="NAME",
    help="A partition that never preempts (refused otherwise). Default: Slurm's.",
)
@click.option(
    "--time", type=Parsed(parse_time), metavar="TIME", help="Time limit; outlive your jobs."
)
@click.option(
    "--account",
    type=Parsed(lambda text: parse_sbatch_value("--account", text)),
    metavar="NAME",
    help="Slurm account to charge.",
)
@click.option(
    "--mem",
    type=Parsed(parse_mem),
    default=contract.DEFAULT_ZK_MEMORY,
    metavar="SIZE",
    help="Memory per server node.",
)
@click.option(
    "--data-dir",
    default="",
    metavar="DIR",
    help="Node-local directory for each server's data and transaction logs.",
    show_default="$TMPDIR, else /tmp",
)
@ports_option("Where servers pick their ports.")
@count_option(
    "--restarts",
    "Times a server whose step died starts again in place.",
    default=contract.DEFAULT_ZK_RESTARTS,
    zero_ok=True,
)
@count_option(
    "--spares",
    "Spare nodes held in the job, each ready to replace a server whose node is lost "
    f"(0..{contract.ZK_MAX_SPARES}; needs --servers 3 or 5).",
    default=contract.DEFAULT_ZK_SPARES,
    zero_ok=True,
)
@seconds_option(
    "--timeout",
    "Seconds the running job may take to serve.",
    default=contract.DEFAULT_ZK_START_TIMEOUT,
)
@click.option(
    "--allow-preemption",
    is_flag=True,
    help="Start even in a partition that may preempt the job.",
)
@click.option("--wait/--no-wait", default=True, help="Return once the ensemble serves.")
@click.option("--python", metavar="PATH", help="Python on the nodes.", show_default="this one")
@click.option(
    "--sbatch-arg",
    type=Parsed(parse_sbatch_arg),
    multiple=True,
    metavar="OPTION",
    help="Any other sbatch option, e.g. '--qos=service'. Repeatable.",
)
def start_command(
    *,
    servers: int,
    partition: str | None,
    time: str | None,
    account: str | None,
    mem: str,
    data_dir: str,
    ports: str,
    restarts: int,
    spares: int,
    timeout: float,
    allow_preemption: bool,
    wait: bool,
    python: str | None,
    sbatch_arg: tuple[str, ...],
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
        sbatch_args=sbatch_arg,
    )
    lifecycle.start(request, files.Layout.of(), _say)


@zk_app.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status_command(as_json: bool) -> None:
    """Show each server (node, address, leader/follower/down, clients, latency, its Slurm
    step), whether the ensemble is serving or degraded, and which of your jobs use it."""
    from hpc_elastic.ensemble import files, lifecycle  # noqa: PLC0415

    view = lifecycle.gather(files.find())
    if as_json:
        click.echo(json.dumps(view.to_json(), indent=2))
    else:
        for line in lifecycle.render(view):
            click.echo(line)
    for warning in view.warnings:
        click.echo(f"warning: {warning}", err=True)


@zk_app.command("stop")
@click.option("--force", is_flag=True, help="Stop it even while your jobs still use it.")
def stop_command(force: bool) -> None:
    """Stop your ensemble: every server, its Slurm job, its data and its records. Refused
    while a job of yours that Slurm still lists uses it, unless --force."""
    from hpc_elastic.ensemble import files, lifecycle  # noqa: PLC0415

    lifecycle.stop(files.find(), force, _say)


@zk_app.command("serve")
@count_option("--port", "Client port.", metavar="PORT", shown="a free one")
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    metavar="DIR",
    help="Data directory, kept across restarts (a service's).",
    show_default="a private one, removed at exit",
)
@ports_option("Where a free port is picked.")
@click.option(
    "--publish/--no-publish",
    default=True,
    help="Write your connect-string file, so that your commands use this server.",
)
def serve_command(*, port: int | None, data_dir: Path | None, ports: str, publish: bool) -> None:
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
    exit_with(server.serve(files.Layout.of(), request, _say))


run_dir_option = click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    required=True,
    metavar="DIR",
    help="The ensemble's run directory.",
)
"""``--run-dir DIR`` of the commands the ensemble's Slurm job runs, given as ``run_dir``."""


@zk_app.command("supervise", hidden=True)
@run_dir_option
def supervise_command(run_dir: Path) -> None:
    """The ensemble's Slurm job script: runs, restarts and replaces its servers."""
    from hpc_elastic.ensemble import files, supervisor  # noqa: PLC0415
    from hpc_elastic.logs import configure_from_env  # noqa: PLC0415

    configure_from_env()
    exit_with(supervisor.run(files.Layout(run_dir.parent)))


@zk_app.command("server", hidden=True)
@run_dir_option
@click.option("--myid", type=int, required=True, metavar="N", help="This server's id, 1..N.")
def server_command(run_dir: Path, myid: int) -> None:
    """One server of the ensemble's Slurm job (its script runs this in every step)."""
    from hpc_elastic.ensemble import files, server  # noqa: PLC0415
    from hpc_elastic.logs import configure_from_env  # noqa: PLC0415

    configure_from_env()
    exit_with(server.run_slurm_server(files.Layout(run_dir.parent), myid))


@zk_app.command("clean", hidden=True)
@run_dir_option
def clean_command(run_dir: Path) -> None:
    """The job's last step, on every node: remove what a killed server left."""
    from hpc_elastic.ensemble import files, server  # noqa: PLC0415

    exit_with(server.clean_node(files.Layout(run_dir.parent)))
