"""The user's ensemble on disk: where it lives, its records, and the connect-string file.

Layout, under the user's state directory (``state_dir``), every directory 0700 and every file
0600, all the user's own::

    <state dir>/zk/
        ensemble.json            the serving ensemble: servers, Slurm job (``Ensemble``)
        run/                     the files of the ensemble that starts, runs or stops
            start.json           what ``zk start`` asked for, and the Slurm job (``StartRecord``)
            sbatch.sh            the job's script; slurm-<job>.out its output
            peers/<myid>.json    each server's host and ports, once it has picked them (``Server``)
            server-<myid>.log    each server's ZooKeeper output
            reconfig.secret      the ZooKeeper superuser's secret: the one client that may
                                 reconfigure the ensemble (a server replaced) authenticates with it
            supervisor.json      where the job's script runs (``SupervisorRecord``)
            stopping             ``zk stop`` is ending the ensemble: no server is restarted

``ensemble.json`` is what ``submit``, ``doctor``, ``nodes`` and the Python API read when no
``--zk`` names an ensemble. Someone who could plant or replace it would choose where every
job's agents rendezvous, so it is read without following a link and refused unless it is a
regular file of the user's own that nobody else may write, in a directory that is the user's
alone (``read_trusted``), the rules of ``hpc_elastic.trust``. Records are JSON, decoded field by
field: a field of the wrong type is one sentence naming the file and the field.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpc_elastic import contract, trust
from hpc_elastic.errors import EnsembleError, EnsembleTrustError

log = logging.getLogger(__name__)

FORMAT = 1
"""The version of the records' layout; a reader refuses another."""
ZK_DIR = "zk"
RUN_DIR = "run"
START_FILE = "start.json"
PEERS_DIR = "peers"
STOPPING_FILE = "stopping"
SCRIPT_FILE = "sbatch.sh"
SECRET_FILE = "reconfig.secret"
SUPERVISOR_FILE = "supervisor.json"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$HPC_ELASTIC_STATE_DIR``, else ``$XDG_STATE_HOME/hpc-elastic``, else
    ``~/.local/state/hpc-elastic`` (where the job index lives too)."""
    configured = environ.get(contract.STATE_DIR_ENV)
    if configured:
        return Path(configured)
    state = environ.get("XDG_STATE_HOME") or str(Path("~/.local/state").expanduser())
    return Path(state) / "hpc-elastic"


@dataclass(frozen=True)
class Layout:
    """Every path of the user's ensemble (see the module docstring)."""

    root: Path
    """``<state dir>/zk``."""

    @classmethod
    def of(cls, environ: Mapping[str, str] = os.environ) -> Layout:
        return cls(state_dir(environ) / ZK_DIR)

    @property
    def ensemble_file(self) -> Path:
        return self.root / contract.ENSEMBLE_FILE

    @property
    def run_dir(self) -> Path:
        return self.root / RUN_DIR

    @property
    def start_file(self) -> Path:
        return self.run_dir / START_FILE

    @property
    def peers_dir(self) -> Path:
        return self.run_dir / PEERS_DIR

    @property
    def stopping_file(self) -> Path:
        return self.run_dir / STOPPING_FILE

    @property
    def script(self) -> Path:
        return self.run_dir / SCRIPT_FILE

    @property
    def secret_file(self) -> Path:
        return self.run_dir / SECRET_FILE

    @property
    def supervisor_file(self) -> Path:
        return self.run_dir / SUPERVISOR_FILE

    def peer_file(self, myid: int) -> Path:
        return self.peers_dir / f"{myid}.json"

    def server_log(self, myid: int) -> Path:
        return self.run_dir / f"server-{myid}.log"

    def slurm_output(self, job_id: str = "%j") -> Path:
        return self.run_dir / f"slurm-{job_id}.out"


