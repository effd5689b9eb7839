"""The option table: every ``submit``/``render``/``run`` option, and the agent's own
(``AGENT_OPTIONS``), written down once.

Each ``Option`` row says what the option is (name, type, default, help), how a flag's text
becomes a value (``parse``), how a config-file value does (``read``; no ``read``, no config key),
and where the value goes besides the ``JobSpec``: ``sbatch`` gives its ``#SBATCH`` options,
``agent`` the flags of ``hpc-elastic agent`` in the rendered script and in local mode's argv,
``environment`` the variables the script exports (a secret such as a hook URL goes there: a
command line is visible to everyone on the node, an environment only to its owner).
Everything else is derived from these rows:

- the Typer options of the commands (``typer_parameters``), so ``--help`` shows the defaults
  written here, not numbers repeated by hand in the help text;
- the config keys (``config._KEYS``);
- the ``#SBATCH`` lines and the agent flags (``sbatch_options``, ``agent_options``);
- which value wins (``resolve``): a flag the user typed beats the config file, which beats the
  table's default. "Typed" is click's parameter source, so an option whose default is a real
  value (``--nproc-per-node 1``) still loses to the file when it was not typed.

Adding an option that reaches the agent is one row here, one field on ``JobSpec`` (for the type
checker) and the agent code that reads it; when the agent itself takes a new flag, one more row
in ``AGENT_OPTIONS`` and one field on ``agent.command.AgentArguments``. The order of the rows
is the order of ``--help``, of the ``#SBATCH`` lines and of the agent flags, which the
reference scripts pin.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from hpc_elastic import contract
from hpc_elastic.contract import GRACE_ACTIONS
from hpc_elastic.errors import UsageError
from hpc_elastic.notify import check_url
from hpc_elastic.spec import (
    NodeRange,
    PreemptSignal,
    count_parser,
    parse_after,
    parse_apptainer_image,
    parse_container_image,
    parse_container_mount,
    parse_container_python,
    parse_env,
    parse_iface,
    parse_job_name,
    parse_mem,
    parse_port_range,
    parse_positive,
    parse_sbatch_arg,
    parse_sbatch_value,
    parse_setup_line,
    parse_time,
    parse_time_min,
    parse_zk,
    seconds_parser,
)

ConfigReader = Callable[[object, Path], object]
"""A config-file value and the file's directory -> the option's value; raises UsageError."""
AgentFlags = Sequence[tuple[str, ...]]
"""``("--flag", "value")`` or ``("--flag",)`` for each agent flag an option becomes."""


class WrongTypeError(UsageError):
    """A config value of the wrong TOML type; ``config`` adds which file and key."""


@dataclass(frozen=True)
class Option:
    """One option of ``submit``/``render``/``run``; see the module docstring for each column."""

    name: str
    """The Python name: the Typer parameter, the ``JobSpec`` field, ``config.values``' key."""
    type: Any
    help: str
    default: object = None
    """The value when neither a flag nor the config file gives one."""
    parse: Callable[[str], object] | None = None
    """A flag's text -> value (Typer's ``parser=``); None: Typer converts by ``type``."""
    item: Callable[[str], object] | None = None
    """For a repeatable option: each flag's text -> one item of the value's tuple."""
    read: ConfigReader | None = None
    metavar: str | None = None
    flag: str | None = None
    """The flag's declaration when it is not ``--<name>``, e.g. ``--requeue/--no-requeue``."""
    show_default: bool | str = True
    """What ``--help`` says as the default; a string for defaults decided at run time."""
    combine: Callable[[object, object], object] | None = None
    """How a flag's value joins the config file's instead of replacing it (``--env``)."""
    sbatch: Callable[[Any], Sequence[str]] | None = None
    agent: Callable[[Any], AgentFlags] | None = None
    environment: Callable[[Any], Sequence[tuple[str, str]]] | None = None
    """Variables the job's script exports for the agents and workers, as (name, value)."""
    in_spec: bool = True
    """Whether ``JobSpec`` has this field (``--python`` only picks the interpreter)."""
    required: bool = False
    """The command refuses to run without it (the agent's ``--run-id``); ``default`` unused."""
    envvar: str | None = None
    """A variable that gives the value when no flag does (``contract``'s name for it)."""

    @property
    def config_key(self) -> str | None:
        return self.name.replace("_", "-") if self.read is not None else None

    @property
    def cli_flag(self) -> str:
        return f"--{self.name.replace('_', '-')}" if self.flag is None else self.flag

    @property
    def repeatable(self) -> bool:
        return self.item is not None or self.type == list[str]

    def finish(self, value: object) -> object:
        """A Typer value as the spec holds it: repeatable options become tuples."""
        if not self.repeatable:
            return value
        items = value if isinstance(value, list | tuple) else ()
        return tuple(self.item(text) if self.item else text for text in items)

    def typer_parameter(self) -> inspect.Parameter:
        """This option as a keyword parameter Typer can read, default and all."""
        default: object = self.default
        if self.repeatable:
            default = None
        elif self.parse is not None and default is not None:
            default = str(default)  # Typer runs the default through ``parse`` too
        settings: dict[str, Any] = {"help": self.help, "show_default": self.show_default}
        if self.parse is not None:
            settings["parser"] = self.parse
        if self.metavar is not None:
            settings["metavar"] = self.metavar
        if self.envvar is not None:
            settings["envvar"] = self.envvar
        if self.required:  # no default at all: Typer then marks the option [required]
            default = inspect.Parameter.empty
        declarations = () if self.flag is None else (self.flag,)
        annotation = list[str] | None if self.repeatable else self.type
        return inspect.Parameter(
            self.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=default,
            annotation=Annotated[annotation, typer.Option(*declarations, **settings)],
        )


