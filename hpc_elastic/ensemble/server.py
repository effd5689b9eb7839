"""One ZooKeeper server's life: as a step of the ensemble's Slurm job, or in the foreground.

A server of ``zk start``'s job (``run_slurm_server``, what ``hpc-elastic zk server`` runs in each
step):

1. claims three free ports on its node (``zoocfg.choose_ports``) and holds them;
2. publishes its host and ports in the run directory (``peers/<myid>.json``), which every node
   mounts, and waits for every other server to do the same;
3. writes ``zoo.cfg`` (``zoocfg.render_zoo_cfg``) and ``myid`` into a private directory on
   node-local disk, lets the ports go and starts ZooKeeper with umask 077;
4. once the ensemble has a leader, writes ``ensemble.json`` (each server may; the bytes are
   the same) so that ``zk start`` returns and ``submit`` finds it;
5. on SIGTERM (``zk stop``, the time limit) stops ZooKeeper and removes its node-local
   directory. A step that was killed outright leaves it, and the next start in place (the
   job's supervisor starts a server whose step died again, on the same node) takes the same
   ports and the same data back, as a restarted ZooKeeper server expects; the job's last
   step (``hpc-elastic zk clean``) removes what is left on every node.

Once the ensemble has served, its members are those of ``ensemble.json``, not myids 1..N: a
server whose node was lost is replaced by a new myid on a spare node (``supervisor``). Such a
*joiner* starts with the members and itself as an observer (``zoocfg.render_zoo_cfg``),
syncs with the leader as a non-voting follower, and waits for the supervisor's ``reconfig``.

``serve`` is the same server, standalone, in the foreground (``hpc-elastic zk serve``).
Exit codes: 0 stopped on request, ``CANNOT_START`` when starting again cannot help (the
script then gives up on that server), anything else a crash worth a start in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType

from hpc_elastic import contract, trust
from hpc_elastic.ensemble import files, fourletter, zoocfg
from hpc_elastic.ensemble.files import Ensemble, Layout, Server, StartRecord
from hpc_elastic.errors import EnsembleError

log = logging.getLogger(__name__)

CANNOT_START = 78
"""EX_CONFIG: the server cannot start (no Java on the node, no peers, a bad record); the
job's script does not start it again."""
QUORUM_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
"""Runs a standalone server too when the configuration names no peers."""
POLL_S = 0.2
SAME_PORTS_WAIT_S = 30.0
"""How long a server started in place waits for its old ports to be free again."""
REPLACES_ENV = contract.ZK_REPLACES_ENV


# --- ports ------------------------------------------------------------------------------------


@dataclass
class PortClaim:
    """Ports held by listening sockets until ZooKeeper is about to bind them (``zoocfg``'s
    docstring says why listening, not only binding)."""

    sockets: list[socket.socket] = field(default_factory=list)

    def claim(self, port: int) -> bool:
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # As ZooKeeper binds: a port with connections in TIME_WAIT is free for it.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("", port))
            probe.listen(1)
        except OSError:
            probe.close()
            return False
        self.sockets.append(probe)
        return True

    def release(self) -> None:
        for probe in self.sockets:
            probe.close()
        self.sockets.clear()


def claim_same_ports(server: Server, claims: PortClaim, wait_s: float = SAME_PORTS_WAIT_S) -> None:
    """A server started in place takes its old ports back: its peers know it by them."""
    wanted = (server.client_port, server.quorum_port, server.election_port)
    deadline = time.monotonic() + wait_s
    while True:
        if all(claims.claim(port) for port in wanted):
            return
        claims.release()
        if time.monotonic() >= deadline:
            raise EnsembleError(
                f"Server {server.myid}'s ports {', '.join(map(str, wanted))} on {server.node} "
                f"stayed taken for {wait_s:g} s, so it cannot start again in place; stop the "
                "ensemble with `hpc-elastic zk stop` and start a new one."
            )
        time.sleep(1.0)


# --- the node-local directory -----------------------------------------------------------------


def data_root(start: StartRecord, environ: Mapping[str, str]) -> Path:
    return Path(start.data_root or environ.get("TMPDIR") or "/tmp")


def data_dir(root: Path, job_id: str, myid: int) -> Path:
    """Server ``myid`` of job ``job_id``'s own directory: snapshots (``data``) and transaction
    logs (``txlog``), ``zoo.cfg`` and ``myid``."""
    return root / f"hpc-elastic-zk-{job_id}-{myid}"


