"""The option tables: every option of ``submit``/``render``/``run`` and of the agent, read from
the dataclass fields that declare them, and all that is derived from those.

An option is a dataclass field (``hpc_elastic.schema``): ``spec.JobSpec``'s fields are the
options of ``submit``, ``render`` and the Python API, ``PlanInputs``' the few that the plan
reads before it makes the spec, and ``AgentArguments``' those of ``hpc-elastic agent``. The
field gives the name, type and default; the rest of its row says how a flag or a config value
becomes the value and where the value goes besides the dataclass: ``sbatch`` gives its
``#SBATCH`` options, ``agent`` the options of ``hpc-elastic agent`` (by their field names in
``AgentArguments``, whose rows spell the flags) in the rendered script and in local mode's argv,
``environment`` the variables the script exports (a secret such as a hook URL
goes there: a command line is visible to everyone on the node, an environment only to its
owner). Everything else is derived from the rows:

- the click options of the commands (``click_options``), so ``--help`` shows the fields'
  defaults, not numbers repeated by hand in the help text (for a ``submit`` option left to the
  agent, the default of the agent's field: "the agent's 600");
- the config keys (``config._KEYS``);
- the ``#SBATCH`` lines and the agent flags (``sbatch_options``, ``agent_options``);
- which value wins (``resolve``): a flag the user typed beats the config file, which beats the
  field's default. "Typed" is click's parameter source, so an option whose default is a real
  value (``--nproc-per-node 1``) still loses to the file when it was not typed.

Adding an option that reaches the agent is one field on ``JobSpec`` (its row passes the flag on)
and the agent code that reads it; when the agent itself takes a new flag, one more field on
``AgentArguments``. The order of the fields is the order of ``--help``, of the ``#SBATCH``
lines and of the agent flags, which the reference scripts pin.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hpc_elastic import contract, schema, spec
from hpc_elastic.contract import GRACE_ACTIONS
from hpc_elastic.schema import ConfigReader, Option, WrongTypeError
from hpc_elastic.spec import JobSpec, NodeRange, PreemptSignal, parse_notify_url

if TYPE_CHECKING:
    import click

__all__ = [
    "AGENT_OPTIONS",
    "CHECKPOINT_OPTIONS",
    "SUBMIT_OPTIONS",
    "AgentArguments",
    "ConfigReader",
    "Option",
    "PlanInputs",
    "WrongTypeError",
    "agent_flag",
    "agent_options",
    "click_option",
    "click_options",
    "config_readers",
    "job_environment",
    "option",
    "parse_notify_url",
    "resolve",
    "sbatch_options",
    "with_options",
]


# --- the agent's options -------------------------------------------------------------------


@dataclass(frozen=True)
class AgentArguments:
    """The options of ``hpc-elastic agent``, each declared on its field (``schema``), which
    ``agent.command`` hands the agent. Where ``submit`` has the option (``--max-restarts``,
    ``--last-call``, ...), the field is ``like`` ``JobSpec``'s: the same flag, parser and help,
    with the agent's real default where submit leaves it unset ("the agent decides")."""

    run_id: str = schema.option("The job's rendezvous id, shared by its agents.", metavar="ID")
    job_dir: Path = schema.option(
        "The job directory: logs, checkpoints, events.jsonl.", metavar="DIR"
    )
    zk: str = schema.option(
        "ZooKeeper hosts 'h1:p1,h2:p2[/chroot]', or local:SOCKET.", metavar="HOSTS"
    )
    nodes: NodeRange = schema.like(JobSpec, help="Node count or range.", metavar="MIN:MAX")
    nproc_per_node: int = schema.like(
        JobSpec, contract.DEFAULT_NPROC_PER_NODE, help="Workers on this node."
    )
    zk_auth_file: Path | None = schema.option(
        "File holding the job's ZooKeeper secret (mode 0600).", None, metavar="PATH"
    )
    zk_open_acl: bool = schema.option(
        "Run without --zk-auth-file: any ZooKeeper user may read, forge or end the job.",
        False,
        flag="--zk-open-acl",
    )
    max_restarts: int = schema.like(JobSpec, contract.DEFAULT_MAX_RESTARTS)
    preempt_signal: str = schema.option(
        "Signal that announces preemption.",
        PreemptSignal.parse(contract.DEFAULT_PREEMPT_SIGNAL).name,
        metavar="USR1|USR2",
    )
    grace: float = schema.duration(
        "Seconds workers get to save after a stop signal.", contract.DEFAULT_GRACE
    )
    hang_timeout: float | None = schema.like(JobSpec, None)
    last_call: float = schema.like(JobSpec, contract.DEFAULT_LAST_CALL)
    session_timeout: float = schema.like(JobSpec, contract.DEFAULT_SESSION_TIMEOUT)
    min_wait: float = schema.like(JobSpec, contract.DEFAULT_MIN_WAIT)
    zk_outage_limit: float = schema.like(JobSpec, contract.DEFAULT_ZK_OUTAGE_LIMIT)
    max_preemptions: int = schema.like(JobSpec, contract.DEFAULT_MAX_PREEMPTIONS)
    max_time_limits: int = schema.like(JobSpec, contract.DEFAULT_MAX_TIME_LIMITS)
    exclude_after: int = schema.like(JobSpec, contract.DEFAULT_EXCLUDE_AFTER)
    slot: str | None = schema.option(
        "This node's slot name.", None, metavar="NAME", show_default="Slurm's"
    )
    host: str | None = schema.option(
        "Address other nodes reach this one at.",
        None,
        metavar="ADDR",
        show_default=f"${contract.HOST_ENV}, else this host's name resolved",
    )
    prewarm: tuple[str, ...] = schema.option(
        "Keep standby workers that imported MODULE (e.g. torch): faster restarts.",
        (),
        metavar="MODULE",
    )
    tee: bool = schema.option("Also copy the workers' output to the console.", False)
    metrics_port: int | None = schema.option(
        "Serve Prometheus metrics on this port (0: any free one).",
        None,
        metavar="PORT",
        show_default="off",
    )
    metrics_textfile: Path | None = schema.option(
        "Write Prometheus metrics here for node_exporter.",
        None,
        metavar="PATH",
        show_default="off",
    )
    metrics_bind: str = schema.option(
        "Address to serve metrics on; 0.0.0.0 for every interface.",
        contract.DEFAULT_METRICS_BIND,
        metavar="ADDR",
    )
    preflight: bool = schema.option(
        "Check this node's health (GPUs, disks, ZooKeeper, clock) before joining.",
        True,
        envvar=contract.PREFLIGHT_ENV,
    )
    expected_gpus: int | None = schema.like(
        JobSpec, None, help="GPUs this node must have to pass the preflight."
    )
    user_secret_file: Path = schema.option(
        "The user's secret guarding the bad nodes remembered across jobs.",
        contract.DEFAULT_USER_SECRET_FILE,
        metavar="PATH",
        envvar=contract.USER_SECRET_FILE_ENV,
    )
    bad_node_ttl: float = schema.like(JobSpec, contract.DEFAULT_BAD_NODE_TTL)
    exclude_stragglers: bool = schema.option(
        "Move this slot to another node when a rank here straggles.", False
    )
    grace_action: str = schema.like(JobSpec, GRACE_ACTIONS[0])
    in_place: bool = schema.option(
        "Keep surviving workers through a restart (hpc_elastic.train.InPlace).",
        contract.DEFAULT_IN_PLACE,
    )

    @classmethod
    def from_values(cls, values: Mapping[str, object]) -> AgentArguments:
        """click's values (``with_options``), repeatable ones made tuples by their rows."""
        # click converted each value by its row's type or parser, which mypy cannot follow
        # through the table; the names are the fields', the types checked by click at run time.
        return cls(**{row.name: row.finish(values[row.name]) for row in AGENT_OPTIONS})  # type: ignore[arg-type]


