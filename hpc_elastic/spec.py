"""Specs: frozen dataclasses that validate themselves, so a bad value fails where it is parsed.

The parsers here (``NodeRange.parse``, ``parse_time``, ...) are what the CLI passes to Typer as
``parser=`` and what the config file's values go through, so a flag and a config key are held
to the same rules and say the same sentence when they are wrong.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from hpc_elastic import contract
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


@dataclass(frozen=True)
class JobSpec:
    """Everything ``submit`` needs to know about a job, validated; the renderer trusts it."""

    script: Path
    script_args: tuple[str, ...] = ()
    nodes: NodeRange = NodeRange(1, 1)
    spares: int = 0
    """Hot spares: array slots beyond MAX whose agents wait, warm, to replace a lost member."""
    nproc_per_node: int = 1
    job_name: str = "job"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    grow_partition: str | None = None
    """Where the slots above MIN run (a second array job), if not in ``partition``."""
    grow_qos: str | None = None
    """The QoS of the slots above MIN (typically a preemptible scavenger), if not ``qos``."""
    grow_time_min: str | None = None
    """``sbatch --time-min`` for the slots above MIN: backfill may start them in holes shorter
    than ``--time``, and each leaves through the time-limit path when its time is up."""
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
    zk_outage_limit: float | None = None
    max_preemptions: int | None = None
    max_time_limits: int | None = None
    exclude_after: int | None = None
    expected_gpus: int | None = None
    bad_node_ttl: float | None = None
    exclude_stragglers: bool = False
    grace_action: str = "warn"
    """``--grace-action``: what agents do when a save no longer fits (slurm/grace.py)."""
    prewarm: bool = True
    in_place: bool = False
    checkpoint_async: bool = False
    checkpoint_when_busy: str = contract.DEFAULT_CHECKPOINT_WHEN_BUSY
    keep: int = contract.DEFAULT_CHECKPOINT_KEEP
    keep_every: int = contract.DEFAULT_CHECKPOINT_KEEP_EVERY
    local_checkpoint_dir: Path | None = None
    persist_every: int = contract.DEFAULT_PERSIST_EVERY
    iface: str | None = None
    master_port_range: str | None = None
    notify: str | None = None
    after: str | None = None
    container_image: str | None = None
    apptainer: str | None = None
    container_mounts: tuple[str, ...] = ()
    container_python: str = contract.DEFAULT_CONTAINER_PYTHON
    snapshot: bool = True
    snapshot_max_mb: int = contract.DEFAULT_SNAPSHOT_MAX_MB
    snapshot_max_files: int = contract.DEFAULT_SNAPSHOT_MAX_FILES
    snapshot_root: Path | None = None

    def __post_init__(self) -> None:
        parse_positive("--nproc-per-node", self.nproc_per_node)
        parse_positive("--spares", self.spares, zero_ok=True)
        parse_positive("--max-restarts", self.max_restarts, zero_ok=True)
        parse_positive("--snapshot-max-files", self.snapshot_max_files)
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
        if self.grow_time_min is not None:
            parse_time_min(self.grow_time_min)
        if self.mem is not None:
            parse_mem(self.mem)
        self._check_log_dir()
        self._check_passthrough()
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

    def _check_log_dir(self) -> None:
        """sbatch's ``--output`` takes the log directory: no spaces, no ``%A``-breaking ``\\``."""
        if any(char.isspace() or not char.isprintable() for char in str(self.log_dir)):
            raise UsageError(
                f"--log-dir {str(self.log_dir)!r} contains spaces or control characters, which "
                "sbatch cannot take in --output; choose a directory path without them."
            )
        if "\\" in str(self.log_dir):
            raise UsageError(
                f"--log-dir {str(self.log_dir)!r} contains a backslash, which turns off the "
                "%A/%a patterns of sbatch's --output; choose a directory path without one."
            )

    def _check_passthrough(self) -> None:
        """What goes verbatim into the script: ``#SBATCH`` values, setup lines, exports."""
        for option, value in self.sbatch_values():
            parse_sbatch_value(option, value)
        for arg in self.sbatch_args:
            parse_sbatch_arg(arg)
        for line in self.setup:
            parse_setup_line(line)
        for key, value in self.env:
            parse_env(f"{key}={value}")

    def _check_agent_knobs(self) -> None:
        """The values that become ``hpc-elastic agent`` flags."""
        if self.iface is not None:
            parse_iface(self.iface)
        if self.master_port_range is not None:
            parse_port_range(self.master_port_range)
        if self.after is not None:
            parse_after(self.after)
        for option, count in self.agent_counts():
            parse_positive(option, count, zero_ok=option != "--exclude-after")
        for option, seconds in self.agent_timeouts():
            if seconds < 0:
                raise UsageError(f"{option} '{seconds}' is negative; give 0 or more seconds.")
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
        if self.container_image is not None:
            parse_container_image(self.container_image)
        if self.apptainer is not None:
            parse_apptainer_image(self.apptainer)
        for mount in self.container_mounts:
            parse_container_mount(mount)
        parse_container_python(self.container_python)
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

    def sbatch_values(self) -> tuple[tuple[str, str], ...]:
        """The optional ``#SBATCH`` settings the user gave, as (option, value)."""
        values = (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--qos", self.qos),
            ("--grow-partition", self.grow_partition),
            ("--grow-qos", self.grow_qos),
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
            ("--zk-outage-limit", self.zk_outage_limit),
        )
        return tuple((option, value) for option, value in values if value is not None)


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