def make_data_dir(path: Path, reuse: bool) -> Path:
    """A new private directory, or (``reuse``: a start in place) the one this server left,
    if it is still the user's own and private. A directory someone else put at that path in
    a shared /tmp is never used."""
    try:
        path.parent.mkdir(mode=files.PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        path.mkdir(mode=files.PRIVATE_DIR_MODE)
    except FileExistsError:
        if not reuse:
            raise EnsembleError(
                f"Data directory '{path}' already exists, but this server never ran; remove it "
                "or pick another node-local directory with --data-dir."
            ) from None
    except OSError as error:
        raise EnsembleError(
            f"Cannot create the data directory '{path}' ({error.strerror}); give a writable "
            "node-local directory with --data-dir."
        ) from error
    problem = trust.private_dir_problem(path)
    if problem is not None:
        raise EnsembleError(
            f"Data directory '{path}' is not trusted because {problem}; remove it or pick "
            "another node-local directory with --data-dir."
        )
    for sub in ("data", "txlog"):
        (path / sub).mkdir(mode=files.PRIVATE_DIR_MODE, exist_ok=True)
    return path


def remove_dir(path: Path) -> None:
    """Remove a server's directory, only while it is the user's own and private (never a
    link someone put in its place)."""
    if trust.private_dir_problem(path) is None:
        shutil.rmtree(path, ignore_errors=True)
        log.debug("removed %s", path)


def write_config(directory: Path, config: zoocfg.ServerConfig) -> Path:
    cfg = directory / "zoo.cfg"
    files.write_private(cfg, zoocfg.render_zoo_cfg(config).encode())
    files.write_private(directory / "data" / "myid", f"{config.myid}\n".encode())
    return cfg


def kept_config(directory: Path, myid: int) -> Path | None:
    """The ``zoo.cfg`` ZooKeeper left in a server's own directory, when a start in place
    should keep it (``zoocfg.zookeeper_owns``); None: write ours."""
    cfg = directory / "zoo.cfg"

    def dynamic(path: str) -> str | None:
        target = Path(path)
        if target.parent != directory:  # ZooKeeper writes it beside zoo.cfg, nowhere else
            return None
        try:
            return target.read_text(errors="replace")
        except OSError:
            return None

    try:
        text = cfg.read_text(errors="replace")
    except OSError:
        return None
    if zoocfg.zookeeper_owns(text, dynamic, myid):
        log.debug("server %d keeps ZooKeeper's own configuration in %s", myid, directory)
        return cfg
    return None


# --- ZooKeeper, the process ---------------------------------------------------------------


def launch(start: StartRecord, cfg: Path, output: int | None) -> subprocess.Popen[bytes]:
    """ZooKeeper with umask 077: every file it writes is the user's alone. ``output``: a file
    descriptor for its output, None to share ours (``zk serve``)."""
    argv = [start.java, f"-Xmx{start.heap}", "-cp", start.classpath, QUORUM_MAIN, str(cfg)]
    log.debug("starting %s", " ".join(argv))
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            umask=0o077,
        )
    except OSError as error:
        raise EnsembleError(
            f"Cannot run Java '{start.java}' on {socket.gethostname()} ({error.strerror}); "
            "make Java available on every node of the partition (the same path), or start "
            "the ensemble where it is."
        ) from error


@contextlib.contextmanager
def stop_on_signals(process: Callable[[], subprocess.Popen[bytes] | None]) -> Iterator[list[int]]:
    """While inside: SIGTERM and SIGINT are passed to ZooKeeper (and noted in the list the
    block gets), so that the wait on it returns and the caller cleans up."""
    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        running = process()
        if running is not None and running.poll() is None:
            running.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_serving(
    servers: list[Server], process: subprocess.Popen[bytes], timeout: float
) -> list[fourletter.Health] | None:
    """Every server's health once the ensemble has a leader; None when ZooKeeper exited or
    ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        healths = [fourletter.health(s.host, s.client_port, timeout=1.0) for s in servers]
        if fourletter.quorum_state(healths) != "no quorum":
            return healths
        time.sleep(0.5)
    return None


def publish_ensemble(layout: Layout, ensemble: Ensemble) -> None:
    """Write ``ensemble.json`` unless it already names this ensemble (another server wrote
    it, or this one before a start in place)."""
    current = None
    with contextlib.suppress(EnsembleError):
        current = files.load_ensemble(layout)
    if current is not None and current.job_id == ensemble.job_id and ensemble.job_id:
        return
    files.write_private(layout.ensemble_file, files.encode(ensemble))
    log.debug("ensemble %s serves at %s", ensemble.job_id or "(serve)", ensemble.connect)


def node_address(environ: Mapping[str, str]) -> str:
    """What the other servers and every client dial: the agents' own rule."""
    from hpc_elastic.agent.command import default_host  # noqa: PLC0415 (the agent is big)

    return default_host(environ)