AGENT_OPTIONS: tuple[Option, ...] = schema.options_of(AgentArguments)
"""The options of ``hpc-elastic agent``, in ``--help`` order. Each option ``submit``'s rows pass
on (``agent_options``) and each flag of ``AgentInvocation`` has its field there, and both are
spelt from it, so the sender and the agent spell a flag the same way (tests/cli/test_options.py
checks both)."""

_AGENT_BY_NAME = {row.name: row for row in AGENT_OPTIONS}


def agent_flag(name: str) -> str:
    """How ``hpc-elastic agent`` spells the option ``name``, e.g. ``--run-id``."""
    return _AGENT_BY_NAME[name].cli_flag


# --- submit's options ----------------------------------------------------------------------


@dataclass(frozen=True)
class PlanInputs:
    """Options of ``submit`` that ``JobSpec`` has no field for: the plan reads them before it
    makes the spec (``api.plan_settings``). Each is shown in ``--help`` after the option named
    by its ``after``."""

    env_file: Path | None = schema.path(
        "A file of KEY=VALUE lines to export for the job, for secrets: a flag's value is shown "
        "to every user by ps. Yours, mode 0600; --env and the config's env win for a key.",
        metavar="FILE",
        show_default="none",
        after="env",
    )
    notify_file: Path | None = schema.path(
        "A file holding the --notify URL on its first line (yours, mode 0600).",
        metavar="FILE",
        show_default="none",
        after="notify",
    )
    python: str | None = schema.option(
        "Python on the nodes.",
        None,
        read=schema.read_text(str),
        metavar="PATH",
        show_default="this one",
        after="notify_file",
    )


