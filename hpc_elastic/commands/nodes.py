"""``hpc-elastic nodes [list|clear [NODE...]]``: the bad nodes your jobs keep away from.

A node whose preflight failed is remembered per user for a day (``agent/badnodes.py``), in
ZooKeeper under ``/hpc-elastic/@users/<user>``, guarded by the user's own secret. This command
lists that memory and clears it, all of it or some nodes, once a node is repaired. It reaches
ZooKeeper only through ``badnodes.open_book``, so every failure is one sentence with the fix.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from pathlib import Path

import click

from hpc_elastic.agent import badnodes
from hpc_elastic.clicktools import Parsed
from hpc_elastic.config import load_config
from hpc_elastic.contract import DEFAULT_USER_SECRET_FILE, DEFAULT_ZK, USER_SECRET_FILE_ENV, ZK_ENV
from hpc_elastic.ensemble.choice import choose_zk
from hpc_elastic.errors import UsageError
from hpc_elastic.rendezvous.badnode import BadNode
from hpc_elastic.spec import parse_zk

logger = logging.getLogger(__name__)


class Action(enum.Enum):
    LIST = "list"
    CLEAR = "clear"


@click.command("nodes")
@click.argument(
    "action",
    type=click.Choice([action.value for action in Action]),
    default=Action.LIST.value,
    help="'list' the remembered bad nodes (the default), or 'clear' them (all, or NODEs).",
)
@click.argument("node", nargs=-1, help="With 'clear': only these nodes.")
@click.option(
    "--zk",
    type=Parsed(parse_zk),
    metavar="HOST:PORT[,...]",
    envvar=ZK_ENV,
    show_envvar=True,
    help="The ZooKeeper your jobs use. Default: the config file's, else the ensemble you "
    f"started (hpc-elastic zk start), else {DEFAULT_ZK}.",
)
@click.option(
    "--user-secret-file",
    type=click.Path(path_type=Path),
    default=DEFAULT_USER_SECRET_FILE,
    envvar=USER_SECRET_FILE_ENV,
    show_envvar=True,
    metavar="FILE",
    help="The secret your agents guard the list with (they create it).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON list (or what was cleared) instead."
)
@click.pass_context
def nodes_command(
    ctx: click.Context,
    action: str,
    node: tuple[str, ...],
    *,
    zk: str | None,
    user_secret_file: Path,
    as_json: bool,
) -> None:
    """List the nodes your jobs keep away from since their health check failed, or clear them.

    \b
    Examples:
      hpc-elastic nodes                   # node, since, until, reason
      hpc-elastic nodes --json
      hpc-elastic nodes clear node017     # node017 is repaired
      hpc-elastic nodes clear             # forget them all
    """
    hosts, chosen = list(node), Action(action)
    if hosts and chosen is Action.LIST:
        raise UsageError(
            f"'hpc-elastic nodes' lists every bad node, so '{hosts[0]}' is not needed; to "
            f"forget nodes, run 'hpc-elastic nodes clear {' '.join(hosts)}'."
        )
    config = load_config(Path.cwd())
    # click fills --zk from $HPC_ELASTIC_ZK too; only a typed --zk is the flag's (the
    # variable is the config's, and choose_zk names it as such).
    typed = zk if ctx.get_parameter_source("zk") is click.ParameterSource.COMMANDLINE else None
    choice = choose_zk(typed, config.values, config.path)
    with badnodes.open_book(choice.address, user_secret_file) as book:
        if chosen is Action.LIST:
            _show(badnodes.listing(book, time.time()), as_json=as_json)
        else:
            _report(badnodes.clear(book, hosts or ()), as_json=as_json)
    # On standard error, after the answer: --json stays parseable, and a failure says one
    # sentence (which names the address) instead of this line and then the error.
    click.echo(choice.line(), err=True)


def _show(records: list[BadNode], *, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(badnodes.as_json(records), indent=2))
        return
    for line in badnodes.table(records, time.time()):
        click.echo(line)


def _report(cleared: badnodes.Cleared, *, as_json: bool) -> None:
    if as_json:
        click.echo(
            json.dumps({"cleared": list(cleared.forgotten), "unknown": list(cleared.unknown)})
        )
        return
    if cleared.forgotten:
        click.echo(f"Cleared {', '.join(cleared.forgotten)}: your next jobs may run there again.")
    else:
        click.echo("No bad nodes to clear.")
    if cleared.unknown:
        click.echo(f"Not in your list: {', '.join(cleared.unknown)}.")
