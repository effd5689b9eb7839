"""``hpc_elastic/_click_compat.py`` reaches into typer's private ``typer._click``: these tests
fail loudly when a typer release moves those classes, instead of the CLI printing tracebacks."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import typer
from typer.core import TyperGroup
from typer.testing import CliRunner

from hpc_elastic import cli
from hpc_elastic._click_compat import ClickException, Command, Context, NoArgsIsHelpError

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_click_classes_are_the_ones_typer_itself_uses() -> None:
    assert issubclass(typer.BadParameter, ClickException)
    assert issubclass(NoArgsIsHelpError, ClickException)
    assert issubclass(typer.Context, Context)
    assert issubclass(TyperGroup, Command)


def test_the_installed_typer_is_below_the_version_cap_in_pyproject() -> None:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    [typer_spec] = [spec for spec in dependencies if spec.startswith("typer")]
    cap = re.search(r"<(\d+)\.(\d+)", typer_spec)
    assert cap is not None, f"'{typer_spec}' has no upper bound; keep one (see _click_compat)"
    installed = tuple(int(part) for part in version("typer").split(".")[:2])
    assert installed < (int(cap.group(1)), int(cap.group(2)))


def test_no_arguments_print_the_help_through_no_args_is_help_error() -> None:
    result = CliRunner().invoke(cli.app, [])
    assert result.exit_code == 0
    assert "Usage: hpc-elastic" in result.stdout


def test_a_click_usage_error_is_one_line_through_click_exception() -> None:
    result = CliRunner().invoke(cli.app, ["render", "--no-such-flag"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: No such option: --no-such-flag")
    assert result.stderr.count("\n") == 1
