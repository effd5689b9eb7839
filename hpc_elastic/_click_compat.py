"""The few click classes ``cli.py`` needs, taken from the copy of click that typer vendors.

typer ships its own click as the private package ``typer._click`` and re-exports only part of
it (``typer.Context``, ``typer.BadParameter``, ``typer.echo``). ``cli.py`` must also catch
click's ``ClickException`` and ``NoArgsIsHelpError`` (to print every error as one line), and
its lazy command group overrides ``TyperGroup`` methods whose signatures use click's
``Context``, ``Command`` and ``HelpFormatter`` (and lists a command not loaded yet as a bare
``Command``), and ``cli.typed_in`` asks a ``Context`` which options the user
typed (``ParameterSource``). typer has no public name for those, so this module is the one
place that reaches into ``typer._click``. pyproject.toml caps typer below its next minor
version, and ``tests/cli/test_click_compat.py`` fails loudly if typer moves or renames them.
"""

from __future__ import annotations

from typer._click import Command, Context, HelpFormatter
from typer._click.core import ParameterSource
from typer._click.exceptions import ClickException, NoArgsIsHelpError

__all__ = [
    "ClickException",
    "Command",
    "Context",
    "HelpFormatter",
    "NoArgsIsHelpError",
    "ParameterSource",
]
