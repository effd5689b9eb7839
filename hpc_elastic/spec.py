"""Specs: frozen dataclasses that validate themselves, so a bad value fails where it is parsed.

The parsers here (``NodeRange.parse``, ``parse_time``, ...) are what the CLI gives click as the
options' types (``clicktools.Parsed``) and what the config file's values go through, so a flag
and a config key are held to the same rules and say the same sentence when they are wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from hpc_elastic import contract, schema
from hpc_elastic.contract import GRACE_ACTIONS
from hpc_elastic.errors import UsageError
from hpc_elastic.notify import check_url

_NODES = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
_TIME = re.compile(
    r"^(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$"
)
_MEM = re.compile(r"^\d+[KMGT]?$", re.IGNORECASE)
_SIGNAL = re.compile(r"^(?:SIG)?([A-Z0-9]+)(?:@(\d+))?$", re.IGNORECASE)
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ZK_HOST = re.compile(r"^[A-Za-z0-9.\-]+:\d{1,5}$")
_ZK_CHROOT = re.compile(r"^(?:/[A-Za-z0-9._-]+)+$")

SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT", "ALRM")
"""Signals an agent can take as its preemption warning; KILL and STOP cannot be caught."""

MASTER_PORTS_ENV = contract.MASTER_PORTS_ENV
"""Also here, where the rendezvous handler imports it."""

SBATCH_DEFAULT_SIGNAL_SECONDS = 60
"""What sbatch uses when ``--signal`` has no ``@SECONDS``."""


@dataclass(frozen=True)
class NodeRange:
    """How many nodes the job may run on: ``4`` is fixed, ``1:4`` is elastic."""

    min: int
    max: int

    def __post_init__(self) -> None:
        if self.min < 1:
            raise UsageError(
                f"--nodes '{self}' asks for fewer than one node; give N or MIN:MAX with MIN >= 1."
            )
        if self.max < self.min:
            raise UsageError(
                f"--nodes '{self.min}:{self.max}' is inverted; give MIN:MAX with MIN <= MAX, "
                f"for example '{self.max}:{self.min}'."
            )

    @classmethod
    def parse(cls, text: str) -> NodeRange:
        match = _NODES.match(text)
        if match is None:
            raise UsageError(
                f"--nodes '{text}' is not a node count; give N (e.g. '4') or MIN:MAX (e.g. '1:4')."
            )
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        return cls(low, high)

    @property
    def is_elastic(self) -> bool:
        return self.min != self.max

    def __str__(self) -> str:
        return str(self.min) if self.min == self.max else f"{self.min}:{self.max}"


@dataclass(frozen=True)
class PreemptSignal:
    """The warning Slurm sends the agents ``seconds`` before the time limit or a preemption."""

    name: str
    seconds: int

    def __post_init__(self) -> None:
        if self.name not in SIGNALS:
            raise UsageError(
                f"--signal '{self.name}' is not a signal the agent can catch; "
                f"use one of {', '.join(SIGNALS)}, e.g. 'USR2@90'."
            )

    @classmethod
    def parse(cls, text: str) -> PreemptSignal:
        if text.upper().startswith("B:"):
            raise UsageError(
                f"--signal '{text}' would reach only the batch shell, not the agents; "
                f"drop the 'B:' prefix, e.g. '{text[2:]}'."
            )
        match = _SIGNAL.match(text.strip())
        if match is None:
            raise UsageError(
                f"--signal '{text}' is not SIGNAL[@SECONDS]; give e.g. 'USR2@90' "
                "(USR2, 90 seconds before the end)."
            )
        seconds = match.group(2)
        return cls(
            match.group(1).upper(),
            int(seconds) if seconds is not None else SBATCH_DEFAULT_SIGNAL_SECONDS,
        )

    def __str__(self) -> str:
        return f"{self.name}@{self.seconds}"


parse_positive = schema.parse_positive
"""Also here, beside the other parsers, where the commands import them."""
count_parser = schema.count_parser
seconds_parser = schema.seconds_parser


def parse_time(text: str) -> str:
    """A Slurm time limit, checked here so a typo fails before sbatch is even called."""
    value = text.strip()
    if value.upper() in ("INFINITE", "UNLIMITED") or _TIME.match(value):
        return value
    raise UsageError(
        f"--time '{text}' is not a Slurm time; give MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM "
        "or D-HH:MM:SS, e.g. '2:00:00' or '1-12'."
    )


def parse_time_min(text: str) -> str:
    """``--grow-time-min``: a Slurm time, as ``--time`` takes it."""
    try:
        return parse_time(text)
    except UsageError:
        raise UsageError(
            f"--grow-time-min '{text}' is not a Slurm time; give MM, MM:SS, HH:MM:SS, D-HH, "
            "D-HH:MM or D-HH:MM:SS, e.g. '30' or '2:00:00'."
        ) from None


def parse_mem(text: str) -> str:
    """Memory per node as sbatch reads it: a number with an optional K/M/G/T unit (0 = all)."""
    value = text.strip()
    if _MEM.match(value):
        return value.upper()
    raise UsageError(
        f"--mem '{text}' is not a memory size; give a number with an optional unit K, M, G "
        "or T, e.g. '64G' (0 means all of the node's memory)."
    )


def parse_env(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` for the job's environment; the value may be anything, it gets quoted."""
    key, sep, value = text.partition("=")
    if not sep or not _ENV_KEY.match(key):
        raise UsageError(
            f"--env '{text}' is not KEY=VALUE with KEY a shell variable name; "
            "give e.g. 'OMP_NUM_THREADS=8'."
        )
    return key, value


