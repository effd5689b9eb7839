"""The ``hpc-elastic`` command line: parse -> spec -> plan -> print or submit.

Kept thin on purpose: options become a JobSpec (config-file defaults filled in by
``hpc_elastic.config``), ``hpc_elastic.submit`` plans and submits it. Every error, ours or
Typer's, leaves as one ``error: <sentence>`` line on stderr with exit code 2 (usage) or 1
(runtime); no traceback reaches the user. Importing this module must stay cheap: no torch,
kazoo or jinja2 here, so ``--help`` answers at once and the agent starts fast.

Commands that rendering and submitting do not need (the agent, local mode, ops, doctor) are
listed in ``LAZY_COMMANDS`` and imported only when they run or ``--help`` lists them.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn, cast

import typer
from typer._click import Command, Context
from typer._click.exceptions import ClickException, NoArgsIsHelpError
from typer.core import TyperGroup

from hpc_elastic import __version__
from hpc_elastic.config import DEFAULT_ZK, load_config
from hpc_elastic.errors import HpcElasticError, UsageError, one_line
from hpc_elastic.slurm import commands
from hpc_elastic.spec import (
    JobSpec,
    NodeRange,
    PreemptSignal,
    count_parser,
    parse_env,
    parse_job_name,
    parse_mem,
    parse_time,
    parse_zk,
    seconds_parser,
)
from hpc_elastic.submit import Plan, SlurmCommands, plan, submit

DEBUG_ENV = "HPC_ELASTIC_DEBUG"

slurm: SlurmCommands = commands
"""The Slurm layer submit talks to; tests swap in a fake."""


@dataclass(frozen=True)
class Invocation:
    """The raw arguments, kept so the sbatch script can record the command that made it."""

    argv: tuple[str, ...]


LAZY_COMMANDS: dict[str, tuple[str, str, dict[str, str]]] = {
    "agent": ("hpc_elastic.agent.command", "agent", {"context_settings": "CONTEXT"}),
    "run": ("hpc_elastic.local", "run_command", {"help": "RUN_HELP"}),
    "status": ("hpc_elastic.ops.commands", "status_command", {}),
    "list": ("hpc_elastic.ops.commands", "list_command", {}),
    "logs": ("hpc_elastic.ops.commands", "logs_command", {}),
    "events": ("hpc_elastic.ops.commands", "events_command", {}),
    "cancel": ("hpc_elastic.ops.cancel", "cancel_command", {}),
    "doctor": ("hpc_elastic.doctor", "doctor_command", {}),
}
"""Command name -> (module, function, settings of ``app.command`` read from that module)."""


def _load_command(name: str) -> Command:
    module_name, function, settings = LAZY_COMMANDS[name]
    module = importlib.import_module(module_name)
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


def parse_script(text: str) -> Path:
    """The training script must exist here and now: the job would only fail later on a node."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise UsageError(
            f"Script '{text}' does not exist or is not a file; give the path of your "
            "training script, e.g. 'train.py'."
        )
    return path.absolute()


def default_job_name(script: Path) -> str:
    """The script's name made safe for a run id: ``my train.py`` -> ``my-train``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", script.stem).strip("-._")[:64]
    return name or "job"


SUBMIT_HELP = """Render the sbatch script for SCRIPT and submit it with sbatch.

Prints the Slurm job id, the job directory and where the logs go. Defaults come from
hpc-elastic.toml or [tool.hpc-elastic] in pyproject.toml (searched upwards from the
current directory); flags beat the file.

\b
Examples:
  hpc-elastic submit --nodes 4 --nproc-per-node 8 train.py
  hpc-elastic submit --nodes 2:8 --partition gpu --time 1-00 --gpus-per-node 8 \\
      --setup 'module load cuda' --setup 'source .venv/bin/activate' \\
      train.py -- --lr 3e-4 --epochs 10
  hpc-elastic submit --nodes 1:4 --dry-run train.py     # print the script only
"""

RENDER_HELP = """Print the sbatch script that submit would send; calls nothing on Slurm.