# --- a server of the Slurm job ----------------------------------------------------------------


def serving_ensemble(layout: Layout, job_id: str) -> Ensemble | None:
    """This job's ensemble as ``ensemble.json`` records it once it has served (its members
    now), None before that."""
    current = None
    with contextlib.suppress(EnsembleError):
        current = files.load_ensemble(layout)
    return current if current is not None and job_id and current.job_id == job_id else None


def wait_for_peers(layout: Layout, servers: int, timeout: float) -> dict[int, Server]:
    deadline = time.monotonic() + timeout
    while True:
        published = files.load_peers(layout)
        missing = zoocfg.missing_peers(published, servers)
        if not missing:
            return published
        if time.monotonic() >= deadline:
            raise EnsembleError(
                f"Servers {', '.join(map(str, missing))} did not publish their ports in "
                f"'{layout.peers_dir}' within {timeout:g} s; check that every node mounts "
                f"that directory at the same path (or set {contract.STATE_DIR_ENV} to one "
                "that does) and read the job's output there."
            )
        time.sleep(POLL_S)


def run_slurm_server(layout: Layout, myid: int, environ: Mapping[str, str] = os.environ) -> int:
    """One step of the ensemble's job; returns the step's exit code (module docstring)."""
    try:
        start = files.load_start(layout)
        if start is None:
            raise EnsembleError(
                f"'{layout.start_file}' is missing, so this ensemble was stopped or never "
                "started; start one with `hpc-elastic zk start`."
            )
        if layout.stopping_file.exists():
            log.debug("server %d: the ensemble is stopping; not starting", myid)
            return 0
        return _serve_in_job(layout, start, myid, environ)
    except EnsembleError as error:
        print(f"hpc-elastic zk server {myid}: {error}", flush=True)
        return CANNOT_START


def _serve_in_job(layout: Layout, start: StartRecord, myid: int, environ: Mapping[str, str]) -> int:
    job_id = environ.get("SLURM_JOB_ID", "")
    node = environ.get("SLURMD_NODENAME") or socket.gethostname()
    published = files.load_peers(layout)
    previous = published.get(myid)
    serving = serving_ensemble(layout, job_id)
    joining = serving is not None and myid not in serving.members
    secret = files.load_secret(layout) if start.servers > 1 else None
    claims = PortClaim()
    try:
        if previous is not None:
            claim_same_ports(previous, claims)
            me = replace(previous, incarnation=previous.incarnation + 1)
        else:
            rng = random.Random(f"{job_id}-{myid}-{os.getpid()}-{time.time_ns()}")
            client, quorum_port, election = zoocfg.choose_ports(
                zoocfg.PORTS_PER_SERVER, zoocfg.port_candidates(start.ports, rng), claims.claim
            )
            me = Server(myid, node_address(environ), client, quorum_port, election, node)
            me = replace(me, replaces=_replaces(environ))
        me = replace(me, step=f"{job_id}.{environ.get('SLURM_STEP_ID', '')}", pid=os.getpid())
        files.write_private(layout.peer_file(myid), files.encode(me))
        log.debug("server %d published %s%s", myid, me, " (joining)" if joining else "")
        if serving is not None:
            peers = {server.myid: server for server in serving.servers if server.myid != myid}
            if not joining:
                peers[myid] = me
        else:
            peers = wait_for_peers(layout, start.servers, start.start_timeout)
        directory = make_data_dir(
            data_dir(data_root(start, environ), job_id, myid), reuse=previous is not None
        )
        cfg = (kept_config(directory, myid) if previous is not None else None) or write_config(
            directory,
            zoocfg.ServerConfig(
                myid,
                str(directory / "data"),
                str(directory / "txlog"),
                me.client_port,
                tuple(peers.values()) if start.servers > 1 else (),
                joiners=(me,) if joining else (),
                super_digest=zoocfg.super_digest(secret) if secret else "",
            ),
        )
    finally:
        claims.release()
    output = os.open(
        layout.server_log(myid), os.O_WRONLY | os.O_CREAT | os.O_APPEND, files.PRIVATE_FILE_MODE
    )
    try:
        process = launch(start, cfg, output)
    finally:
        os.close(output)
    ensemble = serving or Ensemble(
        servers=tuple(sorted(peers.values(), key=lambda server: server.myid)),
        job_id=job_id,
        run_dir=str(layout.run_dir),
        started=time.time(),
    )
    return _supervise(layout, process, ensemble, directory, start.start_timeout)