def _shown_default(row: Option) -> Option:
    """A ``submit`` option left unset for the agent says the agent's default in ``--help``."""
    if row.show_default != schema.AGENT_DECIDES:
        return row
    default = _AGENT_BY_NAME[row.name].default
    return replace(row, show_default=f"the agent's {default:g}")


def _placed(rows: Iterable[Option], extra: Iterable[Option]) -> tuple[Option, ...]:
    """``rows`` with each of ``extra`` right after the row its ``after`` names."""
    placed = list(rows)
    for row in extra:
        at = next(index for index, other in enumerate(placed) if other.name == row.after)
        placed.insert(at + 1, replace(row, in_spec=False))
    return tuple(placed)


SUBMIT_OPTIONS: tuple[Option, ...] = _placed(
    (_shown_default(row) for row in spec.OPTIONS), schema.options_of(PlanInputs)
)
"""The options of ``submit`` and ``render``, in ``--help`` order."""

_BY_NAME = {row.name: row for row in SUBMIT_OPTIONS}


def option(name: str) -> Option:
    """The row called ``name``, e.g. for a command that shares it with ``submit``."""
    return _BY_NAME[name]


CHECKPOINT_OPTIONS: tuple[Option, ...] = tuple(
    option(name)
    for name in (
        "checkpoint_async",
        "checkpoint_when_busy",
        "keep",
        "keep_every",
        "local_checkpoint_dir",
        "persist_every",
    )
)
"""The checkpoint settings, which ``run`` shares with ``submit``: the training helpers read
them from the environment, so each row exports a variable instead of passing an agent flag."""


# --- what is derived from the rows ---------------------------------------------------------


def config_readers(options: Iterable[Option] = SUBMIT_OPTIONS) -> dict[str, ConfigReader]:
    """Config key -> reader, for every option the config file may set."""
    return {
        row.config_key: row.read
        for row in options
        if row.config_key is not None and row.read is not None
    }


def click_option(row: Option) -> click.Option:
    """``row`` as a click option: its flag (``--<name>``, or the row's own, e.g.
    ``--requeue/--no-requeue``; a bool field without one gets ``--<name>/--no-<name>``), value
    type or parser, default, help, metavar, variable, and what ``--help`` says as the default.
    The option's name is the row's, which the command's function receives it by."""
    import click  # noqa: PLC0415 (only a command line builds options: see clicktools)

    settings: dict[str, Any] = {"help": row.help, "show_default": row.show_default}
    if row.metavar is not None:
        settings["metavar"] = row.metavar
    if row.envvar is not None:
        settings |= {"envvar": row.envvar, "show_envvar": True}
    if row.required:  # no default at all: click refuses to run without it, [required] in --help
        settings["required"] = True
    elif not row.repeatable:  # a repeatable option given no flag is (), as click makes it
        settings["default"] = row.default
    if row.type is bool:
        flag = row.cli_flag if row.flag is not None else f"{row.cli_flag}/--no-{row.cli_flag[2:]}"
        return click.Option([row.name, flag], is_flag=True, **settings)
    return click.Option(
        [row.name, row.cli_flag], type=_click_type(row), multiple=row.repeatable, **settings
    )