# --- records -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """One server as it published itself: where clients and its peers reach it."""

    myid: int
    host: str
    client_port: int
    quorum_port: int
    """0 for a standalone server (``zk serve``), which has no peers."""
    election_port: int
    node: str = ""
    """The Slurm node (or host name) it runs on."""
    step: str = ""
    """Its Slurm step (``123.1``); empty in the foreground (``zk serve``)."""
    incarnation: int = 1
    """1 for the first start; one more for each start in place after its step died."""
    pid: int = 0
    replaces: int = 0
    """The myid of the server this one took the place of (on a spare node); 0 for none."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.client_port}"


@dataclass(frozen=True)
class Ensemble:
    """The serving ensemble, as ``ensemble.json`` records it once it has a leader."""

    servers: tuple[Server, ...]
    job_id: str = ""
    """The Slurm job whose steps are the servers; empty for ``zk serve``."""
    run_dir: str = ""
    min_session_ms: int = contract.ZK_MIN_SESSION_MS
    max_session_ms: int = contract.ZK_MAX_SESSION_MS
    started: float = 0.0
    """When it first had a leader (seconds since the epoch)."""
    retired: tuple[Server, ...] = ()
    """Servers that were replaced (their node lost): no longer members, but the connect
    strings of the jobs submitted before still name them."""

    @property
    def connect(self) -> str:
        """The connect string: every server's ``host:port``, in myid order."""
        return ",".join(server.address for server in sorted(self.servers, key=_myid))

    @property
    def members(self) -> frozenset[int]:
        return frozenset(server.myid for server in self.servers)

    def names(self, connect: str) -> bool:
        """Whether ``connect`` (a job's ``--zk``) is a connect string this ensemble has had:
        its servers are ours, past or present, and one at least is still a member. A job
        submitted before a server was replaced still rendezvouses here."""
        named = hosts_of(connect)
        current = {server.address for server in self.servers}
        known = current | {server.address for server in self.retired}
        return bool(named) and named <= known and bool(named & current)

    def source(self) -> str:
        """Where a command's ZooKeeper came from, when it is this ensemble."""
        count = f"{len(self.servers)} server{'s' if len(self.servers) != 1 else ''}"
        if self.job_id:
            return f"your ensemble of {count}, Slurm job {self.job_id}"
        return f"your ensemble, hpc-elastic zk serve on {self.servers[0].node or 'a host'}"

    def describe(self) -> str:
        """Which ensemble, in a few words: "your ensemble (Slurm job 12, 3 servers)"."""
        count = f"{len(self.servers)} server{'s' if len(self.servers) != 1 else ''}"
        if self.job_id:
            return f"your ensemble (Slurm job {self.job_id}, {count})"
        server = self.servers[0] if self.servers else None
        where = f" on {server.node or server.host}, pid {server.pid}" if server else ""
        return f"your ensemble (hpc-elastic zk serve{where})"


@dataclass(frozen=True)
class StartRecord:
    """What ``zk start`` (or ``zk serve``) asked for: every server reads it from the run
    directory, so that the sbatch script names nothing but the directory and the server."""

    servers: int
    java: str
    classpath: str
    heap: str = contract.DEFAULT_ZK_HEAP
    data_root: str = ""
    """Node-local directory under which each server makes its own; empty: ``$TMPDIR`` or /tmp."""
    ports: tuple[int, int] = contract.DEFAULT_ZK_PORTS
    restarts: int = contract.DEFAULT_ZK_RESTARTS
    start_timeout: float = contract.DEFAULT_ZK_START_TIMEOUT
    job_id: str = ""
    """Filled in once sbatch has answered."""
    spares: int = contract.DEFAULT_ZK_SPARES
    """Nodes of the job that run no server at first, each ready to replace a lost one."""


@dataclass(frozen=True)
class SupervisorRecord:
    """Where the ensemble's job runs its script (``supervisor``): Slurm's batch host. When
    that node is lost, nothing starts a server again or replaces one (``zk status`` says so)."""

    node: str
    job_id: str


def _myid(server: Server) -> int:
    return server.myid


def hosts_of(connect: str) -> frozenset[str]:
    """The ``host:port`` pairs of a connect string, chroot aside."""
    return frozenset(pair.strip() for pair in connect.split("/", 1)[0].split(",") if pair.strip())


def encode(record: Server | Ensemble | StartRecord | SupervisorRecord) -> bytes:
    document = {"format": FORMAT, **asdict(record)}
    return (json.dumps(document, indent=1, sort_keys=True) + "\n").encode()


class _Reader:
    """Field-by-field decoding of one record, every refusal naming the file and the field."""

    def __init__(self, document: object, path: Path) -> None:
        self.path = path
        if not isinstance(document, dict):
            raise self._bad("it is not a JSON object")
        if document.get("format") != FORMAT:
            raise self._bad(f"its format is {document.get('format')!r}, not {FORMAT}")
        self.document: dict[str, Any] = document

    def _bad(self, why: str) -> EnsembleError:
        return EnsembleError(
            f"Ensemble record '{self.path}' cannot be used because {why}; stop the ensemble "
            "with `hpc-elastic zk stop --force` (or remove the file) and start it again."
        )

    def get(self, name: str, check: Callable[[Any], bool], default: object = None) -> Any:
        value = self.document.get(name, default)
        if value is None or not check(value):
            raise self._bad(f"its field '{name}' is {value!r:.80}")
        return value