def parse_job_name(text: str) -> str:
    """Job names also name the run id and its directory, so they stay path- and shell-safe."""
    if _JOB_NAME.match(text):
        return text
    raise UsageError(
        f"--job-name '{text}' is not usable; use up to 64 letters, digits, '.', '_' or '-', "
        "starting with a letter or digit."
    )


_AFTER_JOB = re.compile(r"^[1-9]\d{0,17}$")


def parse_after(text: str) -> str:
    """``--after JOB``: the Slurm job id of the job this one waits for (``hpc-elastic list``)."""
    if _AFTER_JOB.match(text.strip()):
        return text.strip()
    raise UsageError(
        f"--after '{text}' is not a Slurm job id; give the number `hpc-elastic submit` printed "
        "(or that `hpc-elastic list` shows), e.g. --after 1234."
    )


def parse_zk(text: str) -> str:
    """``HOST:PORT[,HOST:PORT...][/chroot]``, the ensemble the agents rendezvous through."""
    hosts, slash, chroot = text.strip().partition("/")
    if all(_ZK_HOST.match(host) for host in hosts.split(",")) and (
        not slash or _ZK_CHROOT.match(slash + chroot)
    ):
        return text.strip()
    raise UsageError(
        f"--zk '{text}' is not a ZooKeeper address list; give HOST:PORT[,HOST:PORT...], "
        "e.g. 'zk1:2181,zk2:2181', optionally followed by a chroot like '/hpc-elastic'."
    )


def parse_sbatch_value(option: str, text: str) -> str:
    """Values that land on ``#SBATCH`` lines: a space or newline there would change the job."""
    if not text or any(char.isspace() or not char.isprintable() for char in text):
        raise UsageError(
            f"{option} '{text}' is empty or contains spaces or control characters; "
            "give a single word as sbatch expects."
        )
    return text


_OWNED_LONG_OPTIONS = {
    "array": "--nodes MIN:MAX",
    "nodes": "--nodes",
    "ntasks": "--nproc-per-node",
    "ntasks-per-node": "--nproc-per-node",
    "no-kill": "--nodes",
    "output": "--log-dir",
    "signal": "--signal",
    "requeue": "--requeue",
    "no-requeue": "--no-requeue",
    "job-name": "--job-name",
    "wrap": "SCRIPT",
    "partition": "--partition",
    "account": "--account",
    "qos": "--qos",
    "time": "--time",
    "mem": "--mem",
    "constraint": "--constraint",
    "exclude": "--exclude",
    "gpus-per-node": "--gpus-per-node",
    "cpus-per-task": "--cpus-per-task",
}
"""sbatch options the script sets itself, or that have a flag of their own: passing them
through would break what the agents expect, or silently fight the flag."""

_OWNED_SHORT_OPTIONS = {
    "a": "array",
    "N": "nodes",
    "n": "ntasks",
    "k": "no-kill",
    "o": "output",
    "J": "job-name",
    "p": "partition",
    "A": "account",
    "q": "qos",
    "t": "time",
    "C": "constraint",
    "x": "exclude",
    "c": "cpus-per-task",
}
_SHORT_FLAGS_WITHOUT_VALUE = frozenset("bhHkOQsuvVW")
"""sbatch's short options that take no value: ``-Hk`` is two options, ``-pgpu`` is one."""

_EXACT_SBATCH_OPTIONS = frozenset({"gpus"})
"""Real sbatch options that are also prefixes of an owned one; getopt takes an exact match."""


def owned_sbatch_option(text: str) -> str | None:
    """The owned long option that ``text`` would set as sbatch parses it, or None.

    sbatch reads options with getopt_long, which accepts any unambiguous abbreviation
    (``--outp`` is ``--output``, ``--arr`` is ``--array``) and groups short flags (``-kN4``).
    An abbreviation of an owned option is refused even where it would be ambiguous to sbatch.
    """
    if text.startswith("--"):
        name = text[2:].split("=", 1)[0]
        if not name or name in _EXACT_SBATCH_OPTIONS:
            return None
        return next((owned for owned in _OWNED_LONG_OPTIONS if owned.startswith(name)), None)
    for letter in text[1:]:
        if letter in _OWNED_SHORT_OPTIONS:
            return _OWNED_SHORT_OPTIONS[letter]
        if letter not in _SHORT_FLAGS_WITHOUT_VALUE:
            return None  # the rest of the word is this option's value
    return None