def _click_type(row: Option) -> click.ParamType[Any, Any]:
    """How click turns a flag's text into the row's value: the row's parser, else by the
    field's type (``int``, ``float``, ``str``, ``Path``, each maybe ``| None``); a repeatable
    row's items stay texts (``Option.finish`` makes them its items)."""
    import click  # noqa: PLC0415

    from hpc_elastic.clicktools import Parsed  # noqa: PLC0415

    if row.parse is not None:
        return Parsed(row.parse)
    if row.repeatable:
        return click.STRING
    kinds = [kind for kind in typing.get_args(row.type) or (row.type,) if kind is not type(None)]
    known: dict[object, click.ParamType[Any, Any]] = {
        int: click.INT,
        float: click.FLOAT,
        str: click.STRING,
        Path: click.Path(path_type=Path),
    }
    if len(kinds) != 1 or kinds[0] not in known:
        raise TypeError(f"option '{row.name}' of type {row.type} needs a parser (parse=...)")
    return known[kinds[0]]


def click_options(options: Iterable[Option]) -> list[click.Option]:
    return [click_option(row) for row in options]


CommandT = TypeVar("CommandT", bound="click.Command")


def with_options(options: Sequence[Option]) -> Callable[[CommandT], CommandT]:
    """Give a command the table's options, right after its arguments (so ``--help`` lists
    them before the command's own options): ``@with_options(rows)`` above ``@click.command``.

    The command's function takes them as ``**values``, by the rows' names, so its code stays
    a few lines and the fields stay the one place an option is written.
    """

    def decorate(command: CommandT) -> CommandT:
        params = command.params
        arguments = [index for index, p in enumerate(params) if p.param_type_name == "argument"]
        at = arguments[-1] + 1 if arguments else 0
        params[at:at] = click_options(options)
        return command

    return decorate


def resolve(
    options: Iterable[Option],
    values: Mapping[str, object],
    typed: Callable[[str], bool],
    config: Mapping[str, object],
) -> dict[str, object]:
    """Each option's value: a typed flag beats the config file, which beats the default.

    ``typed(name)`` says whether the user gave that option on the command line (click's
    parameter source), so a flag equal to the default still beats the file.
    """
    resolved: dict[str, object] = {}
    for row in options:
        if typed(row.name):
            value = row.finish(values[row.name])
            if row.combine is not None and row.name in config:
                value = row.combine(config[row.name], value)
        elif row.name in config:
            value = config[row.name]
        else:
            value = row.default
        resolved[row.name] = value
    return resolved


def sbatch_options(values: Mapping[str, object]) -> list[str]:
    """The ``#SBATCH`` options the values ask for, unescaped, in table order."""
    return [
        text
        for row in SUBMIT_OPTIONS
        if row.sbatch is not None
        for text in row.sbatch(values[row.name])
    ]


def job_environment(
    values: Mapping[str, object], options: Iterable[Option] = SUBMIT_OPTIONS
) -> list[tuple[str, str]]:
    """The variables the options ask the job's script (or local mode's agents) to export, in
    table order."""
    return [
        pair
        for row in options
        if row.environment is not None and row.name in values
        for pair in row.environment(values[row.name])
    ]


def agent_options(
    values: Mapping[str, object], options: Iterable[Option] = SUBMIT_OPTIONS
) -> tuple[tuple[str, ...], ...]:
    """The ``hpc-elastic agent`` flags the values ask for, in table order. A row's ``agent``
    column names the agent's options (``AgentArguments``' fields); their flags are spelt here,
    from the agent's own table, so a renamed agent option cannot leave ``submit`` passing the
    old spelling."""
    return tuple(
        (agent_flag(name), *words)
        for row in options
        if row.agent is not None and row.name in values
        for name, *words in row.agent(values[row.name])
    )