def _replaces(environ: Mapping[str, str]) -> int:
    """The myid a server on a spare node takes the place of (the supervisor says so in
    ``HPC_ELASTIC_ZK_REPLACES``); 0 for a first start."""
    text = environ.get(REPLACES_ENV, "")
    return int(text) if text.isdigit() and 0 < int(text) < 256 else 0


def _supervise(
    layout: Layout,
    process: subprocess.Popen[bytes],
    ensemble: Ensemble,
    directory: Path,
    timeout: float,
) -> int:
    """Publish the ensemble once it leads, then wait for ZooKeeper to end; a stop on request
    removes the node-local directory, a crash leaves it for the start in place."""
    with stop_on_signals(lambda: process) as received:
        if wait_serving(list(ensemble.servers), process, timeout) is not None:
            publish_ensemble(layout, ensemble)
        code = process.wait()
    if received or layout.stopping_file.exists():
        remove_dir(directory)
        return 0
    print(f"hpc-elastic zk server: ZooKeeper exited with code {code}", flush=True)
    return code or 1


def clean_node(layout: Layout, environ: Mapping[str, str] = os.environ) -> int:
    """The job's last step, on every node: remove what a killed server left there."""
    start = files.load_start(layout)
    if start is None:
        return 0
    job_id = environ.get("SLURM_JOB_ID", "")
    root = data_root(start, environ)
    # Every myid the job used: replacements took new ones. Where nodes share a disk (the dev
    # cluster), a surviving node also removes what a lost node's server left.
    prefix = data_dir(root, job_id, 0).name[:-1]
    for path in sorted(root.glob(f"{prefix}*")):
        if path.name[len(prefix) :].isdigit():
            remove_dir(path)
    return 0


# --- zk serve: the same server in the foreground ------------------------------------------------


@dataclass(frozen=True)
class ServeRequest:
    """What ``zk serve`` was asked for."""

    start: StartRecord
    port: int | None
    """The client port; None: a free one in ``start.ports``."""
    data_dir: Path | None
    """Kept across restarts when given (a service); else a private one, removed at exit."""
    publish: bool
    """Write ``ensemble.json``, so that this user's commands find the server."""


def serve(
    layout: Layout,
    request: ServeRequest,
    say: Callable[[str], None],
    environ: Mapping[str, str] = os.environ,
) -> int:
    """Run one standalone server until SIGTERM or SIGINT; returns the exit code."""
    claims = PortClaim()
    try:
        if request.port is not None:
            if not claims.claim(request.port):
                raise EnsembleError(
                    f"Port {request.port} is taken on {socket.gethostname()}; pick another "
                    "with --port, or leave it out to take a free one."
                )
            port = request.port
        else:
            rng = random.Random(f"serve-{os.getpid()}-{time.time_ns()}")
            (port,) = zoocfg.choose_ports(
                1, zoocfg.port_candidates(request.start.ports, rng), claims.claim
            )
        if request.data_dir is not None:
            files.ensure_private_dir(request.data_dir)
            directory = make_data_dir(request.data_dir, reuse=True)
        else:
            root = data_root(request.start, environ)
            directory = make_data_dir(root / f"hpc-elastic-zk-serve-{os.getpid()}", reuse=False)
        cfg = write_config(
            directory,
            zoocfg.ServerConfig(1, str(directory / "data"), str(directory / "txlog"), port),
        )
    finally:
        claims.release()
    me = Server(1, node_address(environ), port, 0, 0, socket.gethostname(), pid=os.getpid())
    ensemble = Ensemble(servers=(me,), started=time.time())
    process = launch(request.start, cfg, None)
    with stop_on_signals(lambda: process) as received:
        if wait_serving([me], process, request.start.start_timeout) is not None:
            say(f"ZooKeeper serves at {me.address} (data in {directory}); Ctrl-C stops it.")
            if request.publish:
                files.ensure_private_dir(layout.root)
                publish_ensemble(layout, ensemble)
                say(f"Your commands use it now ({layout.ensemble_file}).")
        code = process.wait()
    if request.publish:
        _unpublish(layout, me)
    if request.data_dir is None:
        remove_dir(directory)
    return 0 if received else (code or 1)


def _unpublish(layout: Layout, me: Server) -> None:
    """Remove ``ensemble.json`` if it still names this server (not a newer ensemble)."""
    with contextlib.suppress(EnsembleError):
        current = files.load_ensemble(layout)
        if current is not None and not current.job_id and current.servers[0].pid == me.pid:
            layout.ensemble_file.unlink(missing_ok=True)