def parse_sbatch_arg(text: str) -> str:
    """A pass-through sbatch option such as ``--reservation=big``, one per ``--sbatch-arg``."""
    parse_sbatch_value("--sbatch-arg", text)
    if not text.startswith("-") or text in ("-", "--"):
        raise UsageError(
            f"--sbatch-arg '{text}' is not an sbatch option; give one option with its value, "
            "e.g. '--reservation=big'."
        )
    owned = owned_sbatch_option(text)
    if owned is not None:
        raise UsageError(
            f"--sbatch-arg '{text}' sets sbatch's --{owned}, which hpc-elastic decides itself; "
            f"use {_OWNED_LONG_OPTIONS[owned]} instead."
        )
    return text


_IFACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,14}$")
_PORT_RANGE = re.compile(r"^\s*(\d{1,5})\s*:\s*(\d{1,5})\s*$")


def parse_iface(text: str) -> str:
    """A network interface name as Linux allows it (at most 15 characters, no slash or space)."""
    if _IFACE.match(text):
        return text
    raise UsageError(
        f"--iface '{text}' is not a network interface name; give one as `ip link` lists it, "
        "e.g. 'ib0' or 'eth0'."
    )


def _one_word(option: str, text: str, example: str) -> str:
    """A value that lands on a shell line as one argument: quoting keeps it one word, but a
    space or newline in an image or a path is far likelier a mistake than a name."""
    if not text or any(char.isspace() or not char.isprintable() for char in text):
        raise UsageError(
            f"{option} {text!r:.200} is empty or contains spaces or control characters; "
            f"give one word, e.g. '{example}'."
        )
    return text


def parse_container_image(text: str) -> str:
    """A pyxis/enroot image, e.g. ``nvcr.io#nvidia/pytorch:24.05-py3`` or a ``.sqsh`` path."""
    return _one_word("--container-image", text, "nvcr.io#nvidia/pytorch:24.05-py3")


def parse_apptainer_image(text: str) -> str:
    """An Apptainer image: a ``.sif`` path or a URI such as ``docker://pytorch/pytorch``."""
    return _one_word("--apptainer", text, "/images/pytorch.sif")


def parse_container_python(text: str) -> str:
    return _one_word("--container-python", text, "python3")


def parse_container_mount(text: str) -> str:
    """``SRC[:DST[:FLAGS]][,...]``, absolute paths: pyxis (``--container-mounts``) and Apptainer
    (``--bind``) both read this form, so one option serves both runtimes."""
    for mount in text.split(","):
        parts = mount.split(":")
        if (
            len(parts) > 3
            or not all(part.startswith("/") for part in parts[:2])
            or any(char.isspace() or not char.isprintable() for char in mount)
        ):
            raise UsageError(
                f"--container-mounts {text!r:.200} is not SRC[:DST[:FLAGS]][,...] with "
                "absolute paths; give e.g. '/datasets' or '/datasets:/data:ro,/models'."
            )
    return text


def mounts_of(values: tuple[str, ...]) -> list[str]:
    """Each ``--container-mounts`` value split into single mounts, ``SRC`` made ``SRC:SRC``:
    pyxis wants a destination, and the same path is what Apptainer gives one without."""
    return [
        mount if ":" in mount else f"{mount}:{mount}"
        for value in values
        for mount in value.split(",")
    ]


def _mounted(path: Path, mounts: tuple[str, ...]) -> bool:
    """Whether ``path``, as the container sees it, lies in one of ``mounts``' destinations."""
    destinations = [Path(mount.split(":")[1]) for mount in mounts_of(mounts)]
    return any(path == where or path.is_relative_to(where) for where in destinations)


def parse_port_range(text: str) -> str:
    """``LOW:HIGH``, both unprivileged ports, LOW <= HIGH: where a site's firewall lets the
    job's nodes reach each other."""
    match = _PORT_RANGE.match(text)
    if match is not None:
        low, high = int(match.group(1)), int(match.group(2))
        if 1024 <= low <= high <= 65535:
            return f"{low}:{high}"
    raise UsageError(
        f"--master-port-range '{text}' is not LOW:HIGH with 1024 <= LOW <= HIGH <= 65535; "
        "give e.g. '29500:29599'."
    )


def parse_setup_line(text: str) -> str:
    """Setup lines are the user's own shell code, one line each, run before the agents start."""
    if "\n" in text or "\r" in text or not text.isprintable():
        raise UsageError(
            f"--setup {text!r} spans several lines or holds control characters; "
            "give one --setup per shell line."
        )
    return text