# --- config-file readers -------------------------------------------------------------------


def _wrong_type(expected: str, value: object) -> WrongTypeError:
    return WrongTypeError(
        f"must be {expected}, not {type(value).__name__} {value!r}; fix the config file."
    )


def read_text(parse: Callable[[str], object], *, numbers: bool = False) -> ConfigReader:
    """A string value (or a bare number, for keys like ``nodes = 4`` and ``time = 60``)."""

    def convert(value: object, _base: Path) -> object:
        if numbers and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise _wrong_type("a string", value)
        return parse(value)

    return convert


def read_count(option: str, *, zero_ok: bool = False) -> ConfigReader:
    def convert(value: object, _base: Path) -> object:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _wrong_type("an integer", value)
        return parse_positive(option, value, zero_ok=zero_ok)

    return convert


def read_seconds(option: str) -> ConfigReader:
    def convert(value: object, _base: Path) -> object:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _wrong_type("a number of seconds", value)
        if value < 0:
            raise UsageError(f"{option} '{value}' is negative; give 0 or more seconds.")
        return float(value)

    return convert


def read_flag(value: object, _base: Path) -> object:
    if not isinstance(value, bool):
        raise _wrong_type("true or false", value)
    return value


def read_path(value: object, base: Path) -> object:
    """Relative paths in the file are relative to the file, not to the working directory."""
    if not isinstance(value, str):
        raise _wrong_type("a path string", value)
    return base / Path(value).expanduser()


def read_lines(parse: Callable[[str], str]) -> ConfigReader:
    def convert(value: object, _base: Path) -> object:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise _wrong_type("a list of strings", value)
        return tuple(parse(item) for item in value)

    return convert


def read_environment(value: object, _base: Path) -> object:
    if not isinstance(value, dict) or not all(
        isinstance(item, str | int | float) and not isinstance(item, bool)
        for item in value.values()
    ):
        raise _wrong_type('a table of KEY = "value"', value)
    return tuple(parse_env(f"{key}={item}") for key, item in value.items())


# --- row builders: one per kind of value ---------------------------------------------------


def _text(
    name: str,
    type: Any,
    help: str,
    parse: Callable[[str], object],
    *,
    numbers: bool = False,
    **columns: Any,
) -> Option:
    """A value written as text: the flag and the config file go through the same ``parse``
    (``numbers``: the file may also give a bare number, as in ``time = 60``)."""
    return Option(name, type, help, parse=parse, read=read_text(parse, numbers=numbers), **columns)


def _sbatch_line(template: str) -> Callable[[Any], Sequence[str]]:
    """The ``#SBATCH`` option for a value that is set (``template`` with ``{}`` for it)."""
    return lambda value: () if value is None else (template.format(value),)


def _word(name: str, help: str, *, metavar: str = "NAME") -> Option:
    """A single word that lands on an ``#SBATCH`` line as ``--<name>=<word>``."""
    flag = f"--{name.replace('_', '-')}"
    return Option(
        name,
        str | None,
        help,
        metavar=metavar,
        read=read_text(lambda text: parse_sbatch_value(flag, text)),
        sbatch=_sbatch_line(f"{flag}={{}}"),
    )


def _count(
    name: str,
    help: str,
    default: int | None,
    *,
    metavar: str = "N",
    zero_ok: bool = False,
    show_default: bool | str = True,
    agent: bool = False,
) -> Option:
    """A whole number; ``agent``: passed on as ``--<name> N`` when set."""
    flag = f"--{name.replace('_', '-')}"
    return Option(
        name,
        int | None if default is None else int,
        help,
        default,
        parse=count_parser(flag, zero_ok=zero_ok),
        read=read_count(flag, zero_ok=zero_ok),
        metavar=metavar,
        show_default=show_default,
        agent=_pass_on(flag, str) if agent else None,
    )


