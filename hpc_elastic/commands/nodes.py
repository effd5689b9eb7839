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
import os
import time
from pathlib import Path
from typing import Annotated

import typer

from hpc_elastic.agent import badnodes
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


def nodes_command(
    action: Annotated[
        Action,
        typer.Argument(help="'list' the remembered bad nodes, or 'clear' them (all, or NODEs)."),
    ] = Action.LIST,
    hosts: Annotated[
        list[str] | None,
        typer.Argument(metavar="NODE", help="With 'clear': only these nodes."),
    ] = None,
    zk: Annotated[
        str | None,
        typer.Option(
            parser=parse_zk,
            metavar="HOST:PORT[,...]",
            envvar=ZK_ENV,
            help="The ZooKeeper your jobs use. Default: the config file's, else the ensemble "
            f"you started (hpc-elastic zk start), else {DEFAULT_ZK}.",
        ),
    ] = None,
    user_secret_file: Annotated[
        Path,
        typer.Option(
            envvar=USER_SECRET_FILE_ENV,
            metavar="FILE",
            help="The secret your agents guard the list with (they create it).",
        ),
    ] = DEFAULT_USER_SECRET_FILE,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON list (or what was cleared) instead.")
    ] = False,
) -> None:
    """List the nodes your jobs keep away from since their health check failed, or clear them.

    \b
    Examples:
      hpc-elastic nodes                   # node, since, until, reason
      hpc-elastic nodes --json
      hpc-elastic nodes clear node017     # node017 is repaired
      hpc-elastic nodes clear             # forget them all
    """
    if hosts and action is Action.LIST:
        raise UsageError(
            f"'hpc-elastic nodes' lists every bad node, so '{hosts[0]}' is not needed; to "
            f"forget nodes, run 'hpc-elastic nodes clear {' '.join(hosts)}'."
        )
    config = load_config(Path.cwd())
    typed = None if zk == os.environ.get(ZK_ENV) else zk  # Typer fills --zk from the variable
    choice = choose_zk(typed, config.values, config.path)
    with badnodes.open_book(choice.address, user_secret_file) as book:
        if action is Action.LIST:
            _show(badnodes.listing(book, time.time()), as_json=as_json)
        else:
            _report(badnodes.clear(book, hosts or ()), as_json=as_json)
    # On standard error, after the answer: --json stays parseable, and a failure says one
    # sentence (which names the address) instead of this line and then the error.
    typer.echo(choice.line(), err=True)


def _show(records: list[BadNode], *, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(badnodes.as_json(records), indent=2))
        return
    for line in badnodes.table(records, time.time()):
        typer.echo(line)


def _report(cleared: badnodes.Cleared, *, as_json: bool) -> None:
    if as_json:
        typer.echo(
            json.dumps({"cleared": list(cleared.forgotten), "unknown": list(cleared.unknown)})
        )
        return
    if cleared.forgotten:
        typer.echo(f"Cleared {', '.join(cleared.forgotten)}: your next jobs may run there again.")
    else:
        typer.echo("No bad nodes to clear.")
    if cleared.unknown:
        typer.echo(f"Not in your list: {', '.join(cleared.unknown)}.")