@dataclass(frozen=True)
class ArrayPart:
    """One Slurm array of an elastic job: its tasks ``first``..``last`` are slots of the same
    run. A job with growth elsewhere (``--grow-partition``/``--grow-qos``) has two: the
    guaranteed slots below MIN, and the growth slots above."""

    name: str
    """``all`` (the only array), ``core`` (the first MIN slots) or ``grow`` (the rest)."""
    first: int
    last: int

    @property
    def range(self) -> str:
        """sbatch's ``--array`` value: ``0-3``, or ``2-3`` for growth slots above MIN 2."""
        return f"{self.first}-{self.last}"


# --- the options' own parsers: what only one option takes ----------------------------------


def parse_notify_url(text: str) -> str:
    """An http(s) webhook (``notify.check_url``) in one printable word: it is exported into the
    job's environment, and a space or newline there would be a different URL."""
    if not text.isprintable() or any(char.isspace() for char in text):
        raise UsageError(
            f"--notify {text!r:.200} contains spaces or control characters; give the webhook's "
            "address, e.g. 'https://hooks.example.com/T000/B000'."
        )
    return check_url(text)


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
        raise schema.WrongTypeError(
            f"must be a path string, not {type(value).__name__} {value!r}; fix the config file."
        )
    return parse_local_dir(value)


def read_environment(value: object, _base: Path) -> object:
    if not isinstance(value, dict) or not all(
        isinstance(item, str | int | float) and not isinstance(item, bool)
        for item in value.values()
    ):
        raise schema.WrongTypeError(
            f'must be a table of KEY = "value", not {type(value).__name__} {value!r}; fix the '
            "config file."
        )
    return tuple(parse_env(f"{key}={item}") for key, item in value.items())


def _check_env(pairs: tuple[tuple[str, str], ...]) -> None:
    for key, value in pairs:
        parse_env(f"{key}={value}")


def _merge_env(defaults: object, flags: object) -> object:
    """``--env`` adds to the file's ``env`` table key by key, the flag's value winning."""
    pairs = {**dict(defaults or ()), **dict(flags or ())}  # type: ignore[call-overload]
    return tuple(pairs.items())


def _check_log_dir(log_dir: Path) -> None:
    """sbatch's ``--output`` takes the log directory: no spaces, no ``%A``-breaking ``\\``."""
    if any(char.isspace() or not char.isprintable() for char in str(log_dir)):
        raise UsageError(
            f"--log-dir {str(log_dir)!r} contains spaces or control characters, which "
            "sbatch cannot take in --output; choose a directory path without them."
        )
    if "\\" in str(log_dir):
        raise UsageError(
            f"--log-dir {str(log_dir)!r} contains a backslash, which turns off the "
            "%A/%a patterns of sbatch's --output; choose a directory path without one."
        )


def _signal_flags(signal: PreemptSignal) -> schema.AgentFlags:
    return (("preempt_signal", signal.name), ("grace", str(signal.seconds)))


def _iface_environment(iface: str | None) -> tuple[tuple[str, str], ...]:
    """gloo and NCCL open their connections on the named interface only; torch's TCPStore
    (MASTER_ADDR:MASTER_PORT) has no such setting and still listens on every interface, which
    docs/security.md states."""
    if iface is None:
        return ()
    return (("GLOO_SOCKET_IFNAME", iface), ("NCCL_SOCKET_IFNAME", iface))


def _word(help: str, *, metavar: str = "NAME", **columns: Any) -> Any:
    """A single word that lands on an ``#SBATCH`` line as ``--<name>=<word>``; unset by default."""

    def columns_for(name: str) -> Mapping[str, Any]:
        flag = schema.flag_of(name)
        return {
            "help": help,
            "metavar": metavar,
            "read": schema.read_text(lambda text: parse_sbatch_value(flag, text)),
            "check": lambda value: parse_sbatch_value(flag, value),
            "sbatch": schema.sbatch_line(f"{flag}={{}}"),
            **columns,
        }

    return schema.declare(columns_for, None)


def _grace_action_flags(value: str) -> schema.AgentFlags:
    return () if value == GRACE_ACTIONS[0] else (("grace_action", value),)