def _seconds(name: str, help: str, show_default: str) -> Option:
    """An agent knob in seconds; unset, the agent's own default applies (``show_default``)."""
    flag = f"--{name.replace('_', '-')}"
    return Option(
        name,
        float | None,
        help,
        parse=seconds_parser(flag),
        read=read_seconds(flag),
        metavar="S",
        show_default=show_default,
        agent=_pass_on(flag, lambda seconds: format(seconds, "g")),
    )


def _pass_on(flag: str, text: Callable[[Any], str]) -> Callable[[Any], AgentFlags]:
    return lambda value: () if value is None else ((flag, text(value)),)


def _merge_env(defaults: object, flags: object) -> object:
    """``--env`` adds to the file's ``env`` table key by key, the flag's value winning."""
    pairs = {**dict(defaults or ()), **dict(flags or ())}  # type: ignore[call-overload]
    return tuple(pairs.items())


def _signal_flags(signal: PreemptSignal) -> AgentFlags:
    return (("--preempt-signal", signal.name), ("--grace", str(signal.seconds)))


def parse_notify_url(text: str) -> str:
    """An http(s) webhook (``notify.check_url``) in one printable word: it is exported into the
    job's environment, and a space or newline there would be a different URL."""
    if not text.isprintable() or any(char.isspace() for char in text):
        raise UsageError(
            f"--notify {text!r:.200} contains spaces or control characters; give the webhook's "
            "address, e.g. 'https://hooks.example.com/T000/B000'."
        )
    return check_url(text)


def _iface_environment(iface: str | None) -> tuple[tuple[str, str], ...]:
    """gloo and NCCL open their connections on the named interface only; torch's TCPStore
    (MASTER_ADDR:MASTER_PORT) has no such setting and still listens on every interface, which
    docs/security.md states."""
    if iface is None:
        return ()
    return (("GLOO_SOCKET_IFNAME", iface), ("NCCL_SOCKET_IFNAME", iface))


def _exported(name: str) -> Callable[[Any], tuple[tuple[str, str], ...]]:
    return lambda value: () if value is None else ((name, str(value)),)


def _exported_unless_default(
    name: str, default: object, text: Callable[[Any], str] = str
) -> Callable[[Any], tuple[tuple[str, str], ...]]:
    """Export ``name`` only for a value other than the training helpers' own default, so a job
    that sets nothing gets the same script as before (and a user's ``--env`` still applies)."""
    return lambda value: () if value is None or value == default else ((name, text(value)),)


def parse_grace_action(text: str) -> str:
    """What an agent does when a save no longer fits the time Slurm leaves (slurm/grace.py)."""
    if text not in GRACE_ACTIONS:
        raise UsageError(
            f"--grace-action {text!r:.100} is not one of {', '.join(GRACE_ACTIONS)}; give 'warn' "
            "(say so in the events and status), 'lead' (also stop before the time limit's "
            "signal, early enough for the save) or 'local' (also save a stop's checkpoint to "
            "--local-checkpoint-dir first)."
        )
    return text


def parse_when_busy(text: str) -> str:
    if text not in contract.CHECKPOINT_WHEN_BUSY_CHOICES:
        raise UsageError(
            f"--checkpoint-when-busy {text!r:.100} is not one of "
            f"{', '.join(contract.CHECKPOINT_WHEN_BUSY_CHOICES)}; give 'wait' or 'skip'."
        )
    return text


def parse_local_dir(text: str) -> Path:
    """A node-local directory, as the workers see it; never created or resolved here, since it
    exists on the compute nodes, not where ``submit`` runs."""
    if not text or not text.isprintable() or "://" in text:
        raise UsageError(
            f"--local-checkpoint-dir {text!r:.200} is not a local directory path; give a "
            "node-local path such as '/local/scratch/ckpt'."
        )
    return Path(text)


def read_local_dir(value: object, _base: Path) -> object:
    """As the flag: the path is the compute nodes', so it is not made relative to the file."""
    if not isinstance(value, str):
        raise _wrong_type("a path string", value)
    return parse_local_dir(value)