def _integer(low: int, high: int = 1 << 31) -> Callable[[Any], bool]:
    return lambda value: type(value) is int and low <= value <= high


def _port(value: Any) -> bool:
    return type(value) is int and 0 < value < 65536


def _text(value: Any) -> bool:
    return isinstance(value, str) and value.isprintable()


def _word(value: Any) -> bool:
    """A host, node or Slurm id: printable, no spaces, commas or slashes (it lands in a
    connect string and on Slurm command lines)."""
    return _text(value) and not any(char.isspace() or char in ",/" for char in value)


def _number(value: Any) -> bool:
    return type(value) in (int, float) and value >= 0


def decode_server(document: object, path: Path) -> Server:
    reader = _Reader(document, path)
    return Server(
        myid=reader.get("myid", _integer(1, 255)),
        host=reader.get("host", lambda value: _word(value) and bool(value)),
        client_port=reader.get("client_port", _port),
        quorum_port=reader.get("quorum_port", _integer(0, 65535)),
        election_port=reader.get("election_port", _integer(0, 65535)),
        node=reader.get("node", _word, ""),
        step=reader.get("step", _word, ""),
        incarnation=reader.get("incarnation", _integer(1), 1),
        pid=reader.get("pid", _integer(0), 0),
        replaces=reader.get("replaces", _integer(0, 255), 0),
    )


def _server_list(reader: _Reader, name: str, default: object = None) -> tuple[Server, ...]:
    """A list of servers (``servers``, ``retired``), each decoded, no myid twice."""
    items = reader.get(
        name,
        lambda value: isinstance(value, list) and all(isinstance(item, dict) for item in value),
        default,
    )
    decoded = tuple(decode_server({**item, "format": FORMAT}, reader.path) for item in items)
    if len({server.myid for server in decoded}) != len(decoded):
        raise reader._bad(f"two of its {name} servers have the same myid")
    return decoded


def decode_ensemble(data: bytes, path: Path) -> Ensemble:
    reader = _Reader(_json(data, path), path)
    decoded = _server_list(reader, "servers")
    if not decoded:
        raise reader._bad("its field 'servers' is []")
    return Ensemble(
        servers=decoded,
        job_id=reader.get("job_id", _word, ""),
        run_dir=reader.get("run_dir", _text, ""),
        min_session_ms=reader.get("min_session_ms", _integer(1)),
        max_session_ms=reader.get("max_session_ms", _integer(1)),
        started=float(reader.get("started", _number, 0.0)),
        retired=_server_list(reader, "retired", []),
    )


def decode_start(data: bytes, path: Path) -> StartRecord:
    reader = _Reader(_json(data, path), path)
    ports = reader.get(
        "ports",
        lambda value: isinstance(value, list) and len(value) == 2 and all(map(_port, value)),
    )
    return StartRecord(
        servers=reader.get("servers", lambda value: value in contract.ZK_SERVER_COUNTS),
        java=reader.get("java", _text),
        classpath=reader.get("classpath", _text),
        heap=reader.get("heap", _word),
        data_root=reader.get("data_root", _text, ""),
        ports=(ports[0], ports[1]),
        restarts=reader.get("restarts", _integer(0, 1000)),
        start_timeout=float(reader.get("start_timeout", _number)),
        job_id=reader.get("job_id", _word, ""),
        spares=reader.get("spares", _integer(0, contract.ZK_MAX_SPARES), 0),
    )


def decode_supervisor(data: bytes, path: Path) -> SupervisorRecord:
    reader = _Reader(_json(data, path), path)
    return SupervisorRecord(
        node=reader.get("node", lambda value: _word(value) and bool(value)),
        job_id=reader.get("job_id", _word),
    )


def _json(data: bytes, path: Path) -> object:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return f"not JSON: {data[:40]!r}"


# --- reading and writing, trusted ------------------------------------------------------------


