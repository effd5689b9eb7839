"""A job's directory and its record: where every file of a run lives, and ``job.json``.

A job directory holds everything one run needs and leaves behind::

    <log-dir>/<run-id>/   mode 0700: only the job's user may list or enter it
        secret        per-job ZooKeeper secret, mode 0600; never on a command line or in the script
        checkpoint-key  the user's checkpoint key, mode 0600, which the workers seal with
        sbatch.sh     the script exactly as submitted, mode 0600 (it carries the --env values)
        sbatch-grow.sh  the growth slots' array script, with --grow-partition/--grow-qos (0600)
        job.json      the job record (``JobRecord``); mode 0600
        events.jsonl  what happened, one JSON line per event, appended by agents and runner
        logs/         agent_<slot>.log (local mode), attempt_<round>/rank_<rank>.log (workers)
        checkpoints/  what the training helpers save, unless the script says otherwise
        slots/        the requeue ledger of each elastic slot, <array task id>.json
        code/         the code snapshot: the script's project as submitted (``snapshot``)
        heartbeat.json  the job's heartbeat (``write_beat``), for ``hpc-elastic watch``
        slurm-*.out   Slurm's output, one file per array task (elastic) or per job (fixed)

``JobDir`` names those paths (modelled on submitit's ``JobPaths``) and nothing else: no I/O,
no torch, so the CLI, ``ops`` and the agent can all share it. ``JobRecord`` is ``job.json`` for
``submit`` and for local mode alike, written by ``write`` and read back, checked field by
field, by ``load``: nothing in a ``job.json`` is trusted, since what it names reaches
``scancel``, ``kill`` and ZooKeeper.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_elastic import contract, events, trust
from hpc_elastic.errors import UsageError
from hpc_elastic.notify import check_url
from hpc_elastic.spec import NodeRange, PreemptSignal, parse_zk

JOB_FILE = contract.JOB_FILE
SECRET_FILE = contract.SECRET_FILE
SCRIPT_FILE = contract.SCRIPT_FILE
EVENTS_FILE = contract.EVENTS_FILE

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
"""The job directory and its files are the user's alone whatever the umask: the script and
job.json carry ``--env`` values, which may be tokens, and the directory holds the secret."""

LOG_DIR_MODE = 0o755
"""The most a log directory we make may allow (the umask may narrow it): nobody else writes it."""

_log = logging.getLogger(__name__)
_JOB_ID = re.compile(r"^[1-9]\d{0,17}$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
"""A full SHA-1 or SHA-256 object name, as ``git rev-parse HEAD`` prints it."""


@dataclass(frozen=True)
class JobDir:
    """The paths of one job directory; one property per file or folder."""

    path: Path

    @classmethod
    def under(cls, log_dir: Path, run_id: str) -> JobDir:
        return cls(log_dir.absolute() / run_id)

    @property
    def record(self) -> Path:
        return self.path / JOB_FILE

    @property
    def secret(self) -> Path:
        return self.path / SECRET_FILE

    @property
    def checkpoint_key(self) -> Path:
        return self.path / contract.CHECKPOINT_KEY_FILE

    @property
    def sbatch_script(self) -> Path:
        return self.path / SCRIPT_FILE

    @property
    def grow_sbatch_script(self) -> Path:
        """The growth slots' array script (``--grow-partition``/``--grow-qos``)."""
        return self.path / contract.GROW_SCRIPT_FILE

    @property
    def events(self) -> Path:
        return self.path / EVENTS_FILE

    @property
    def logs(self) -> Path:
        return self.path / contract.LOGS_DIR

    @property
    def checkpoints(self) -> Path:
        return self.path / contract.CHECKPOINTS_DIR

    @property
    def slots(self) -> Path:
        return self.path / contract.SLOTS_DIR

    @property
    def code(self) -> Path:
        """The code snapshot; the rendered script runs the copy of the script in it."""
        return self.path / contract.CODE_DIR

    def agent_log(self, slot: str) -> Path:
        """A local-mode agent's own output (Slurm's agents write to ``slurm-*.out``)."""
        return self.logs / f"agent_{slot}.log"

    def attempt(self, number: int) -> Path:
        """The workers' logs and error files of rendezvous round ``number``."""
        return self.logs / f"attempt_{number}"

    def nccl_trace_prefix(self, number: int) -> Path:
        """Where NCCL's flight recorder dumps on a timeout: torch appends the rank to it
        (``TORCH_FR_DUMP_TEMP_FILE``), so each rank's trace lies beside its log."""
        return self.attempt(number) / "nccl_trace_rank_"

    @property
    def rank_logs(self) -> str:
        """A glob, relative to ``logs``, matching every rank's log of every attempt."""
        return "attempt_*/rank_*.log"

    def slot_ledger(self, array_task_id: int | str) -> Path:
        return self.slots / f"{array_task_id}.json"

    def hold_record(self, array_task_id: int | str) -> Path:
        """How often slot ``array_task_id`` was released from a Slurm hold, and at what
        progress (slurm/holds.py's no-progress breaker for releases)."""
        return self.slots / f"{array_task_id}.holds.json"

    @property
    def drained(self) -> Path:
        """The nodes Slurm drains, as one agent of the job last asked (slurm/drain.py): every
        other agent reads it instead of asking Slurm itself."""
        return self.slots / "drained.json"

    @property
    def queue_board(self) -> Path:
        """How many slots run or start, as the job's lowest running slot last asked squeue
        (slurm/queue.py's ``QueueBoard``): the other agents of a large job read it instead."""
        return self.slots / "queue.json"

    @property
    def local_first(self) -> Path:
        """Created once a save no longer fits under ``--grace-action local``: the job's stop
        saves go to the node-local tier first (``contract.LOCAL_FIRST_FILE``)."""
        return self.slots / contract.LOCAL_FIRST_FILE

    def hold_alert(self, array_task_id: int | str, hold: int) -> Path:
        """Created once by the agent that reports hold number ``hold`` of the slot: the
        marker that keeps every other agent, and every later incarnation, from repeating it."""
        return self.slots / f"{array_task_id}.held-{hold}"

    def slurm_output(self, job_id: str, *, elastic: bool) -> Path:
        """Where the built-in templates' ``--output`` puts Slurm's output (a glob if elastic)."""
        return self.path / (f"slurm-{job_id}_*.out" if elastic else f"slurm-{job_id}.out")


