"""What the commands share of click: a parameter type for our parsers, the group class, the exit.

The command line is click's public API only (``import click``). Importing this module imports
click, so only the command layer imports it: ``cli``, ``commands``, ``agent.command``, and
``options``' builders when they make a command's options (not when ``options`` is imported:
the Python API and the config file read the option table without click).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import click


class Parsed(click.ParamType[object, object]):
    """A flag's text through one of our parsers (``spec.parse_time``, ``NodeRange.parse``, ...).

    A bad value raises the parser's ``UsageError``, one sentence that quotes it, which ``cli``
    prints as it prints every error (click's own ``BadParameter`` would say "Invalid value
    for ..." instead). A value that is not text is a default already parsed (click runs a
    default through the type too): it is kept as it is.
    """

    name = "text"

    def __init__(self, parse: Callable[[str], object]) -> None:
        self.parse = parse

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> object:
        return self.parse(value) if isinstance(value, str) else value


class Group(click.Group):
    """A group whose ``--help`` lists its commands in the order they were added (click sorts
    them by name), and which answers a bare call (``hpc-elastic zk``) with its help on
    standard output and exit code 0.

    click itself raises an error for a bare call (exit 2, the help on standard error); its
    ``no_args_is_help`` is honoured here before click's ``parse_args`` would raise it."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(0)
        return super().parse_args(ctx, args)


def exit_with(code: int) -> NoReturn:
    """End the running command with exit code ``code`` (``cli`` exits with it)."""
    click.get_current_context().exit(code)