CHECKPOINT_OPTIONS: tuple[Option, ...] = (
    Option(
        "checkpoint_async",
        bool,
        "Save checkpoints in the background: training goes on while the copy is written.",
        False,
        read=read_flag,
        flag="--checkpoint-async/--no-checkpoint-async",
        environment=_exported_unless_default(
            contract.CHECKPOINT_ASYNC_ENV, False, lambda on: "1" if on else "0"
        ),
    ),
    _text(
        "checkpoint_when_busy",
        str,
        "What an async save does while the previous one is still being written: wait or skip.",
        parse_when_busy,
        default=contract.DEFAULT_CHECKPOINT_WHEN_BUSY,
        metavar="wait|skip",
        environment=_exported_unless_default(
            contract.CHECKPOINT_WHEN_BUSY_ENV, contract.DEFAULT_CHECKPOINT_WHEN_BUSY
        ),
    ),
    replace(
        _count("keep", "Newest committed checkpoints to keep.", contract.DEFAULT_CHECKPOINT_KEEP),
        environment=_exported_unless_default(
            contract.CHECKPOINT_KEEP_ENV, contract.DEFAULT_CHECKPOINT_KEEP
        ),
    ),
    replace(
        _count(
            "keep_every",
            "Also keep every checkpoint whose step is a multiple of N (0: none).",
            contract.DEFAULT_CHECKPOINT_KEEP_EVERY,
            zero_ok=True,
        ),
        environment=_exported_unless_default(
            contract.CHECKPOINT_KEEP_EVERY_ENV, contract.DEFAULT_CHECKPOINT_KEEP_EVERY
        ),
    ),
    Option(
        "local_checkpoint_dir",
        Path | None,
        "A node-local directory for fast checkpoints; every --persist-every-th one is copied "
        "to the job's checkpoint directory.",
        parse=parse_local_dir,
        read=read_local_dir,
        metavar="DIR",
        show_default="none",
        environment=_exported(contract.LOCAL_CHECKPOINT_DIR_ENV),
    ),
    replace(
        _count(
            "persist_every",
            "With --local-checkpoint-dir: copy every Nth checkpoint to the shared directory.",
            contract.DEFAULT_PERSIST_EVERY,
        ),
        environment=_exported_unless_default(
            contract.PERSIST_EVERY_ENV, contract.DEFAULT_PERSIST_EVERY
        ),
    ),
)
"""Issue 15's checkpoint settings: the training helpers read them from the environment, so
each row exports a variable (``contract``) instead of passing an agent flag."""


CONTAINER_OPTIONS: tuple[Option, ...] = (
    Option(
        "container_image",
        str | None,
        "Run each node's srun step in this image with pyxis (srun --container-image): the "
        "agent runs there too, so the image needs hpc-elastic and the Slurm commands.",
        parse=parse_container_image,
        read=read_text(parse_container_image),
        metavar="IMAGE",
        show_default="none",
    ),
    Option(
        "apptainer",
        str | None,
        "Run the workers in this Apptainer image (apptainer exec --nv); the agent stays "
        "outside, in --python.",
        parse=parse_apptainer_image,
        read=read_text(parse_apptainer_image),
        metavar="IMAGE",
        show_default="none",
    ),
    Option(
        "container_mounts",
        list[str],
        "Also mount these in the container (the job and script directories always are). "
        "Repeatable.",
        (),
        item=parse_container_mount,
        read=read_lines(parse_container_mount),
        metavar="SRC[:DST[:FLAGS]][,...]",
    ),
    Option(
        "container_python",
        str,
        "The Python inside the image: it runs the workers (with --container-image, the agent too).",
        contract.DEFAULT_CONTAINER_PYTHON,
        parse=parse_container_python,
        read=read_text(parse_container_python),
        metavar="PATH",
    ),
)
"""Issue 14's containers. No ``sbatch`` or ``agent`` column: the renderer puts the image on
the srun line (pyxis) or in front of the worker command (Apptainer); see ``render.py``."""


def _agent_default(value: float) -> str:
    return f"the agent's {value:g}"


