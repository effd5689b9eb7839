"""Specs: frozen dataclasses that validate themselves, so a bad value fails where it is parsed.

The parsers here (``NodeRange.parse``, ``parse_time``, ...) are what the CLI passes to Typer as
``parser=`` and what the config file's values go through, so a flag and a config key are held
to the same rules and say the same sentence when they are wrong.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.errors import UsageError

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


def parse_positive(option: str, value: int, *, zero_ok: bool = False) -> int:
    """Counts like --nproc-per-node: Typer checks it is an int, this checks it makes sense."""
    if value < 0 or (value == 0 and not zero_ok):
        bound = "0 or more" if zero_ok else "1 or more"
        raise UsageError(f"{option} '{value}' is out of range; give {bound}.")
    return value


def count_parser(option: str, *, zero_ok: bool = False) -> Callable[[str], int]:
    """A Typer ``parser=`` for counts, so '--nproc-per-node x' quotes 'x' like every other error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{option} '{text}' is not a whole number; give e.g. '4'.") from None
        return parse_positive(option, value, zero_ok=zero_ok)

    return parse


def seconds_parser(option: str) -> Callable[[str], float]:
    """A Typer ``parser=`` for durations in seconds (fractions allowed)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(
                f"{option} '{text}' is not a number of seconds; give e.g. '30'."
            ) from None
        if not value >= 0:
            raise UsageError(f"{option} '{text}' is negative; give 0 or more seconds.")
        return value

    return parse


def parse_time(text: str) -> str:
    """A Slurm time limit, checked here so a typo fails before sbatch is even called."""
    value = text.strip()
    if value.upper() in ("INFINITE", "UNLIMITED") or _TIME.match(value):
        return value
    raise UsageError(
        f"--time '{text}' is not a Slurm time; give MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM "
        "or D-HH:MM:SS, e.g. '2:00:00' or '1-12'."
    )


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


_OWNED_SBATCH_OPTIONS = {
    "--array": "--nodes MIN:MAX",
    "--nodes": "--nodes",
    "-N": "--nodes",
    "--ntasks": "--nproc-per-node",
    "-n": "--nproc-per-node",
    "--ntasks-per-node": "--nproc-per-node",
    "--no-kill": "--nodes",
    "--output": "--log-dir",
    "-o": "--log-dir",
    "--signal": "--signal",
    "--requeue": "--requeue",
    "--no-requeue": "--no-requeue",
    "--job-name": "--job-name",
    "-J": "--job-name",
    "--wrap": "SCRIPT",
}
"""sbatch options that shape the job; passing them through would break what the agents expect."""


def parse_sbatch_arg(text: str) -> str:
    """A pass-through sbatch option such as ``--reservation=big``, one per ``--sbatch-arg``."""
    parse_sbatch_value("--sbatch-arg", text)
    if not text.startswith("-"):
        raise UsageError(
            f"--sbatch-arg '{text}' is not an sbatch option; give one option with its value, "
            "e.g. '--reservation=big'."
        )
    name = text.split("=", 1)[0] if text.startswith("--") else text[:2]
    if name in _OWNED_SBATCH_OPTIONS:
        raise UsageError(
            f"--sbatch-arg '{text}' sets what hpc-elastic decides itself; "
            f"use {_OWNED_SBATCH_OPTIONS[name]} instead."
        )
    return text


def parse_setup_line(text: str) -> str:
    """Setup lines are the user's own shell code, one line each, run before the agents start."""
    if "\n" in text or "\r" in text or not text.isprintable():
        raise UsageError(
            f"--setup {text!r} spans several lines or holds control characters; "
            "give one --setup per shell line."
        )
    return text


@dataclass(frozen=True)
class JobSpec:
    """Everything ``submit`` needs to know about a job, validated; the renderer trusts it."""

    script: Path
    script_args: tuple[str, ...] = ()
    nodes: NodeRange = NodeRange(1, 1)
    nproc_per_node: int = 1
    job_name: str = "job"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    requeue: bool = True
    signal: PreemptSignal = PreemptSignal("USR2", 90)
    setup: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    log_dir: Path = Path("hpc-elastic-runs")
    template: Path | None = None
    max_restarts: int = 3
    zk: str = "127.0.0.1:2181"
    sbatch_args: tuple[str, ...] = ()
    hang_timeout: float | None = None
    last_call: float | None = None
    session_timeout: float | None = None
    min_wait: float | None = None
    max_preemptions: int | None = None
    max_time_limits: int | None = None
    exclude_after: int | None = None
    prewarm: bool = True

    def __post_init__(self) -> None:
        parse_positive("--nproc-per-node", self.nproc_per_node)
        parse_positive("--max-restarts", self.max_restarts, zero_ok=True)
        parse_job_name(self.job_name)
        parse_zk(self.zk)
        for option, count in (
            ("--gpus-per-node", self.gpus_per_node),
            ("--cpus-per-task", self.cpus_per_task),
        ):
            if count is not None:
                parse_positive(option, count)
        if self.time is not None:
            parse_time(self.time)
        if self.mem is not None:
            parse_mem(self.mem)
        if any(char.isspace() or not char.isprintable() for char in str(self.log_dir)):
            raise UsageError(
                f"--log-dir {str(self.log_dir)!r} contains spaces or control characters, which "
                "sbatch cannot take in --output; choose a directory path without them."
            )
        for option, value in self.sbatch_values():
            parse_sbatch_value(option, value)
        for arg in self.sbatch_args:
            parse_sbatch_arg(arg)
        for line in self.setup:
            parse_setup_line(line)
        for key, value in self.env:
            parse_env(f"{key}={value}")
        for option, count in self.agent_counts():
            parse_positive(option, count, zero_ok=option != "--exclude-after")
        for option, seconds in self.agent_timeouts():
            if seconds < 0:
                raise UsageError(f"{option} '{seconds}' is negative; give 0 or more seconds.")

    def sbatch_values(self) -> tuple[tuple[str, str], ...]:
        """The optional ``#SBATCH`` settings the user gave, as (option, value)."""
        values = (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--qos", self.qos),
            ("--time", self.time),
            ("--mem", self.mem),
            ("--constraint", self.constraint),
            ("--exclude", self.exclude),
            ("--gpus-per-node", None if self.gpus_per_node is None else str(self.gpus_per_node)),
            ("--cpus-per-task", None if self.cpus_per_task is None else str(self.cpus_per_task)),
        )
        return tuple((option, value) for option, value in values if value is not None)

    def agent_counts(self) -> tuple[tuple[str, int], ...]:
        """The optional per-slot requeue budgets the user set, as (flag, count)."""
        values = (
            ("--max-preemptions", self.max_preemptions),
            ("--max-time-limits", self.max_time_limits),
            ("--exclude-after", self.exclude_after),
        )
        return tuple((option, value) for option, value in values if value is not None)

    def agent_timeouts(self) -> tuple[tuple[str, float], ...]:
        """The optional agent knobs the user set, as (flag, seconds)."""
        values = (
            ("--hang-timeout", self.hang_timeout),
            ("--last-call", self.last_call),
            ("--session-timeout", self.session_timeout),
            ("--min-wait", self.min_wait),
        )
        return tuple((option, value) for option, value in values if value is not None)