def ensure_private_dir(path: Path) -> Path:
    """``path`` (and missing parents) made 0700, then checked to be the user's own and
    private: a directory another user made or may enter is refused."""
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    except OSError as error:
        raise EnsembleError(
            f"Cannot create the directory '{path}' ({error.strerror}); set "
            f"{contract.STATE_DIR_ENV} to a directory of yours on a shared filesystem."
        ) from error
    problem = trust.private_dir_problem(path)
    if problem is not None:
        raise EnsembleError(
            f"Directory '{path}' is not trusted because {problem}; remove it, or set "
            f"{contract.STATE_DIR_ENV} to a directory that is yours alone (chmod 700)."
        )
    return path


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` at once (a reader sees the old bytes or the new, never
    half): a 0600 file made with ``O_EXCL`` beside it, fsynced, then renamed over it. A
    rename replaces a link planted at ``path`` itself, never its target."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        descriptor = os.open(temporary, flags, PRIVATE_FILE_MODE)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise EnsembleError(
            f"Cannot write '{path}' ({error.strerror}); check that its directory is yours "
            "and writable."
        ) from error
    log.debug("wrote %s (%d bytes)", path, len(data))


def read_trusted(path: Path, uid: int | None = None) -> bytes | None:
    """The bytes of ``path``, or None when there is no such file. Refused, in one sentence
    naming the file: a link (never followed), anything but a regular file, a file of another
    user or one that group or others may write, and a file in a directory that is not the
    user's alone (where another user could replace it). Checked on the open descriptor, so
    the file read is the file checked."""
    uid = os.geteuid() if uid is None else uid
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _untrusted(path, "it is a symbolic link") from error
        raise EnsembleError(
            f"Cannot read '{path}' ({error.strerror}); check its permissions."
        ) from error
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        problem = (
            "it is not a regular file"
            if not stat.S_ISREG(info.st_mode)
            else trust.unsafe_file_reason(info.st_uid, info.st_mode, uid)
        )
        data = handle.read() if problem is None else b""
    if problem is None:
        problem = trust.private_dir_problem(path.parent, uid)
        problem = None if problem is None else f"its directory '{path.parent}' is not: {problem}"
    if problem is not None:
        raise _untrusted(path, problem)
    return data


def _untrusted(path: Path, problem: str) -> EnsembleTrustError:
    log.debug("refusing %s: %s", path, problem)
    return EnsembleTrustError(
        f"Ensemble file '{path}' is not trusted because {problem}, so another user may have "
        f"planted or replaced it; remove it (rm -f '{path}') and start your ensemble again with "
        "`hpc-elastic zk start`, or give --zk."
    )


def load_ensemble(layout: Layout) -> Ensemble | None:
    """The serving ensemble of ``ensemble.json``, None when there is none (trusted read)."""
    data = read_trusted(layout.ensemble_file)
    return None if data is None else decode_ensemble(data, layout.ensemble_file)


def load_start(layout: Layout) -> StartRecord | None:
    data = read_trusted(layout.start_file)
    return None if data is None else decode_start(data, layout.start_file)


def load_supervisor(layout: Layout) -> SupervisorRecord | None:
    data = read_trusted(layout.supervisor_file)
    return None if data is None else decode_supervisor(data, layout.supervisor_file)


def make_secret(layout: Layout) -> None:
    """The superuser's secret for ``reconfig`` (0600, in the private run directory): random,
    made once by ``zk start``. Whoever holds it may change the ensemble's membership, so it
    never leaves the user's state directory; the servers get only its SHA1 digest
    (``zoocfg.super_digest``), in their private ``zoo.cfg``."""
    write_private(layout.secret_file, secrets.token_urlsafe(32).encode())


def load_secret(layout: Layout) -> str | None:
    """The superuser's secret, None when this ensemble has none (one server, or an ensemble
    started before there were replacements); trusted read."""
    data = read_trusted(layout.secret_file)
    if data is None:
        return None
    secret = data.decode(errors="replace").strip()
    if not secret or not secret.isprintable() or any(char.isspace() for char in secret):
        raise EnsembleError(
            f"Secret file '{layout.secret_file}' does not hold one printable word; stop the "
            "ensemble with `hpc-elastic zk stop --force` and start it again."
        )
    return secret


def load_peers(layout: Layout) -> dict[int, Server]:
    """The servers that published themselves so far, by myid; a record that cannot be read
    is refused (they are our own files in our own private directory)."""
    found: dict[int, Server] = {}
    try:
        names = sorted(os.listdir(layout.peers_dir))
    except FileNotFoundError:
        return found
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = layout.peers_dir / name
        data = read_trusted(path)
        if data is None:
            continue
        server = decode_server(_json(data, path), path)
        found[server.myid] = server
    return found


@dataclass(frozen=True)
class Found:
    """What ``find`` saw: the serving ensemble, and the start in progress (or both)."""

    ensemble: Ensemble | None
    start: StartRecord | None
    layout: Layout = field(repr=False)


def find(environ: Mapping[str, str] = os.environ) -> Found:
    layout = Layout.of(environ)
    return Found(load_ensemble(layout), load_start(layout), layout)