SUBMIT_OPTIONS: tuple[Option, ...] = (
    _text(
        "nodes",
        NodeRange,
        "Fixed N nodes (one allocation) or elastic MIN:MAX (an array of MAX one-node tasks; "
        "training goes on while at least MIN run).",
        NodeRange.parse,
        numbers=True,
        default=NodeRange.parse(contract.DEFAULT_NODES),
        metavar="N|MIN:MAX",
    ),
    _count(
        "spares",
        "Hot spares: K more array slots whose agents start, prewarm their workers and wait; "
        "one replaces a lost node at once, with no wait in the queue.",
        0,
        metavar="K",
        zero_ok=True,
    ),
    _count(
        "nproc_per_node",
        "Worker processes per node, usually one per GPU.",
        contract.DEFAULT_NPROC_PER_NODE,
        metavar="P",
    ),
    _text(
        "job_name",
        str | None,
        "Slurm job name.",
        parse_job_name,
        metavar="NAME",
        show_default="the script's name",
    ),
    _word("partition", "Slurm partition (see `sinfo -s`)."),
    _word("account", "Slurm account to charge."),
    _word("qos", "Slurm quality of service."),
    replace(
        _word(
            "grow_partition",
            "Run the slots above MIN in this partition, as a second array job of the same run: "
            "the first MIN stay where --partition says.",
        ),
        sbatch=None,
        show_default="--partition",
    ),
    _text(
        "grow_time_min",
        str | None,
        "Submit the slots above MIN with sbatch --time-min TIME, so backfill can fit them into "
        "holes shorter than --time; each leaves through the time-limit path when its time ends.",
        parse_time_min,
        numbers=True,
        metavar="TIME",
        show_default="none",
    ),
    replace(
        _word(
            "grow_qos",
            "Run the slots above MIN under this QoS (e.g. a preemptible scavenger), as a second "
            "array job of the same run: when they are preempted the job trains on at MIN.",
        ),
        sbatch=None,
        show_default="--qos",
    ),
    _text(
        "time",
        str | None,
        "Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 1-00.",
        parse_time,
        numbers=True,
        metavar="TIME",
        sbatch=_sbatch_line("--time={}"),
    ),
    _text(
        "mem",
        str | None,
        "Memory per node, e.g. 64G; 0 = all.",
        parse_mem,
        numbers=True,
        metavar="SIZE",
        sbatch=_sbatch_line("--mem={}"),
    ),
    _word("constraint", "Node features, e.g. 'a100'.", metavar="FEATURES"),
    _word("exclude", "Nodes to avoid, e.g. 'n[1-3]'.", metavar="NODES"),
    replace(
        _count("gpus_per_node", "GPUs per node.", None),
        sbatch=_sbatch_line("--gpus-per-node={}"),
    ),
    replace(
        _count("cpus_per_task", "CPUs for each node's agent and its workers.", None),
        sbatch=_sbatch_line("--cpus-per-task={}"),
    ),
    Option(
        "requeue",
        bool,
        "Let Slurm requeue the job (or array task) after preemption or node failure.",
        True,
        read=read_flag,
        flag="--requeue/--no-requeue",
        sbatch=lambda value: ("--requeue" if value else "--no-requeue",),
    ),
    _text(
        "after",
        str | None,
        "Start only after this Slurm job has ended, however it ended (a pipeline's next stage).",
        parse_after,
        numbers=True,
        metavar="JOB",
        show_default="at once",
        sbatch=_sbatch_line("--dependency=afterany:{}"),
    ),
    _count(
        "max_restarts",
        "Worker-failure restarts for the whole job (node changes are free).",
        contract.DEFAULT_MAX_RESTARTS,
        metavar="R",
        zero_ok=True,
        agent=True,
    ),
    _text(
        "signal",
        PreemptSignal,
        "Warning signal for the agents and how many seconds before the end (time limit or "
        "preemption) it comes; they checkpoint and stop within that grace.",
        PreemptSignal.parse,
        default=PreemptSignal.parse(contract.DEFAULT_PREEMPT_SIGNAL),
        metavar="SIG[@SECONDS]",
        sbatch=lambda value: (f"--signal={value}",),
        agent=_signal_flags,
    ),
    _seconds("hang_timeout", "Restart workers silent this long.", "off"),
    _seconds(
        "last_call",
        "Once MIN nodes are in, wait this long for more.",
        _agent_default(contract.DEFAULT_LAST_CALL),
    ),
    _seconds(
        "session_timeout",
        "ZooKeeper session: how soon a dead node is noticed.",
        _agent_default(contract.DEFAULT_SESSION_TIMEOUT),
    ),
    _seconds(
        "min_wait",
        "How long the job may stay below MIN nodes.",
        _agent_default(contract.DEFAULT_MIN_WAIT),
    ),
    _seconds(
        "zk_outage_limit",
        "How long an agent cut off from every ZooKeeper server waits for one before it "
        "leaves the job (exit 69, not requeued).",
        _agent_default(contract.DEFAULT_ZK_OUTAGE_LIMIT),
    ),
    _count(
        "max_preemptions",
        "Requeues of one slot after preemption before it gives up.",
        None,
        zero_ok=True,
        show_default=_agent_default(contract.DEFAULT_MAX_PREEMPTIONS),
        agent=True,
    ),
    _count(
        "max_time_limits",
        "Requeues of one slot after its time limit before it gives up.",
        None,
        zero_ok=True,
        show_default=_agent_default(contract.DEFAULT_MAX_TIME_LIMITS),
        agent=True,
    ),
    _count(
        "exclude_after",
        "Failures of a slot on one node before that slot avoids the node.",
        None,
        show_default=_agent_default(contract.DEFAULT_EXCLUDE_AFTER),
        agent=True,
    ),
    _count(
        "expected_gpus",
        "GPUs each node must have to pass the preflight.",
        None,
        zero_ok=True,
        show_default="any",
        agent=True,
    ),
    _seconds(
        "bad_node_ttl",
        "Seconds a node that failed its preflight stays excluded.",
        _agent_default(contract.DEFAULT_BAD_NODE_TTL),
    ),
    _text(
        "grace_action",
        str,
        "When a checkpoint save plus a step no longer fit the --signal lead or the "
        "partition's (or QoS's) GraceTime: 'warn' in the events and status, 'lead': also "
        "stop each slot early enough before its time limit, or 'local': also save a stop's "
        "checkpoint to --local-checkpoint-dir only, and to the shared directory at the next "
        "start.",
        parse_grace_action,
        default=GRACE_ACTIONS[0],
        metavar="warn|lead|local",
        agent=lambda value: () if value == GRACE_ACTIONS[0] else (("--grace-action", value),),
    ),
    Option(
        "exclude_stragglers",
        bool,
        "Move a slot to another node when a rank there straggles.",
        False,
        read=read_flag,
        flag="--exclude-stragglers/--no-exclude-stragglers",
        agent=lambda value: (("--exclude-stragglers",),) if value else (),
    ),
    Option(
        "prewarm",
        bool,
        "Keep standby workers with torch imported, so a restart skips the import "
        "(about 250 MB of host memory per worker).",
        True,
        read=read_flag,
        flag="--prewarm/--no-prewarm",
        agent=lambda value: (("--prewarm", "torch"),) if value else (),
    ),
    Option(
        "in_place",
        bool,
        "Keep surviving workers through a restart and hand them the new round; for loops "
        "that use hpc_elastic.train.InPlace.",
        False,
        read=read_flag,
        flag="--in-place/--no-in-place",
        agent=lambda value: (("--in-place",),) if value else (),
    ),
    *CHECKPOINT_OPTIONS,
    Option(
        "setup",
        list[str],
        "A shell line run before the agents start, e.g. 'module load cuda'. Repeatable.",
        (),
        read=read_lines(parse_setup_line),
        metavar="LINE",
    ),
    Option(
        "env",
        list[str],
        "Set a variable for the job. Repeatable.",
        (),
        item=parse_env,
        read=read_environment,
        metavar="KEY=VALUE",
        combine=_merge_env,
    ),
    Option(
        "env_file",
        Path | None,
        "A file of KEY=VALUE lines to export for the job, for secrets: a flag's value is shown "
        "to every user by ps. Yours, mode 0600; --env and the config's env win for a key.",
        read=read_path,
        metavar="FILE",
        show_default="none",
        in_spec=False,
    ),
    Option(
        "log_dir",
        Path,
        "Where each run gets its own directory (script, secret, Slurm logs).",
        contract.DEFAULT_RUNS_DIR,
        read=read_path,
        metavar="DIR",
    ),
    Option(
        "snapshot",
        bool,
        "Copy the script's project (git-tracked and untracked-but-not-ignored files, else the "
        "script's directory) into the job directory; every slot and requeue runs that copy.",
        True,
        read=read_flag,
        flag="--snapshot/--no-snapshot",
    ),
    _count(
        "snapshot_max_mb",
        "The largest code snapshot to copy, in MB; a bigger project is refused.",
        contract.DEFAULT_SNAPSHOT_MAX_MB,
        metavar="MB",
    ),
    _count(
        "snapshot_max_files",
        "The most files a code snapshot copies; a project with more is refused.",
        contract.DEFAULT_SNAPSHOT_MAX_FILES,
        metavar="N",
    ),
    Option(
        "snapshot_root",
        Path | None,
        "The directory to snapshot instead of the script's project: it must hold the script "
        "(git's rules apply if it is a work tree's top). Never a home directory.",
        read=read_path,
        metavar="DIR",
        show_default="the script's project",
    ),
    Option(
        "template",
        Path | None,
        "Your own Jinja2 sbatch template; it may {% extends 'elastic.sh.j2' %}.",
        read=read_path,
        metavar="PATH",
    ),
    _text(
        "zk",
        str,
        f"ZooKeeper for the rendezvous; ${contract.ZK_ENV}, the config file and your own "
        "ensemble (zk start) beat this default.",
        parse_zk,
        default=contract.DEFAULT_ZK,
        metavar="HOST:PORT[,...]",
    ),
    Option(
        "sbatch_args",
        list[str],
        "Any other sbatch option, e.g. '--reservation=big'. Repeatable.",
        (),
        read=read_lines(parse_sbatch_arg),
        metavar="OPTION",
        flag="--sbatch-arg",
        sbatch=tuple,
    ),
    _text(
        "iface",
        str | None,
        "The job's network interface (e.g. ib0): gloo and NCCL use only that one.",
        parse_iface,
        metavar="NAME",
        show_default="any",
        environment=_iface_environment,
    ),
    _text(
        "master_port_range",
        str | None,
        "Ports for the workers' MASTER_PORT, e.g. 29500:29599, for a site firewall.",
        parse_port_range,
        metavar="LOW:HIGH",
        show_default="any free port",
        environment=_exported(contract.MASTER_PORTS_ENV),
    ),
    _text(
        "notify",
        str | None,
        "Web hook the agents post JSON to when the job fails or finishes. Often a secret "
        f"itself: prefer ${contract.NOTIFY_URL_ENV} or --notify-file to this flag.",
        parse_notify_url,
        metavar="URL",
        show_default="none",
        environment=_exported(contract.NOTIFY_URL_ENV),
        envvar=contract.NOTIFY_URL_ENV,
    ),
    Option(
        "notify_file",
        Path | None,
        "A file holding the --notify URL on its first line (yours, mode 0600).",
        read=read_path,
        metavar="FILE",
        show_default="none",
        in_spec=False,
    ),
    Option(
        "python",
        str | None,
        "Python on the nodes.",
        read=read_text(str),
        metavar="PATH",
        show_default="this one",
        in_spec=False,
    ),
    *CONTAINER_OPTIONS,
)
"""The options of ``submit`` and ``render``, in ``--help`` order."""