Same options as submit. Example: hpc-elastic render --nodes 1:4 train.py > job.sh
"""


@app.command("render", help=RENDER_HELP)
@app.command("submit", help=SUBMIT_HELP)
def submit_command(  # noqa: PLR0917 (Typer reads the options from the signature)
    ctx: typer.Context,
    script: Annotated[
        Path,
        typer.Argument(
            parser=parse_script, metavar="SCRIPT", help="The training script, run with python -u."
        ),
    ],
    script_args: Annotated[
        list[str] | None,
        typer.Argument(metavar="SCRIPT_ARGS", help="Arguments for SCRIPT, after '--'."),
    ] = None,
    nodes: Annotated[
        NodeRange | None,
        typer.Option(
            parser=NodeRange.parse,
            metavar="N|MIN:MAX",
            help="Fixed N nodes (one allocation) or elastic MIN:MAX (an array of MAX "
            "one-node tasks; training goes on while at least MIN run). Default 1.",
        ),
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            parser=count_parser("--nproc-per-node"),
            metavar="P",
            help="Worker processes per node, usually one per GPU. Default 1.",
        ),
    ] = None,
    job_name: Annotated[
        str | None,
        typer.Option(
            parser=parse_job_name,
            metavar="NAME",
            help="Slurm job name; default: the script's name.",
        ),
    ] = None,
    partition: Annotated[
        str | None, typer.Option(metavar="NAME", help="Slurm partition (see `sinfo -s`).")
    ] = None,
    account: Annotated[
        str | None, typer.Option(metavar="NAME", help="Slurm account to charge.")
    ] = None,
    qos: Annotated[
        str | None, typer.Option(metavar="NAME", help="Slurm quality of service.")
    ] = None,
    time: Annotated[
        str | None,
        typer.Option(
            parser=parse_time,
            metavar="TIME",
            help="Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 1-00.",
        ),
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(parser=count_parser("--gpus-per-node"), metavar="N", help="GPUs per node."),
    ] = None,
    cpus_per_task: Annotated[
        int | None,
        typer.Option(
            parser=count_parser("--cpus-per-task"),
            metavar="N",
            help="CPUs for each node's agent and its workers.",
        ),
    ] = None,
    mem: Annotated[
        str | None,
        typer.Option(parser=parse_mem, metavar="SIZE", help="Memory per node, e.g. 64G; 0 = all."),
    ] = None,
    constraint: Annotated[
        str | None, typer.Option(metavar="FEATURES", help="Node features, e.g. 'a100'.")
    ] = None,
    exclude: Annotated[
        str | None, typer.Option(metavar="NODES", help="Nodes to avoid, e.g. 'n[1-3]'.")
    ] = None,
    requeue: Annotated[
        bool | None,
        typer.Option(
            "--requeue/--no-requeue",
            help="Let Slurm requeue the job (or array task) after preemption or node failure. "
            "Default: requeue.",
        ),
    ] = None,
    signal: Annotated[
        PreemptSignal | None,
        typer.Option(
            parser=PreemptSignal.parse,
            metavar="SIG[@SECONDS]",
            help="Warning signal for the agents and how many seconds before the end (time limit "
            "or preemption) it comes; they checkpoint and stop within that grace. Default USR2@90.",
        ),
    ] = None,
    setup: Annotated[
        list[str] | None,
        typer.Option(
            metavar="LINE",
            help="A shell line run before the agents start, e.g. 'module load cuda'. Repeatable.",
        ),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(metavar="KEY=VALUE", help="Set a variable for the job. Repeatable."),
    ] = None,
    log_dir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Where each run gets its own directory (script, secret, Slurm logs). "
            "Default ./hpc-elastic-runs.",
        ),
    ] = None,
    template: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="Your own Jinja2 sbatch template; it may {% extends 'elastic.sh.j2' %}.",
        ),
    ] = None,
    max_restarts: Annotated[
        int | None,
        typer.Option(
            parser=count_parser("--max-restarts", zero_ok=True),
            metavar="R",
            help="Worker-failure restarts for the whole job (node changes are free). Default 3.",
        ),
    ] = None,
    zk: Annotated[
        str | None,
        typer.Option(
            parser=parse_zk,
            metavar="HOST:PORT[,...]",
            help=f"ZooKeeper ensemble for the rendezvous. Default: $HPC_ELASTIC_ZK, the config "
            f"file, or {DEFAULT_ZK}.",
        ),
    ] = None,
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option(
            metavar="OPTION",
            help="Any other sbatch option, e.g. '--reservation=big'. Repeatable.",
        ),
    ] = None,
    hang_timeout: Annotated[
        float | None,
        typer.Option(
            parser=seconds_parser("--hang-timeout"),
            metavar="S",
            help="Restart workers silent this long.",
        ),
    ] = None,
    last_call: Annotated[
        float | None,
        typer.Option(
            parser=seconds_parser("--last-call"),
            metavar="S",
            help="Once MIN nodes are in, wait this long for more.",
        ),
    ] = None,
    session_timeout: Annotated[
        float | None,
        typer.Option(
            parser=seconds_parser("--session-timeout"),
            metavar="S",
            help="ZooKeeper session: how soon a dead node is noticed.",
        ),
    ] = None,
    min_wait: Annotated[
        float | None,
        typer.Option(
            parser=seconds_parser("--min-wait"),
            metavar="S",
            help="How long the job may stay below MIN nodes.",
        ),
    ] = None,
    max_preemptions: Annotated[
        int | None,
        typer.Option(
            parser=count_parser("--max-preemptions", zero_ok=True),
            metavar="N",
            help="Requeues of one slot after preemption before it gives up. Default 100.",
        ),
    ] = None,
    max_time_limits: Annotated[
        int | None,
        typer.Option(
            parser=count_parser("--max-time-limits", zero_ok=True),
            metavar="N",
            help="Requeues of one slot after its time limit before it gives up. Default 10.",
        ),
    ] = None,
    exclude_after: Annotated[
        int | None,
        typer.Option(
            parser=count_parser("--exclude-after"),
            metavar="N",
            help="Failures of a slot on one node before that slot avoids the node. Default 2.",
        ),
    ] = None,
    prewarm: Annotated[
        bool | None,
        typer.Option(
            "--prewarm/--no-prewarm",
            help="Keep standby workers with torch imported, so a restart skips the import "
            "(about 250 MB of host memory per worker). Default: on.",
            show_default=False,
        ),
    ] = None,
    python: Annotated[
        str | None,
        typer.Option(metavar="PATH", help="Python on the nodes. Default: this one."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the script; submit nothing.")
    ] = False,
) -> None:
    flags: dict[str, object | None] = {
        "nodes": nodes,
        "nproc_per_node": nproc_per_node,
        "job_name": job_name,
        "partition": partition,
        "account": account,
        "qos": qos,
        "time": time,
        "gpus_per_node": gpus_per_node,
        "cpus_per_task": cpus_per_task,
        "mem": mem,
        "constraint": constraint,
        "exclude": exclude,
        "requeue": requeue,
        "signal": signal,
        "setup": None if setup is None else tuple(setup),
        "env": None if env is None else tuple(parse_env(item) for item in env),
        "log_dir": log_dir,
        "template": template,
        "max_restarts": max_restarts,
        "zk": zk,
        "sbatch_args": None if sbatch_arg is None else tuple(sbatch_arg),
        "hang_timeout": hang_timeout,
        "last_call": last_call,
        "session_timeout": session_timeout,
        "min_wait": min_wait,
        "max_preemptions": max_preemptions,
        "max_time_limits": max_time_limits,
        "exclude_after": exclude_after,
        "prewarm": prewarm,
        "python": python,
    }
    settings = _merge(load_config(Path.cwd()).values, flags)
    interpreter = str(settings.pop("python", sys.executable))
    settings.setdefault("job_name", default_job_name(script))
    spec = JobSpec(script=script, script_args=tuple(script_args or ()), **cast("Any", settings))

    argv = cast(Invocation, ctx.find_root().obj).argv
    job = plan(spec, ("hpc-elastic", *argv), interpreter, datetime.now())
    if dry_run or ctx.info_name == "render":
        typer.echo(job.script.text, nl=False, color=True)  # the exact script, escapes and all
        return
    _submit(job)


def _merge(defaults: Mapping[str, object], flags: Mapping[str, object | None]) -> dict[str, object]:
    """Flags beat the config file; ``env`` is merged key by key, the flag's value winning."""
    merged = {**defaults, **{key: value for key, value in flags.items() if value is not None}}
    env_pairs = cast("tuple[tuple[str, str], ...]", defaults.get("env", ()))
    flag_pairs = cast("tuple[tuple[str, str], ...]", flags["env"] or ())
    merged["env"] = tuple({**dict(env_pairs), **dict(flag_pairs)}.items())
    return merged


def _submit(job: Plan) -> None:
    submitted = submit(job, slurm)
    nodes = job.spec.nodes
    shape = f"elastic {nodes} nodes" if nodes.is_elastic else f"{nodes} nodes"
    typer.echo(f"Submitted batch job {submitted.job_id} (run {job.context.run_id}, {shape}).")
    typer.echo(f"Job directory: {job.job_dir}")
    typer.echo(f"Logs: {submitted.log_pattern}")


def main() -> None:
    """Console-script entry point (``hpc-elastic``) and ``python -m hpc_elastic``."""
    app()