@dataclass(frozen=True)
class JobSpec:
    """Everything ``submit`` needs to know about a job, validated; the renderer trusts it.

    Each field but the script and its arguments is an option of ``submit``, ``render`` and
    the Python API, declared on the field (``hpc_elastic.schema``): name, type and default are
    the field's. The fields' order is the order of ``--help``, of the script's ``#SBATCH``
    lines, of its exported variables and of the agent flags (the reference scripts pin it).
    """

    script: Path
    script_args: tuple[str, ...] = ()
    nodes: NodeRange = schema.text(
        "Fixed N nodes (one allocation) or elastic MIN:MAX (an array of MAX one-node tasks; "
        "training goes on while at least MIN run).",
        NodeRange.parse,
        NodeRange.parse(contract.DEFAULT_NODES),
        numbers=True,
        metavar="N|MIN:MAX",
    )
    spares: int = schema.count(
        "Hot spares: K more array slots whose agents start, prewarm their workers and wait; "
        "one replaces a lost node at once, with no wait in the queue.",
        0,
        metavar="K",
        zero_ok=True,
    )
    """Hot spares: array slots beyond MAX whose agents wait, warm, to replace a lost member."""
    nproc_per_node: int = schema.count(
        "Worker processes per node, usually one per GPU.",
        contract.DEFAULT_NPROC_PER_NODE,
        metavar="P",
    )
    job_name: str = schema.text(
        "Slurm job name.",
        parse_job_name,
        contract.DEFAULT_JOB_NAME,
        metavar="NAME",
        show_default="the script's name",
        decided_late=True,
    )
    partition: str | None = _word("Slurm partition (see `sinfo -s`).")
    account: str | None = _word("Slurm account to charge.")
    qos: str | None = _word("Slurm quality of service.")
    grow_partition: str | None = _word(
        "Run the slots above MIN in this partition, as a second array job of the same run: "
        "the first MIN stay where --partition says.",
        sbatch=None,
        show_default="--partition",
    )
    """Where the slots above MIN run (a second array job), if not in ``partition``."""
    grow_time_min: str | None = schema.text(
        "Submit the slots above MIN with sbatch --time-min TIME, so backfill can fit them into "
        "holes shorter than --time; each leaves through the time-limit path when its time ends.",
        parse_time_min,
        None,
        numbers=True,
        metavar="TIME",
        show_default="none",
    )
    """``sbatch --time-min`` for the slots above MIN: backfill may start them in holes shorter
    than ``--time``, and each leaves through the time-limit path when its time is up."""
    grow_qos: str | None = _word(
        "Run the slots above MIN under this QoS (e.g. a preemptible scavenger), as a second "
        "array job of the same run: when they are preempted the job trains on at MIN.",
        sbatch=None,
        show_default="--qos",
    )
    """The QoS of the slots above MIN (typically a preemptible scavenger), if not ``qos``."""
    time: str | None = schema.text(
        "Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 1-00.",
        parse_time,
        None,
        numbers=True,
        metavar="TIME",
        sbatch=schema.sbatch_line("--time={}"),
    )
    mem: str | None = schema.text(
        "Memory per node, e.g. 64G; 0 = all.",
        parse_mem,
        None,
        numbers=True,
        metavar="SIZE",
        sbatch=schema.sbatch_line("--mem={}"),
    )
    constraint: str | None = _word("Node features, e.g. 'a100'.", metavar="FEATURES")
    exclude: str | None = _word("Nodes to avoid, e.g. 'n[1-3]'.", metavar="NODES")
    gpus_per_node: int | None = schema.count(
        "GPUs per node.", None, sbatch=schema.sbatch_line("--gpus-per-node={}")
    )
    cpus_per_task: int | None = schema.count(
        "CPUs for each node's agent and its workers.",
        None,
        sbatch=schema.sbatch_line("--cpus-per-task={}"),
    )
    requeue: bool = schema.switch(
        "Let Slurm requeue the job (or array task) after preemption or node failure.",
        True,
        sbatch=lambda value: ("--requeue" if value else "--no-requeue",),
    )
    after: str | None = schema.text(
        "Start only after this Slurm job has ended, however it ended (a pipeline's next stage).",
        parse_after,
        None,
        numbers=True,
        metavar="JOB",
        show_default="at once",
        sbatch=schema.sbatch_line("--dependency=afterany:{}"),
    )
    max_restarts: int = schema.count(
        "Worker-failure restarts for the whole job (node changes are free).",
        contract.DEFAULT_MAX_RESTARTS,
        metavar="R",
        zero_ok=True,
        agent=True,
    )
    signal: PreemptSignal = schema.text(
        "Warning signal for the agents and how many seconds before the end (time limit or "
        "preemption) it comes; they checkpoint and stop within that grace.",
        PreemptSignal.parse,
        PreemptSignal.parse(contract.DEFAULT_PREEMPT_SIGNAL),
        metavar="SIG[@SECONDS]",
        sbatch=lambda value: (f"--signal={value}",),
        agent=_signal_flags,
    )
    hang_timeout: float | None = schema.seconds("Restart workers silent this long.", "off")
    last_call: float | None = schema.seconds(
        "Once MIN nodes are in, wait this long for more.", schema.AGENT_DECIDES
    )
    session_timeout: float | None = schema.seconds(
        "ZooKeeper session: how soon a dead node is noticed.", schema.AGENT_DECIDES
    )
    min_wait: float | None = schema.seconds(
        "How long the job may stay below MIN nodes.", schema.AGENT_DECIDES
    )
    zk_outage_limit: float | None = schema.seconds(
        "How long an agent cut off from every ZooKeeper server waits for one before it "
        "leaves the job (exit 69, not requeued).",
        schema.AGENT_DECIDES,
    )
    max_preemptions: int | None = schema.count(
        "Requeues of one slot after preemption before it gives up.",
        None,
        zero_ok=True,
        show_default=schema.AGENT_DECIDES,
        agent=True,
    )
    max_time_limits: int | None = schema.count(
        "Requeues of one slot after its time limit before it gives up.",
        None,
        zero_ok=True,
        show_default=schema.AGENT_DECIDES,
        agent=True,
    )
    exclude_after: int | None = schema.count(
        "Failures of a slot on one node before that slot avoids the node.",
        None,
        show_default=schema.AGENT_DECIDES,
        agent=True,
    )
    expected_gpus: int | None = schema.count(
        "GPUs each node must have to pass the preflight.",
        None,
        zero_ok=True,
        show_default="any",
        agent=True,
    )
    bad_node_ttl: float | None = schema.seconds(
        "Seconds a node that failed its preflight stays excluded.", schema.AGENT_DECIDES
    )
    grace_action: str = schema.text(
        "When a checkpoint save plus a step no longer fit the --signal lead or the "
        "partition's (or QoS's) GraceTime: 'warn' in the events and status, 'lead': also "
        "stop each slot early enough before its time limit, or 'local': also save a stop's "
        "checkpoint to --local-checkpoint-dir only, and to the shared directory at the next "
        "start.",
        parse_grace_action,
        GRACE_ACTIONS[0],
        metavar="warn|lead|local",
        agent=_grace_action_flags,
    )
    """``--grace-action``: what agents do when a save no longer fits (slurm/grace.py)."""
    exclude_stragglers: bool = schema.switch(
        "Move a slot to another node when a rank there straggles.",
        False,
        agent=lambda value: (("exclude_stragglers",),) if value else (),
    )
    prewarm: bool = schema.switch(
        "Keep standby workers with torch imported, so a restart skips the import "
        "(about 250 MB of host memory per worker).",
        contract.DEFAULT_PREWARM,
        agent=lambda value: (("prewarm", "torch"),) if value else (),
    )
    in_place: bool = schema.switch(
        "Keep surviving workers through a restart and hand them the new round; for loops "
        "that use hpc_elastic.train.InPlace.",
        contract.DEFAULT_IN_PLACE,
        agent=lambda value: (("in_place",),) if value else (),
    )
    # The checkpoint settings: the training helpers read them from the environment, so each
    # exports a variable (``contract``) instead of passing an agent flag.
    checkpoint_async: bool = schema.switch(
        "Save checkpoints in the background: training goes on while the copy is written.",
        False,
        environment=schema.exported_unless_default(
            contract.CHECKPOINT_ASYNC_ENV, False, lambda on: "1" if on else "0"
        ),
    )
    checkpoint_when_busy: str = schema.text(
        "What an async save does while the previous one is still being written: wait or skip.",
        parse_when_busy,
        contract.DEFAULT_CHECKPOINT_WHEN_BUSY,
        metavar="wait|skip",
        environment=schema.exported_unless_default(
            contract.CHECKPOINT_WHEN_BUSY_ENV, contract.DEFAULT_CHECKPOINT_WHEN_BUSY
        ),
    )
    keep: int = schema.count(
        "Newest committed checkpoints to keep.",
        contract.DEFAULT_CHECKPOINT_KEEP,
        environment=schema.exported_unless_default(
            contract.CHECKPOINT_KEEP_ENV, contract.DEFAULT_CHECKPOINT_KEEP
        ),
    )
    keep_every: int = schema.count(
        "Also keep every checkpoint whose step is a multiple of N (0: none).",
        contract.DEFAULT_CHECKPOINT_KEEP_EVERY,
        zero_ok=True,
        environment=schema.exported_unless_default(
            contract.CHECKPOINT_KEEP_EVERY_ENV, contract.DEFAULT_CHECKPOINT_KEEP_EVERY
        ),
    )
    local_checkpoint_dir: Path | None = schema.option(
        "A node-local directory for fast checkpoints; every --persist-every-th one is copied "
        "to the job's checkpoint directory.",
        None,
        parse=parse_local_dir,
        read=read_local_dir,
        metavar="DIR",
        show_default="none",
        environment=schema.exported(contract.LOCAL_CHECKPOINT_DIR_ENV),
    )
    persist_every: int = schema.count(
        "With --local-checkpoint-dir: copy every Nth checkpoint to the shared directory.",
        contract.DEFAULT_PERSIST_EVERY,
        environment=schema.exported_unless_default(
            contract.PERSIST_EVERY_ENV, contract.DEFAULT_PERSIST_EVERY
        ),
    )
    setup: tuple[str, ...] = schema.lines(
        "A shell line run before the agents start, e.g. 'module load cuda'. Repeatable.",
        parse_setup_line,
        metavar="LINE",
    )
    env: tuple[tuple[str, str], ...] = schema.option(
        "Set a variable for the job. Repeatable.",
        (),
        item=parse_env,
        read=read_environment,
        check=_check_env,
        metavar="KEY=VALUE",
        combine=_merge_env,
    )
    log_dir: Path = schema.path(
        "Where each run gets its own directory (script, secret, Slurm logs).",
        contract.DEFAULT_RUNS_DIR,
        check=_check_log_dir,
        metavar="DIR",
    )
    snapshot: bool = schema.switch(
        "Copy the script's project (git-tracked and untracked-but-not-ignored files, else the "
        "script's directory) into the job directory; every slot and requeue runs that copy.",
        True,
    )
    snapshot_max_mb: int = schema.count(
        "The largest code snapshot to copy, in MB; a bigger project is refused.",
        contract.DEFAULT_SNAPSHOT_MAX_MB,
        metavar="MB",
    )
    snapshot_max_files: int = schema.count(
        "The most files a code snapshot copies; a project with more is refused.",
        contract.DEFAULT_SNAPSHOT_MAX_FILES,
    )
    snapshot_root: Path | None = schema.path(
        "The directory to snapshot instead of the script's project: it must hold the script "
        "(git's rules apply if it is a work tree's top). Never a home directory.",
        metavar="DIR",
        show_default="the script's project",
    )
    template: Path | None = schema.path(
        "Your own Jinja2 sbatch template; it may {% extends 'elastic.sh.j2' %}.",
        metavar="PATH",
    )
    zk: str = schema.text(
        f"ZooKeeper for the rendezvous; ${contract.ZK_ENV}, the config file and your own "
        "ensemble (zk start) beat this default.",
        parse_zk,
        contract.DEFAULT_ZK,
        metavar="HOST:PORT[,...]",
    )
    sbatch_args: tuple[str, ...] = schema.lines(
        "Any other sbatch option, e.g. '--reservation=big'. Repeatable.",
        parse_sbatch_arg,
        metavar="OPTION",
        flag="--sbatch-arg",
        sbatch=tuple,
    )
    iface: str | None = schema.text(
        "The job's network interface (e.g. ib0): gloo and NCCL use only that one.",
        parse_iface,
        None,
        metavar="NAME",
        show_default="any",
        environment=_iface_environment,
    )
    master_port_range: str | None = schema.text(
        "Ports for the workers' MASTER_PORT, e.g. 29500:29599, for a site firewall.",
        parse_port_range,
        None,
        metavar="LOW:HIGH",
        show_default="a free port below the ephemeral range",
        environment=schema.exported(contract.MASTER_PORTS_ENV),
    )
    notify: str | None = schema.text(
        "Web hook the agents post JSON to when the job fails or finishes. Often a secret "
        f"itself: prefer ${contract.NOTIFY_URL_ENV} or --notify-file to this flag.",
        parse_notify_url,
        None,
        metavar="URL",
        show_default="none",
        environment=schema.exported(contract.NOTIFY_URL_ENV),
        envvar=contract.NOTIFY_URL_ENV,
    )
    # Containers: no ``sbatch`` or ``agent`` column; the renderer puts the image on the srun
    # line (pyxis) or in front of the worker command (Apptainer); see ``render.py``.
    container_image: str | None = schema.text(
        "Run each node's srun step in this image with pyxis (srun --container-image): the "
        "agent runs there too, so the image needs hpc-elastic and the Slurm commands.",
        parse_container_image,
        None,
        metavar="IMAGE",
        show_default="none",
    )
    apptainer: str | None = schema.text(
        "Run the workers in this Apptainer image (apptainer exec --nv); the agent stays "
        "outside, in --python.",
        parse_apptainer_image,
        None,
        metavar="IMAGE",
        show_default="none",
    )
    container_mounts: tuple[str, ...] = schema.lines(
        "Also mount these in the container (the job and script directories always are). "
        "Repeatable.",
        parse_container_mount,
        item=parse_container_mount,
        metavar="SRC[:DST[:FLAGS]][,...]",
    )
    container_python: str = schema.text(
        "The Python inside the image: it runs the workers (with --container-image, the agent too).",
        parse_container_python,
        contract.DEFAULT_CONTAINER_PYTHON,
        metavar="PATH",
    )

    def __post_init__(self) -> None:
        """Each value as its flag would take it (the options' ``check``), then the rules that
        join several."""
        for option in OPTIONS:
            value = getattr(self, option.name)
            if option.check is not None and value is not None:
                option.check(value)
        self._check_agent_knobs()
        self._check_containers()
        self._check_growth()

    def _check_growth(self) -> None:
        """Growth elsewhere needs slots above MIN, and somewhere else for them to run."""
        given = self.growth_options()
        if not given:
            return
        option, value = given[0]
        if self.array_size <= self.nodes.min:
            raise UsageError(
                f"{option} '{value}' places the slots above MIN, but --nodes {self.nodes} "
                "has none; give --nodes MIN:MAX (or --spares K)."
            )
        elsewhere = self.grow_partition not in (None, self.partition) or self.grow_qos not in (
            None,
            self.qos,
        )
        if not elsewhere and self.grow_time_min is None:
            raise UsageError(
                f"{option} '{value}' is where the guaranteed slots run already; give the "
                "partition or QoS the slots above MIN should use instead, or drop it."
            )

    def _check_agent_knobs(self) -> None:
        """The rules of the values that become ``hpc-elastic agent`` flags that one value's
        check cannot make."""
        if self.zk_outage_limit == 0:
            raise UsageError(
                "--zk-outage-limit '0' would end the agents at the first lost connection; give "
                "the seconds an outage of ZooKeeper may last (e.g. 300)."
            )
        if self.grace_action == "local" and self.local_checkpoint_dir is None:
            raise UsageError(
                "--grace-action 'local' saves a stop's checkpoint to the node-local tier, but "
                "the job has none; add --local-checkpoint-dir DIR (a directory on each node's "
                "own disk), or give --grace-action warn or lead."
            )
        if self.grace_action == "local" and self.signal.name not in ("USR1", "USR2"):
            raise UsageError(
                f"--grace-action 'local' tells a preemption or time limit from a cancel by "
                f"--signal's USR1 or USR2, but the job's --signal is '{self.signal}', which "
                "scancel's TERM cannot be told from; give e.g. --signal USR2@90."
            )

    def _check_containers(self) -> None:
        """One runtime at most; mounts and an interpreter only with an image to use them in."""
        if self.container_image is not None and self.apptainer is not None:
            raise UsageError(
                f"--container-image '{self.container_image}' and --apptainer "
                f"'{self.apptainer}' are two container runtimes for one job; give only one."
            )
        if self.container is None and (
            self.container_mounts or self.container_python != contract.DEFAULT_CONTAINER_PYTHON
        ):
            given = (
                f"--container-mounts '{self.container_mounts[0]}'"
                if self.container_mounts
                else f"--container-python '{self.container_python}'"
            )
            raise UsageError(
                f"{given} applies inside a container, but the job has none; add "
                "--container-image IMAGE (pyxis) or --apptainer IMAGE."
            )

        local = self.local_checkpoint_dir
        if (
            self.container is not None
            and local is not None
            and not _mounted(local, self.container_mounts)
        ):
            raise UsageError(
                f"--local-checkpoint-dir '{local}' is not mounted in the container, so "
                "checkpoints written there would vanish with it; add "
                f"--container-mounts {local}."
            )

    @property
    def container(self) -> str | None:
        """The job's container runtime: ``pyxis``, ``apptainer``, or None."""
        if self.container_image is not None:
            return "pyxis"
        return "apptainer" if self.apptainer is not None else None

    @property
    def is_array(self) -> bool:
        """One array of one-node tasks (elastic, or any job with hot spares), rather than
        one allocation: a spare must start, wait and replace a node on its own."""
        return self.nodes.is_elastic or self.spares > 0

    @property
    def array_size(self) -> int:
        """The array's tasks: MAX slots that train and the hot spares beside them."""
        return self.nodes.max + self.spares

    @property
    def grows_elsewhere(self) -> bool:
        """Whether the slots above MIN are a second array job, on ``--grow-partition`` or
        ``--grow-qos`` (Slurm gives every task of one array the same partition and QoS)."""
        return self.is_array and bool(self.growth_options())

    def array_parts(self) -> tuple[ArrayPart, ...]:
        """The job's arrays: one of every slot, or the first MIN slots and the rest (hot
        spares included: a spare is a slot the job may lose without stopping)."""
        last = self.array_size - 1
        if not self.grows_elsewhere:
            return (ArrayPart("all", 0, last),)
        core = self.nodes.min
        return (ArrayPart("core", 0, core - 1), ArrayPart("grow", core, last))

    def for_part(self, part: ArrayPart) -> JobSpec:
        """The spec one array is submitted with: the growth array takes ``--grow-partition``
        and ``--grow-qos`` as its partition and QoS."""
        if part.name != "grow":
            return self
        time_min = () if self.grow_time_min is None else (f"--time-min={self.grow_time_min}",)
        return replace(
            self,
            partition=self.grow_partition or self.partition,
            qos=self.grow_qos or self.qos,
            grow_partition=None,
            grow_qos=None,
            grow_time_min=None,
            sbatch_args=(*self.sbatch_args, *time_min),
        )

    def growth_options(self) -> tuple[tuple[str, str], ...]:
        """The growth settings the user gave, as (option, value)."""
        values = (
            ("--grow-partition", self.grow_partition),
            ("--grow-qos", self.grow_qos),
            ("--grow-time-min", self.grow_time_min),
        )
        return tuple((option, value) for option, value in values if value is not None)

    def values(self) -> dict[str, object]:
        """Field name -> value, as the option table's ``sbatch`` and ``agent`` columns read them."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


OPTIONS = schema.options_of(JobSpec)
"""``JobSpec``'s options, in field order (``options.SUBMIT_OPTIONS`` places the command line's
own among them)."""


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
    return name or contract.DEFAULT_JOB_NAME
