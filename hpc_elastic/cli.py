"""The ``hpc-elastic`` application: the command group, errors as one line, lazy loading.

The commands themselves live in ``hpc_elastic.commands``, one module each. Every error, ours or
click's, leaves as one ``error: <sentence>`` line on stderr with exit code 2 (usage) or 1
(runtime); no traceback reaches the user. Ctrl-C ends a command with exit code 130 and no
error line. Importing this module must stay cheap: no torch,
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import click

from hpc_elastic._version import __version__
from hpc_elastic.clicktools import Group
from hpc_elastic.commands import Invocation
from hpc_elastic.contract import DEBUG_ENV
from hpc_elastic.errors import HpcElasticError, one_line
from hpc_elastic.logs import configure_from_env


@dataclass(frozen=True)
class Lazy:
    """Where a command lives, and what the root ``--help`` lists it with."""

    module: str
    attribute: str
    """The module's attribute that holds the command: a ``click.Command``, or a ``click.Group``
    of subcommands (``zk start``)."""
    summary: str
    """The first sentence of the command's help, all the root ``--help`` shows of it, so that
    listing imports nothing; ``tests/cli/test_cli.py`` checks it against the loaded command."""


LAZY_COMMANDS: dict[str, Lazy] = {
    "submit": Lazy(
        "hpc_elastic.commands.submit",
        "submit_command",
        "Render the sbatch script for SCRIPT and submit it with sbatch.",
    ),
    # ``submit`` and ``render`` share one callback and one set of options (render prints,
    # submits nothing).
    "render": Lazy(
        "hpc_elastic.commands.submit",
        "render_command",
        "Print the sbatch script that submit would send; calls nothing on Slurm.",
    ),
    "agent": Lazy(
        "hpc_elastic.agent.command",
        "agent",
        "Run this node's workers in the job's rendezvous; restart them as nodes come and go.",
    ),
    "run": Lazy(
        "hpc_elastic.commands.run",
        "run_command",
        "Run SCRIPT elastically on this machine: MAX local agents, no Slurm, no ZooKeeper.",
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


def _load_command(name: str) -> click.Command:
    lazy = LAZY_COMMANDS[name]
    command: click.Command = getattr(importlib.import_module(lazy.module), lazy.attribute)
    return command


class _App(Group):
    """Turns every error into one line and an exit code, under CliRunner as in real life;
    loads the ``LAZY_COMMANDS`` on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        others = super().list_commands(ctx)
        return [*LAZY_COMMANDS, *(name for name in others if name not in LAZY_COMMANDS)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            self.add_command(_load_command(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's listing, but a command not loaded yet stands in as a bare command whose help
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

    def _listed(self, name: str) -> click.Command:
        """The command when it is loaded, else its stand-in (``list_commands`` names only
        these two kinds)."""
        loaded = self.commands.get(name)
        if loaded is not None:
            return loaded
        return click.Command(name, help=LAZY_COMMANDS[name].summary)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> NoReturn:
        """click's ``main`` in its non-standalone mode, so that every error comes here: a
        command's result or ``ctx.exit(code)`` is the exit code."""
        argv = tuple(sys.argv[1:] if args is None else args)
        extra.setdefault("obj", Invocation(argv))
        try:
            result = super().main(
                argv,
                prog_name or "hpc-elastic",
                complete_var,
                standalone_mode=False,
                windows_expand_args=windows_expand_args,
                **extra,
            )
        except HpcElasticError as err:
            _fail(str(err), err.exit_code)
        except click.ClickException as err:
            _fail(_click_sentence(err), err.exit_code)
        except click.Abort as err:
            if isinstance(err.__cause__, KeyboardInterrupt):
                sys.exit(130)  # Ctrl-C: the shell's code for SIGINT, no error line
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
    click.echo(f"error: {one_line(sentence)}", err=True)
    sys.exit(exit_code)


def _click_sentence(err: click.ClickException) -> str:
    message = err.format_message()
    context = getattr(err, "ctx", None)
    if context is None:
        return message
    if message.endswith((".", "?", "?)")):  # "... (Did you mean one of: '--nodes'?)"
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


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        click.echo(f"hpc-elastic {__version__}")
        ctx.exit(0)


app = _App(
    "hpc-elastic",
    help=ROOT_HELP,
    no_args_is_help=True,
    # Every command's options say their defaults in --help, as the option table's do.
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
    params=[
        click.Option(
            ["--version"],
            is_flag=True,
            expose_value=False,
            is_eager=True,
            callback=_show_version,
            help="Print the version and exit.",
        )
    ],
)
"""The ``hpc-elastic`` group: ``--version``, ``-h``/``--help`` and the ``LAZY_COMMANDS``."""


def main() -> None:
    """Console-script entry point (``hpc-elastic``) and ``python -m hpc_elastic``."""
    configure_from_env()  # HPC_ELASTIC_LOG: before any command, the agent's included
    app()