def index_file(environ: Mapping[str, str] = os.environ) -> Path:
    """The user's index of job directories: ``$HPC_ELASTIC_INDEX``, else under the XDG state
    directory. Private to the user like the job directories it names."""
    configured = environ.get(contract.INDEX_ENV)
    if configured:
        return Path(configured)
    state = environ.get("XDG_STATE_HOME") or str(Path("~/.local/state").expanduser())
    return Path(state) / "hpc-elastic" / "jobs"


def register(job_dir: Path, environ: Mapping[str, str] = os.environ) -> None:
    """Append ``job_dir`` to the index, one absolute path a line; best effort: a job whose
    index entry could not be written still runs, and ``--log-dir`` still finds it."""
    path = index_file(environ)
    try:
        path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE)
        with os.fdopen(descriptor, "a") as index:
            index.write(f"{job_dir.absolute()}\n")
    except OSError as error:
        _log.debug("could not note %s in the job index %s: %s", job_dir, path, error)


def indexed(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """The indexed job directories, newest first, each once; gone ones are left to the caller
    (``JobRecord.load`` checks each record as if it came from anywhere)."""
    try:
        lines = index_file(environ).read_text(errors="replace").splitlines()
    except OSError:
        return []
    newest_first = [Path(line) for line in reversed(lines) if line.startswith("/")]
    return list(dict.fromkeys(newest_first))


def make_private_dir(path: Path) -> None:
    """``path`` and missing parents; ``path`` itself 0700, the parents as ``make_log_dir``."""
    make_log_dir(path.parent)
    path.mkdir(mode=PRIVATE_DIR_MODE)
    path.chmod(PRIVATE_DIR_MODE)


def make_log_dir(path: Path) -> None:
    """``path`` and its missing parents, each made no wider than 0755 whatever the umask:
    whoever may write a log directory may rename the job directories in it."""
    missing = []
    for directory in (path, *path.parents):
        if os.path.lexists(directory):
            break
        missing.append(directory)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by another process meanwhile
            directory.mkdir(mode=LOG_DIR_MODE)


def job_dir_problem(path: Path) -> str | None:
    """Why ``path`` is not a job directory of this user's alone, or None: it must be a real
    directory (not a link), owned by us, mode 0700. Anyone who may rename entries in the log
    directory could otherwise put a directory of theirs in its place, with their code in
    ``code/`` and a link to our secret, between ``submit`` and the moment a slot starts."""
    return trust.private_dir_problem(path)


def untrusted_job_dir(path: Path, reason: str) -> str:
    """The sentence that refuses job directory ``path`` for ``reason``."""
    return (
        f"Job directory '{path}' is not trusted because {reason}; someone may have put a "
        "directory of theirs in its place, so nothing in it is run or read: check who may "
        f"rename entries in '{path.parent}', and run the job again under a --log-dir that "
        "only you can write."
    )


def ensure_job_dir(path: Path) -> str | None:
    """Make ``path`` (0700) if it is missing, as an agent started by hand may find it; then
    ``job_dir_problem``. Another agent of the job making it at the same moment is no fault."""
    if not os.path.lexists(path):
        with contextlib.suppress(FileExistsError):
            make_private_dir(path)
    return job_dir_problem(path)


def write_private(path: Path, text: str, *, exclusive: bool = False) -> None:
    """Write ``text`` to ``path`` created 0600, so it is never readable by others, not even
    for the moment between creating and chmod-ing it."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    descriptor = os.open(path, flags, PRIVATE_FILE_MODE)
    with os.fdopen(descriptor, "w") as file:
        os.fchmod(file.fileno(), PRIVATE_FILE_MODE)
        file.write(text)


def write_private_bytes(path: Path, data: bytes) -> None:
    """``write_private`` for bytes (a pickle): created 0600, never readable by others."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    with os.fdopen(descriptor, "wb") as file:
        os.fchmod(file.fileno(), PRIVATE_FILE_MODE)
        file.write(data)


# --- the job's heartbeat: written by one agent, read by ``hpc-elastic watch`` ---------------

BEAT_FILE = "heartbeat.json"
"""The job's heartbeat, in its job directory: ``{"at": time, "step": step, "slot": slot}``."""
BEAT_S = 10.0
"""Seconds between two writes of the job's heartbeat by the agent that writes it."""


def write_beat(job_dir: Path, now: float, step: int | None, slot: str) -> None:
    """Replace the job's heartbeat at once (a reader never sees half of it), mode 0600."""
    scratch = job_dir / f".{BEAT_FILE}.{os.getpid()}"
    write_private(scratch, json.dumps({"at": now, "step": step, "slot": slot}))
    scratch.replace(job_dir / BEAT_FILE)


@dataclass(frozen=True)
class Beat:
    at: float
    step: int | None


def read_beat(job_dir: Path) -> Beat | None:
    """The job's heartbeat, or None: none yet (an older version, no agent ever ran), or one
    that is not as written (any process of the user may write the job directory)."""
    try:
        raw = json.loads((job_dir / BEAT_FILE).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    at, step = (raw.get("at"), raw.get("step")) if isinstance(raw, dict) else (None, None)
    if not isinstance(at, int | float) or isinstance(at, bool):
        return None
    ok_step = isinstance(step, int) and not isinstance(step, bool)
    return Beat(float(at), step if ok_step else None)


@dataclass(frozen=True)
class CodeSnapshot:
    """What ``job.json`` says of the job's code snapshot (``hpc_elastic.snapshot``)."""

    dir: Path
    """The copy, inside the job directory."""
    source: Path
    """The project it was copied from."""
    git: bool
    commit: str | None
    """The commit checked out when the job was submitted; None outside git (or no commit)."""
    dirty: bool | None
    """Whether the copy held changes the commit lacks; None outside git."""
    files: int
    bytes: int

    def version(self) -> str:
        """Which code, in the words ``submit`` and ``status`` both print: ``commit <12 hex>,
        clean`` or ``..., with uncommitted changes``; outside git, that it is not a work tree."""
        if not self.git:
            return "not a git work tree"
        commit = self.commit[:12] if self.commit else "no commit yet"
        return f"commit {commit}, {'with uncommitted changes' if self.dirty else 'clean'}"

    def to_json(self) -> dict[str, object]:
        return {
            "dir": str(self.dir),
            "source": str(self.source),
            "git": self.git,
            "commit": self.commit,
            "dirty": self.dirty,
            "files": self.files,
            "bytes": self.bytes,
        }

    @classmethod
    def from_json(cls, raw: object, job_dir: Path) -> CodeSnapshot | None:
        """None for a job without a snapshot; UsageError for one that is not as written."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise _bad(job_dir, "its 'snapshot' is not an object")
        commit, dirty = raw.get("commit"), raw.get("dirty")
        paths = raw.get("dir"), raw.get("source")
        if not all(isinstance(path, str) and path.startswith("/") for path in paths):
            raise _bad(job_dir, "its snapshot's dir or source is not an absolute path")
        if commit is not None and not (isinstance(commit, str) and _COMMIT.match(commit)):
            raise _bad(job_dir, f"its snapshot's commit {commit!r:.80} is not a git hash")
        if dirty is not None and not isinstance(dirty, bool):
            raise _bad(job_dir, f"its snapshot's dirty {dirty!r:.80} is not true or false")
        files, size = raw.get("files", 0), raw.get("bytes", 0)
        if not _is_count(files) or not _is_count(size) or files < 0 or size < 0:
            raise _bad(job_dir, "its snapshot's files or bytes is not a count")
        return cls(
            dir=Path(str(paths[0])),
            source=Path(str(paths[1])),
            git=raw.get("git") is True,
            commit=commit,
            dirty=dirty,
            files=files,
            bytes=size,
        )


@dataclass(frozen=True)
class JobRecord:
    """A job as its ``job.json`` describes it; the same for submitted and local runs."""

    run_id: str
    job_dir: Path
    job_id: str | None
    local: bool
    zk: str | None
    nodes: str
    nproc_per_node: int
    max_restarts: int
    runner_pid: int | None = None
    """The ``hpc-elastic run`` process of a local run."""
    version: str = ""
    command_line: tuple[str, ...] = ()
    template: str | None = None
    spec: Mapping[str, object] = field(default_factory=dict)
    """Everything else the job was asked for, as JSON values, for people to read."""
    snapshot: CodeSnapshot | None = None
    """The code snapshot the job runs, or None (``--no-snapshot``, local runs, old jobs)."""
    grow_job_id: str | None = None
    """The growth slots' array job (``--grow-partition``/``--grow-qos``): the slots above MIN
    are a second Slurm job of the same run; None for a job of one array."""
    partition: str | None = None
    qos: str | None = None
    grow_partition: str | None = None
    grow_qos: str | None = None
    """Where the slots run, as submitted (None: Slurm's default, or the same as the core's)."""
    grow_time_min: str | None = None
    """``--grow-time-min``: the slots above MIN were submitted for backfill holes."""
    notify: str | None = None
    """The job's ``--notify`` webhook (``job.json`` is 0600), for alerts from outside the job
    (``hpc-elastic watch``)."""
    signal: str | None = None
    """The job's ``--signal`` (``USR2@90``), for ``hpc-elastic drill``."""

    @property
    def grows(self) -> bool:
        """Whether the slots above MIN are an array of their own (``--grow-partition``,
        ``--grow-qos`` or ``--grow-time-min``)."""
        growth = (self.grow_partition, self.grow_qos, self.grow_time_min)
        return any(value is not None for value in growth)

    def growth_slot(self, task: int) -> bool:
        """Whether array task ``task`` is one of the growth array's."""
        return self.grows and self.nodes != "?" and task >= NodeRange.parse(self.nodes).min

    def placement(self, task: int) -> tuple[str | None, str | None]:
        """The partition and QoS array task ``task`` was submitted with: the slots above MIN
        take ``--grow-partition``/``--grow-qos`` when the job has them."""
        if self.growth_slot(task):
            return self.grow_partition or self.partition, self.grow_qos or self.qos
        return self.partition, self.qos

    @property
    def job_ids(self) -> tuple[str, ...]:
        """Every Slurm job of the run: the array (or allocation), then the growth array."""
        return tuple(job for job in (self.job_id, self.grow_job_id) if job is not None)

    @property
    def paths(self) -> JobDir:
        return JobDir(self.job_dir)

    @property
    def events_file(self) -> Path:
        return self.paths.events

    @property
    def log_dir(self) -> Path:
        return self.paths.logs

    @property
    def secret_file(self) -> Path:
        return self.paths.secret

    def events(self) -> list[events.Event]:
        return list(events.read(self.events_file))

    def to_json(self) -> dict[str, object]:
        """The ``job.json`` object. A Slurm job keeps its ``zk`` in ``spec`` (tools edit it
        there); a local run names its socket at the top, with the runner's pid."""
        spec = {
            **self.spec,
            "nodes": self.nodes,
            "nproc_per_node": self.nproc_per_node,
            "max_restarts": self.max_restarts,
        }
        record: dict[str, object] = {
            "run_id": self.run_id,
            "job_id": self.job_id,
            "job_dir": str(self.job_dir),
        }
        if self.grow_job_id is not None:
            record["grow_job_id"] = self.grow_job_id
        if self.local:
            record.update(mode="local", zk=self.zk, pid=self.runner_pid)
        else:
            spec["zk"] = self.zk
        record.update(version=self.version, command_line=list(self.command_line))
        if self.template is not None:
            record["template"] = self.template
        if self.snapshot is not None:
            record["snapshot"] = self.snapshot.to_json()
        record["spec"] = spec
        return record

    def write(self) -> None:
        """Replace ``job.json`` at once (a reader never sees half a record), mode 0600, and
        note the directory in the user's index so ops commands find it from anywhere."""
        temporary = self.job_dir / f".{JOB_FILE}.tmp"
        write_private(temporary, json.dumps(self.to_json(), indent=2, default=str) + "\n")
        temporary.replace(self.paths.record)
        register(self.job_dir)

    @classmethod
    def load(cls, job_dir: Path, uid: int | None = None) -> JobRecord:
        """The record in ``job_dir``; it must be ``uid``'s own file that no one else may write,
        since its job id reaches ``scancel`` (a planted one could name another of your jobs)."""
        from hpc_elastic.config import unsafe_config_reason  # noqa: PLC0415 (config -> options)

        path = JobDir(job_dir).record
        try:
            info = path.stat()
            raw: Any = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError) as error:
            reason = error.strerror if isinstance(error, OSError) else "it is not valid JSON"
            raise _bad(job_dir, str(reason)) from error
        owner = os.geteuid() if uid is None else uid
        problem = unsafe_config_reason(info.st_uid, info.st_mode, owner)
        if problem is not None:
            raise _bad(job_dir, problem)
        return cls.from_json(raw, job_dir)

    @classmethod
    def from_json(cls, raw: object, job_dir: Path) -> JobRecord:
        """A record from a decoded ``job.json``, every field checked; UsageError says which.

        Reads what every version wrote: ``zk`` at the top (local runs) or in ``spec``.
        """
        if not isinstance(raw, dict):
            raise _bad(job_dir, "it is not a JSON object")
        spec = raw.get("spec", {})
        if not isinstance(spec, dict):
            raise _bad(job_dir, "its 'spec' is not an object")
        run_id = raw.get("run_id")
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
            raise _bad(job_dir, f"its run_id {run_id!r:.80} is not letters, digits, '.', '_', '-'")
        job_id = _job_id(raw.get("job_id"), job_dir)
        grow_job_id = _job_id(raw.get("grow_job_id"), job_dir, "grow_job_id")
        local = raw.get("mode") == "local"
        zk = raw.get("zk") or spec.get("zk")
        if zk is not None and not _is_address(zk, local=local):
            raise _bad(job_dir, f"its zk {zk!r:.80} is not an address")
        nodes = _nodes(spec.get("nodes", "?"), job_dir)
        pid = raw.get("pid")
        if pid is not None and (not _is_count(pid) or pid <= 1):
            raise _bad(job_dir, f"its pid {pid!r:.80} is not a process id above 1")
        nproc, restarts = spec.get("nproc_per_node", 1), spec.get("max_restarts", 0)
        if not _is_count(nproc) or nproc < 1 or not _is_count(restarts) or restarts < 0:
            raise _bad(job_dir, "its nproc_per_node or max_restarts is not a count")
        return cls(
            run_id=run_id,
            job_dir=job_dir.absolute(),
            job_id=job_id,
            local=local,
            zk=zk or None,
            nodes=nodes,
            nproc_per_node=nproc,
            max_restarts=restarts,
            runner_pid=pid,
            snapshot=CodeSnapshot.from_json(raw.get("snapshot"), job_dir),
            grow_job_id=grow_job_id,
            partition=_word(spec.get("partition"), "partition", job_dir),
            qos=_word(spec.get("qos"), "qos", job_dir),
            grow_partition=_word(spec.get("grow_partition"), "grow_partition", job_dir),
            grow_qos=_word(spec.get("grow_qos"), "grow_qos", job_dir),
            grow_time_min=_word(spec.get("grow_time_min"), "grow_time_min", job_dir),
            notify=_url(spec.get("notify"), job_dir),
            signal=_signal(spec.get("signal"), job_dir),
        )


def _word(value: object, key: str, job_dir: Path) -> str | None:
    """One word as sbatch takes it (a partition or QoS name), or None when not given."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not value
        or len(value) > 200
        or any(char.isspace() or not char.isprintable() for char in value)
    ):
        raise _bad(job_dir, f"its {key} {value!r:.80} is not one word")
    return value


def _signal(value: object, job_dir: Path) -> str | None:
    """The job's ``--signal`` as submit wrote it (``USR2@90``), or None."""
    if value is None:
        return None
    try:
        return str(PreemptSignal.parse(_word(value, "signal", job_dir) or ""))
    except UsageError:
        raise _bad(job_dir, f"its signal {value!r:.40} is not SIGNAL@SECONDS") from None


def _url(value: object, job_dir: Path) -> str | None:
    """The job's ``--notify`` URL, or None; one that is not an http(s) URL refuses the record."""
    if value is None:
        return None
    try:
        return check_url(_word(value, "notify", job_dir) or "")
    except UsageError:
        raise _bad(job_dir, f"its notify {value!r:.40} is not an http(s) URL") from None


def _job_id(job_id: object, job_dir: Path, key: str = "job_id") -> str | None:
    if isinstance(job_id, int) and not isinstance(job_id, bool):
        job_id = str(job_id)
    if job_id is not None and (not isinstance(job_id, str) or not _JOB_ID.match(job_id)):
        raise _bad(job_dir, f"its {key} {job_id!r:.80} is not a Slurm job number")
    return job_id or None


def _nodes(nodes: object, job_dir: Path) -> str:
    """``N`` or ``MIN:MAX``; ``?`` when a very old record did not say."""
    if nodes == "?":
        return "?"
    try:
        if isinstance(nodes, str):
            return str(NodeRange.parse(nodes))
    except UsageError:
        pass
    raise _bad(job_dir, f"its nodes {nodes!r:.80} is not N or MIN:MAX")


def _is_address(zk: object, *, local: bool) -> bool:
    """A ZooKeeper list as ``--zk`` takes it, or a local run's ``local://`` socket path."""
    if not isinstance(zk, str) or not zk.isprintable() or len(zk) > 4096:
        return False
    if local:
        return True
    try:
        parse_zk(zk)
    except UsageError:
        return False
    return True


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value < 2**62


def _bad(job_dir: Path, reason: str) -> UsageError:
    return UsageError(
        f"'{job_dir / JOB_FILE}' is not a usable hpc-elastic job record ({reason}); check that "
        f"'{job_dir}' is a job directory made by `hpc-elastic submit` or `hpc-elastic run`."
    )