_BY_NAME = {option.name: option for option in SUBMIT_OPTIONS}


def option(name: str) -> Option:
    """The row called ``name``, e.g. for a command that shares it with ``submit``."""
    return _BY_NAME[name]


def config_readers(options: Iterable[Option] = SUBMIT_OPTIONS) -> dict[str, ConfigReader]:
    """Config key -> reader, for every option the config file may set."""
    return {
        option.config_key: option.read
        for option in options
        if option.config_key is not None and option.read is not None
    }


def typer_parameters(options: Iterable[Option]) -> list[inspect.Parameter]:
    return [option.typer_parameter() for option in options]


def with_options(
    options: Sequence[Option],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command ``def f(ctx, ..., **values)`` the table's options as Typer parameters.

    Typer reads a command's parameters from ``inspect.signature``; this replaces ``**values``
    in that signature with one keyword parameter per row, so the command's Python code stays a
    few lines and the table stays the one place an option is written.
    """

    def decorate(function: Callable[..., None]) -> Callable[..., None]:
        own = [
            parameter
            for parameter in inspect.signature(function, eval_str=True).parameters.values()
            if parameter.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        keyword = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
        function.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [*positional, *typer_parameters(options), *keyword]
        )
        return function

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
    for option in options:
        if typed(option.name):
            value = option.finish(values[option.name])
            if option.combine is not None and option.name in config:
                value = option.combine(config[option.name], value)
        elif option.name in config:
            value = config[option.name]
        else:
            value = option.default
        resolved[option.name] = value
    return resolved


def sbatch_options(values: Mapping[str, object]) -> list[str]:
    """The ``#SBATCH`` options the values ask for, unescaped, in table order."""
    return [
        text
        for option in SUBMIT_OPTIONS
        if option.sbatch is not None
        for text in option.sbatch(values[option.name])
    ]


def job_environment(
    values: Mapping[str, object], options: Iterable[Option] = SUBMIT_OPTIONS
) -> list[tuple[str, str]]:
    """The variables the options ask the job's script (or local mode's agents) to export, in
    table order."""
    return [
        pair
        for option in options
        if option.environment is not None and option.name in values
        for pair in option.environment(values[option.name])
    ]


def agent_options(
    values: Mapping[str, object], options: Iterable[Option] = SUBMIT_OPTIONS
) -> tuple[tuple[str, ...], ...]:
    """The ``hpc-elastic agent`` flags the values ask for, in table order."""
    return tuple(
        flag
        for option in options
        if option.agent is not None and option.name in values
        for flag in option.agent(values[option.name])
    )


# --- the agent's own options ---------------------------------------------------------------


def _on_the_agent(name: str, **changes: Any) -> Option:
    """``submit``'s row ``name`` as ``hpc-elastic agent`` reads the flag it becomes: the same
    spelling, parser and help. Submit leaves most agent knobs unset (``None``, shown as "the
    agent's N") so the agent's own default applies; here that default is the real value. The
    submit-side columns (config key, ``#SBATCH`` line, agent flags) mean nothing to the agent."""
    return replace(option(name), read=None, sbatch=None, agent=None, environment=None, **changes)


def _agent_knob(name: str, default: float) -> Option:
    """A submit knob the agent always has a value for: typed by its default (an int budget or
    float seconds) instead of submit's ``... | None``."""
    return _on_the_agent(name, type=type(default), default=default, show_default=True)


AGENT_OPTIONS: tuple[Option, ...] = (
    Option("run_id", str, "The job's rendezvous id, shared by its agents.", required=True),
    Option("job_dir", Path, "The job directory: logs, checkpoints, events.jsonl.", required=True),
    Option(
        "zk",
        str,
        "ZooKeeper hosts 'h1:p1,h2:p2[/chroot]', or local:SOCKET.",
        required=True,
        metavar="HOSTS",
    ),
    _on_the_agent("nodes", help="Node count or range.", metavar="MIN:MAX", required=True),
    _on_the_agent("nproc_per_node", help="Workers on this node."),
    Option(
        "zk_auth_file",
        Path | None,
        "File holding the job's ZooKeeper secret (mode 0600).",
        metavar="PATH",
    ),
    Option(
        "zk_open_acl",
        bool,
        "Run without --zk-auth-file: any ZooKeeper user may read, forge or end the job.",
        False,
        flag="--zk-open-acl",
    ),
    _on_the_agent("max_restarts"),
    Option(
        "preempt_signal",
        str,
        "Signal that announces preemption.",
        PreemptSignal.parse(contract.DEFAULT_PREEMPT_SIGNAL).name,
        metavar="USR1|USR2",
    ),
    Option(
        "grace",
        float,
        "Seconds workers get to save after a stop signal.",
        contract.DEFAULT_GRACE,
        parse=seconds_parser("--grace"),
        metavar="S",
    ),
    _on_the_agent("hang_timeout"),
    _agent_knob("last_call", contract.DEFAULT_LAST_CALL),
    _agent_knob("session_timeout", contract.DEFAULT_SESSION_TIMEOUT),
    _agent_knob("min_wait", contract.DEFAULT_MIN_WAIT),
    _agent_knob("zk_outage_limit", contract.DEFAULT_ZK_OUTAGE_LIMIT),
    _agent_knob("max_preemptions", contract.DEFAULT_MAX_PREEMPTIONS),
    _agent_knob("max_time_limits", contract.DEFAULT_MAX_TIME_LIMITS),
    _agent_knob("exclude_after", contract.DEFAULT_EXCLUDE_AFTER),
    Option("slot", str | None, "This node's slot name.", metavar="NAME", show_default="Slurm's"),
    Option(
        "host",
        str | None,
        "Address other nodes reach this one at.",
        metavar="ADDR",
        show_default=f"${contract.HOST_ENV}, else this host's name resolved",
    ),
    Option(
        "prewarm",
        list[str],
        "Keep standby workers that imported MODULE (e.g. torch): faster restarts.",
        (),
        metavar="MODULE",
    ),
    Option("tee", bool, "Also copy the workers' output to the console.", False),
    Option(
        "metrics_port",
        int | None,
        "Serve Prometheus metrics on this port (0: any free one).",
        metavar="PORT",
        show_default="off",
    ),
    Option(
        "metrics_textfile",
        Path | None,
        "Write Prometheus metrics here for node_exporter.",
        metavar="PATH",
        show_default="off",
    ),
    Option(
        "metrics_bind",
        str,
        "Address to serve metrics on; 0.0.0.0 for every interface.",
        contract.DEFAULT_METRICS_BIND,
        metavar="ADDR",
    ),
    Option(
        "preflight",
        bool,
        "Check this node's health (GPUs, disks, ZooKeeper, clock) before joining.",
        True,
        envvar=contract.PREFLIGHT_ENV,
    ),
    Option(
        "expected_gpus",
        int | None,
        "GPUs this node must have to pass the preflight.",
        parse=count_parser("--expected-gpus", zero_ok=True),
        metavar="N",
        show_default="any",
    ),
    Option(
        "user_secret_file",
        Path,
        "The user's secret guarding the bad nodes remembered across jobs.",
        contract.DEFAULT_USER_SECRET_FILE,
        metavar="PATH",
        envvar=contract.USER_SECRET_FILE_ENV,
    ),
    Option(
        "bad_node_ttl",
        float,
        "Seconds a node that failed its preflight stays excluded.",
        contract.DEFAULT_BAD_NODE_TTL,
        parse=seconds_parser("--bad-node-ttl"),
        metavar="S",
    ),
    Option(
        "exclude_stragglers",
        bool,
        "Move this slot to another node when a rank here straggles.",
        False,
    ),
    _on_the_agent("grace_action"),
    Option(
        "in_place",
        bool,
        "Keep surviving workers through a restart (hpc_elastic.train.InPlace).",
        False,
    ),
)
"""The options of ``hpc-elastic agent``, in ``--help`` order. Each flag ``submit``'s rows pass on
(``agent_options``) and each flag of ``AgentInvocation`` has its row here, so the sender and
the agent spell a flag the same way (tests/test_options.py checks both)."""

_AGENT_BY_NAME = {option.name: option for option in AGENT_OPTIONS}


def agent_flag(name: str) -> str:
    """How ``hpc-elastic agent`` spells the option ``name``, e.g. ``--run-id``."""
    return _AGENT_BY_NAME[name].cli_flag
