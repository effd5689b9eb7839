"""The ``hpc-elastic`` application: the command group, errors as one line, lazy loading.

The commands themselves live in ``hpc_elastic.commands``, one module each. Every error, ours or
Typer's, leaves as one ``error: <sentence>`` line on stderr with exit code 2 (usage) or 1
(runtime); no traceback reaches the user. Importing this module must stay cheap: no torch,
kazoo or jinja2 here, so ``--help`` answers at once and the agent starts fast.

Every command is listed in ``LAZY_COMMANDS`` and its module is imported only when it runs (or
its own ``--help`` is asked for): ``--help`` lists the commands by the summaries kept in that
table, so ``--help`` and ``--version`` import no command module, and a command imports only its
own. ``tests/cli/test_cli.py`` pins what they import.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperCommand, TyperGroup

from hpc_elastic._click_compat import (
    ClickException,
    Command,
    Context,
    HelpFormatter,
    NoArgsIsHelpError,
)
from hpc_elastic._version import __version__
from hpc_elastic.commands import Invocation
from hpc_elastic.contract import DEBUG_ENV
from hpc_elastic.errors import HpcElasticError, one_line
from hpc_elastic.logs import configure_from_env


@dataclass(frozen=True)
class Lazy:
    """Where a command lives, and what the root ``--help`` lists it with."""

    module: str
    function: str
    """The command's function, or a ``typer.Typer`` for a group of subcommands (``zk start``)."""
    summary: str
    """The first sentence of the command's help, all the root ``--help`` shows of it, so that
    listing imports nothing; ``tests/cli/test_cli.py`` checks it against the loaded command."""
    settings: Mapping[str, str] = field(default_factory=dict)
    """Settings of ``app.command``, each read from the module's attribute of that name."""


LAZY_COMMANDS: dict[str, Lazy] = {
    "submit": Lazy(
        "hpc_elastic.commands.submit",
        "submit_command",
        "Render the sbatch script for SCRIPT and submit it with sbatch.",
        {"help": "SUBMIT_HELP"},
    ),
    # ``submit`` and ``render`` are one command under two names (render prints, submits nothing).
    "render": Lazy(
        "hpc_elastic.commands.submit",
        "submit_command",
        "Print the sbatch script that submit would send; calls nothing on Slurm.",
        {"help": "RENDER_HELP"},
    ),
    "agent": Lazy(
        "hpc_elastic.agent.command",
        "agent",
        "Run this node's workers in the job's rendezvous; restart them as nodes come and go.",
        {"context_settings": "CONTEXT"},
    ),
    "run": Lazy(
        "hpc_elastic.commands.run",
        "run_command",
        "Run SCRIPT elastically on this machine: MAX local agents, no Slurm, no ZooKeeper.",
        {"help": "RUN_HELP"},
    ),
    "status": Lazy(
        "hpc_elastic.commands.status",
        "status_command",
        "Show what a job is doing: slots, round, world size, restarts, checkpoint, last failure.",
    ),
    "list": Lazy(
        "hpc_elastic.commands.list_jobs",
        "list_command",
        "List your hpc-elastic jobs, one line each, oldest first: every job you submitted or "
        "ran, whatever its log directory, or with --log-dir only the jobs under that directory.",
    ),
    "logs": Lazy(
        "hpc_elastic.commands.logs",
        "logs_command",
        "Print per-rank logs across restarts and requeues, one attempt after the other.",
    ),
    "events": Lazy(
        "hpc_elastic.commands.events",
        "events_command",
        "Print the job's single timeline across requeues; --plot draws it.",
    ),
    "cancel": Lazy(
        "hpc_elastic.commands.cancel",
        "cancel_command",
        "End every slot of a job (running and pending), close its rendezvous; checkpoints stay.",
    ),
    "doctor": Lazy(
        "hpc_elastic.commands.doctor",
        "doctor_command",
        "Check a cluster before the first submit: one line per check, pass, warn or fail.",
    ),
    "nodes": Lazy(
        "hpc_elastic.commands.nodes",
        "nodes_command",
        "List the nodes your jobs keep away from since their health check failed, or clear them.",
    ),
    "watch": Lazy(
        "hpc_elastic.commands.watch",
        "watch_command",
        "Check every job of yours from outside: alert once when no slot runs for a while, when "
        "a job's heartbeat stops, or when its goodput is low, and once more when it recovers.",
    ),
    "drill": Lazy(
        "hpc_elastic.commands.drill",
        "drill_command",
        "Act a preemption (or a requeue, or a node's death) on a random running slot of JOB, "
        "wait until it trains at full size again, and report the time that took, the steps "
        "redone, the grace margin and whether the step log is clean.",
    ),
    "zk": Lazy(
        "hpc_elastic.commands.zk",
        "zk_app",
        "Your own ZooKeeper ensemble for the rendezvous: start it as a Slurm job (or serve it in "
        "the foreground), see it, stop it.",
    ),
}
"""Command name -> where it lives, in the order ``--help`` lists them."""


def _load_command(name: str) -> Command:
    lazy = LAZY_COMMANDS[name]
    module = importlib.import_module(lazy.module)
    target = getattr(module, lazy.function)
    if isinstance(target, typer.Typer):
        group = typer.main.get_group(target)
        group.name = name
        return group
    single = typer.Typer(add_completion=False, rich_markup_mode=None)
    options = {key: getattr(module, attribute) for key, attribute in lazy.settings.items()}
    single.command(name, **options)(target)
    return typer.main.get_command(single)


class _App(TyperGroup):
    """Turns every error into one line and an exit code, under CliRunner as in real life;
    loads the ``LAZY_COMMANDS`` on first use."""

    def list_commands(self, ctx: Context) -> list[str]:
        others = super().list_commands(ctx)
        return [*LAZY_COMMANDS, *(name for name in others if name not in LAZY_COMMANDS)]

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            self.add_command(_load_command(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: Context, formatter: HelpFormatter) -> None:
        """Typer's listing, but a command not loaded yet stands in as a bare command whose help
        is its summary: click shortens both alike (to the first sentence, or fewer words and
        "..."), so the listing is the same and loads nothing."""
        listed = [(name, self._listed(name)) for name in self.list_commands(ctx)]
        shown = [(name, command) for name, command in listed if not command.hidden]
        if not shown:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in shown)
        rows = [(name, command.get_short_help_str(limit)) for name, command in shown]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def _listed(self, name: str) -> Command:
        """The command when it is loaded, else its stand-in (``list_commands`` names only
        these two kinds)."""
        loaded = self.commands.get(name)
        if loaded is not None:
            return loaded
        return TyperCommand(name, help=LAZY_COMMANDS[name].summary)

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


def main() -> None:
    """Console-script entry point (``hpc-elastic``) and ``python -m hpc_elastic``."""
    configure_from_env()  # HPC_ELASTIC_LOG: before any command, the agent's included
    app()
