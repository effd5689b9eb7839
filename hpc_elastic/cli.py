"""The ``hpc-elastic`` application: the command group, errors as one line, lazy loading.

The commands themselves live in ``hpc_elastic.commands``, one module each. Every error, ours or
Typer's, leaves as one ``error: <sentence>`` line on stderr with exit code 2 (usage) or 1
(runtime); no traceback reaches the user. Importing this module must stay cheap: no torch,
kazoo or jinja2 here, so ``--help`` answers at once and the agent starts fast.

Commands that rendering and submitting do not need (the agent, local mode, ops, doctor) are
listed in ``LAZY_COMMANDS`` and imported only when they run or ``--help`` lists them.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from hpc_elastic._click_compat import (
    ClickException,
    Command,
    Context,
    NoArgsIsHelpError,
)
from hpc_elastic._version import __version__
from hpc_elastic.commands import submit as submit_command
from hpc_elastic.commands.submit import Invocation
from hpc_elastic.contract import DEBUG_ENV
from hpc_elastic.errors import HpcElasticError, one_line
from hpc_elastic.logs import configure_from_env

LAZY_COMMANDS: dict[str, tuple[str, str, dict[str, str]]] = {
    "agent": ("hpc_elastic.agent.command", "agent", {"context_settings": "CONTEXT"}),
    "run": ("hpc_elastic.commands.run", "run_command", {"help": "RUN_HELP"}),
    "status": ("hpc_elastic.commands.status", "status_command", {}),
    "list": ("hpc_elastic.commands.list_jobs", "list_command", {}),
    "logs": ("hpc_elastic.commands.logs", "logs_command", {}),
    "events": ("hpc_elastic.commands.events", "events_command", {}),
    "cancel": ("hpc_elastic.commands.cancel", "cancel_command", {}),
    "doctor": ("hpc_elastic.commands.doctor", "doctor_command", {}),
    "nodes": ("hpc_elastic.commands.nodes", "nodes_command", {}),
    "watch": ("hpc_elastic.commands.watch", "watch_command", {}),
    "drill": ("hpc_elastic.commands.drill", "drill_command", {}),
    "zk": ("hpc_elastic.commands.zk", "zk_app", {}),
}
"""Command name -> (module, function, settings of ``app.command`` read from that module); a
``typer.Typer`` in place of the function is a group of subcommands (``zk start``, ...)."""


def _load_command(name: str) -> Command:
    module_name, function, settings = LAZY_COMMANDS[name]
    module = importlib.import_module(module_name)
    target = getattr(module, function)
    if isinstance(target, typer.Typer):
        group = typer.main.get_group(target)
        group.name = name
        return group
    single = typer.Typer(add_completion=False, rich_markup_mode=None)
    options = {key: getattr(module, attribute) for key, attribute in settings.items()}
    single.command(name, **options)(getattr(module, function))
    return typer.main.get_command(single)


class _App(TyperGroup):
    """Turns every error into one line and an exit code, under CliRunner as in real life;
    loads the ``LAZY_COMMANDS`` on first use."""

    def list_commands(self, ctx: Context) -> list[str]:
        loaded = super().list_commands(ctx)
        return [*loaded, *(name for name in LAZY_COMMANDS if name not in loaded)]

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            self.add_command(_load_command(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> NoReturn:
        argv = tuple(sys.argv[1:] if args is None else args)
        extra.setdefault("obj", Invocation(argv))
        try:
            result = super().main(
                argv, prog_name or "hpc-elastic", complete_var, standalone_mode=False, **extra
            )
        except HpcElasticError as err:
            _fail(str(err), err.exit_code)
        except NoArgsIsHelpError as err:
            typer.echo(err.format_message())
            sys.exit(0)
        except ClickException as err:
            _fail(_click_sentence(err), err.exit_code)
        except typer.Abort:
            _fail("Aborted.", 1)
        except Exception as err:
            if os.environ.get(DEBUG_ENV):
                raise
            _fail(
                f"Internal error ({type(err).__name__}: {err}); rerun with {DEBUG_ENV}=1 "
                "to see the traceback, and please report it.",
                1,
            )
        sys.exit(result if isinstance(result, int) else 0)


def _fail(sentence: str, exit_code: int) -> NoReturn:
    """One line whatever the sentence quotes: a newline in a bad value is shown as ``\\n``."""
    typer.echo(f"error: {one_line(sentence)}", err=True)
    sys.exit(exit_code)


def _click_sentence(err: ClickException) -> str:
    message = err.format_message()
    context = getattr(err, "ctx", None)
    if context is None:
        return message
    if message.endswith((".", "?")):
        return f"{message} See '{context.command_path} --help'."
    return f"{message}; see '{context.command_path} --help'."


ROOT_HELP = """Keep multi-node PyTorch training alive on Slurm while nodes come and go.

\b
Examples:
  hpc-elastic submit --nodes 2:8 --nproc-per-node 8 --partition gpu train.py -- --lr 3e-4
  hpc-elastic render --nodes 4 train.py        # print the sbatch script, submit nothing
  hpc-elastic submit --help                    # every option, with defaults

Defaults can live in hpc-elastic.toml or [tool.hpc-elastic] in pyproject.toml.
"""

app = typer.Typer(
    cls=_App,
    name="hpc-elastic",
    help=ROOT_HELP,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"hpc-elastic {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_show_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """Only carries --version; the help text is ROOT_HELP."""


# ``submit`` and ``render`` are one command under two names (render prints, submits nothing).
app.command("submit", help=submit_command.SUBMIT_HELP)(submit_command.submit_command)
app.command("render", help=submit_command.RENDER_HELP)(submit_command.submit_command)


def main() -> None:
    """Console-script entry point (``hpc-elastic``) and ``python -m hpc_elastic``."""
    configure_from_env()  # HPC_ELASTIC_LOG: before any command, the agent's included
    app()
