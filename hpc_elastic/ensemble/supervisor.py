"""The ensemble job's supervisor: what its script runs on the job's first node (Slurm's batch
host), in place of a shell loop per server.

It starts one Slurm step per server (``hpc-elastic zk server``), and when a step ends decides
what to do (``after_exit``, a pure rule):

- the ensemble is stopping, or the server stopped on request (exit 0 on a node still in the
  job): nothing;
- the step died on a node that is still in the job: the server starts again in place (same
  node, ports and data), up to ``--restarts`` times;
- its node left the job (Slurm removes a lost node from a ``--no-kill`` job), or it cannot
  come back in place: a new server, with a new myid, starts on a spare node of the job
  (``zk start --spares``), joins as a non-voting follower, and the supervisor asks ZooKeeper
  to add it and remove the lost one in one ``reconfig`` (``admin``). Then it rewrites
  ``ensemble.json`` (the new members, the lost one among ``retired``), atomically, 0600.

Why the supervisor decides from the job's node list and not from the step's exit code: ``srun``
exits 0 when Slurm reports its node failed ("Node failure on s3"), exactly as after a stop on
request. A node is lost once Slurm has removed it from the job, which it does when it marks the
node DOWN (``SlurmdTimeout`` after its last answer). The supervisor also asks Slurm every
``NODES_POLL_S`` seconds, and ends a step whose node left the job if ``srun`` has not.

The supervisor itself is the one thing of the ensemble that lives on one node: if the batch
host is lost, Slurm keeps the job and its other steps (``--no-kill``) but nothing starts or
replaces a server any more. With spares, the batch host is the spare used last, so that its
loss costs no server (docs/cluster-setup.md).

The steps are ``srun`` processes of this one, as the shell script's were; the rest of Slurm is
asked through the Slurm layer (``squeue``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType

from hpc_elastic.ensemble import files, fourletter
from hpc_elastic.ensemble.files import Layout, Server, StartRecord, SupervisorRecord
from hpc_elastic.ensemble.server import CANNOT_START, REPLACES_ENV
from hpc_elastic.errors import EnsembleError, HpcElasticError

log = logging.getLogger(__name__)

POLL_S = 0.5
NODES_POLL_S = 30.0
"""How often the job's node list is asked of Slurm while every step runs: only to end an
``srun`` that would wait on a lost node (it returns by itself when Slurm reports the failure)."""
CONFIRM_S = 5.0
"""After an exit 0 on a node still in the job, how long before Slurm is asked again: ``srun``
exits 0 on a node failure too, and a stop on request must not be taken for one too early."""
RESTART_PAUSE_S = 2.0
"""Pause before a server starts again in place: its old process lets its ports go."""
RECONFIG_TIMEOUT_S = 120.0
MAX_MYID = 255
"""ZooKeeper's myid is any positive long, but the records keep it to one byte."""


# --- pure rules --------------------------------------------------------------------------------


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compact node list (``s[1-2,4],gpu[01-02]``) as node names, in order; what
    ``scontrol show hostnames`` prints, for the forms Slurm writes (zero padding kept)."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        names += _expand_one(item)
    return names


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if current:
        items.append(current)
    return [item for item in items if item]


def _expand_one(item: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    head, ranges, tail = item[:start], item[start + 1 : end], item[end + 1 :]
    numbers: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not high:
            numbers.append(low)
            continue
        width = len(low)
        numbers += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return [f"{head}{number}{rest}" for number in numbers for rest in _expand_one(tail)]


def place(nodes: Sequence[str], batch_node: str, servers: int) -> tuple[list[str], list[str]]:
    """(the nodes of servers 1..N, the spare nodes, in the order they are used). The batch
    host runs the supervisor: with spares it is a spare, the one used last, so that losing it
    costs no server; without, it runs the last server."""
    others = [node for node in nodes if node != batch_node]
    ordered = others + [node for node in nodes if node == batch_node]
    if len(ordered) < servers:
        raise EnsembleError(
            f"The ensemble's job has {len(ordered)} node(s) ({', '.join(ordered)}) for "
            f"{servers} servers; Slurm gave it fewer than `zk start` asked for, so start it "
            "again with `hpc-elastic zk stop --force` and `hpc-elastic zk start`."
        )
    return ordered[:servers], ordered[servers:]


@dataclass(frozen=True)
class Ended:
    """What the supervisor knows when a server's step has ended."""

    code: int
    node_in_job: bool
    """Whether Slurm still counts the server's node in the job (a lost node leaves it)."""
    stopping: bool
    """``zk stop`` has begun (or the supervisor got SIGTERM: the job is ending)."""
    tries: int
    """Starts in place of this server so far."""
    restarts: int
    served: bool
    """The ensemble has served: it has members a ``reconfig`` can change."""
    servers: int
    spare: str | None
    """The next spare node still in the job, if any."""


@dataclass(frozen=True)
class Action:
    kind: str
    """``done``, ``restart`` (in place), ``replace`` (on ``node``) or ``give up``."""
    why: str
    node: str = ""


def after_exit(ended: Ended) -> Action:
    """What to do once a server's step has ended (the module docstring)."""
    if ended.stopping:
        return Action("done", "the ensemble is stopping")
    if ended.node_in_job:
        if ended.code == 0:
            return Action("done", "it stopped on request")
        if ended.code != CANNOT_START and ended.tries < ended.restarts:
            return Action("restart", f"its step ended with {ended.code}")
        why = (
            "it cannot start on its node"
            if ended.code == CANNOT_START
            else f"its step ended with {ended.code} after {ended.tries} start(s) in place"
        )
    else:
        why = "its node left the job (lost)"
    if not ended.served:
        return Action("give up", f"{why}, and the ensemble never served, so none can replace it")
    if ended.servers == 1:
        return Action("give up", f"{why}; one server alone has no quorum to add another")
    if ended.spare is None:
        return Action("give up", f"{why}, and no spare node is left (zk start --spares)")
    return Action("replace", why, ended.spare)


def server_argv(python: str, run_dir: Path, myid: int, node: str) -> list[str]:
    """One server's step on ``node``."""
    return [
        "srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
        python, "-m", "hpc_elastic", "zk", "server", "--run-dir", str(run_dir), "--myid", str(myid),
    ]  # fmt: skip


def clean_argv(python: str, run_dir: Path, nodes: Sequence[str]) -> list[str]:
    """The last step, one task on every node still in the job."""
    return [
        "srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        python, "-m", "hpc_elastic", "zk", "clean", "--run-dir", str(run_dir),
    ]  # fmt: skip


def replaced(ensemble: files.Ensemble, joiner: Server, leaving: int) -> files.Ensemble:
    """The ensemble once ``reconfig`` has put ``joiner`` in the place of ``leaving``."""
    gone = [server for server in ensemble.servers if server.myid == leaving]
    kept = [server for server in ensemble.servers if server.myid not in (leaving, joiner.myid)]
    return replace(
        ensemble,
        servers=tuple(sorted([*kept, joiner], key=lambda server: server.myid)),
        retired=(*ensemble.retired, *gone),
    )


# --- the supervisor ----------------------------------------------------------------------------


@dataclass
class Slot:
    """One server the supervisor runs."""

    myid: int
    node: str
    process: subprocess.Popen[bytes] | None = None
    tries: int = 0
    replaces: int = 0
    """For a server on a spare node: the member whose place it takes."""
    joined: bool = True
    """False for such a server until ``reconfig`` has made it a member."""


@dataclass
class Supervisor:
    """The loop that acts on ``after_exit`` (one per ensemble job)."""

    layout: Layout
    start: StartRecord
    job_id: str
    spares: list[str]
    job_nodes: Callable[[], set[str] | None]
    """The job's nodes now, as Slurm says; None when Slurm cannot be asked."""
    python: str = field(default_factory=lambda: sys.executable)
    say: Callable[[str], None] = field(default=lambda text: print(text, flush=True))
    spawn: Callable[[list[str], dict[str, str]], subprocess.Popen[bytes]] = field(
        default=lambda argv, environ: subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=environ)
    )
    """Starts one step (``srun``); tests give another process in its place."""
    slots: dict[int, Slot] = field(default_factory=dict)
    terminated: bool = False
    next_myid: int = 0

    def run(self, server_nodes: Sequence[str]) -> int:
        for myid, node in enumerate(server_nodes, start=1):
            self.slots[myid] = Slot(myid, node)
            self._launch(self.slots[myid])
        self.next_myid = len(server_nodes) + 1
        last_poll = time.monotonic()
        while any(slot.process is not None for slot in self.slots.values()):
            time.sleep(POLL_S)
            for slot in list(self.slots.values()):
                if slot.process is not None and slot.process.poll() is not None:
                    self._ended(slot, slot.process.returncode)
            if time.monotonic() - last_poll >= NODES_POLL_S:
                last_poll = time.monotonic()
                self._end_steps_of_lost_nodes()
            self._join_waiting()
        return 0

    def stopping(self) -> bool:
        return self.terminated or self.layout.stopping_file.exists()

    def _launch(self, slot: Slot) -> None:
        environ = {key: value for key, value in os.environ.items() if key != REPLACES_ENV}
        if slot.replaces:
            environ[REPLACES_ENV] = str(slot.replaces)
        argv = server_argv(self.python, self.layout.run_dir, slot.myid, slot.node)
        log.debug("server %d: %s", slot.myid, " ".join(argv))
        slot.process = self.spawn(argv, environ)

    def _nodes(self) -> set[str] | None:
        """The job's nodes, asked up to three times: an answer is worth a short wait, since
        a server's fate hangs on it."""
        for attempt in range(3):
            nodes = self.job_nodes()
            if nodes is not None:
                return nodes
            time.sleep(2.0 * (attempt + 1))
        return None

    def _end_steps_of_lost_nodes(self) -> None:
        """A step whose node left the job while ``srun`` still waits is ended here."""
        nodes = self.job_nodes()
        if nodes is None:
            return
        for slot in self.slots.values():
            if slot.process is not None and slot.process.poll() is None and slot.node not in nodes:
                log.debug("server %d: node %s left the job; ending its srun", slot.myid, slot.node)
                with contextlib.suppress(ProcessLookupError):
                    slot.process.kill()

    def _ended(self, slot: Slot, code: int) -> None:
        slot.process = None
        nodes = self._nodes()
        if code == 0 and not self.stopping() and nodes is not None and slot.node in nodes:
            time.sleep(CONFIRM_S)
            nodes = self._nodes()
        in_job = nodes is None or slot.node in nodes
        if nodes is not None:
            self.spares = [node for node in self.spares if node in nodes]
        serving = self._serving()
        action = after_exit(
            Ended(
                code=code,
                node_in_job=in_job,
                stopping=self.stopping(),
                tries=slot.tries,
                restarts=self.start.restarts,
                served=serving is not None,
                servers=self.start.servers,
                spare=self.spares[0] if self.spares else None,
            )
        )
        log.debug("server %d on %s ended with %d: %s", slot.myid, slot.node, code, action)
        target = slot.replaces if not slot.joined else slot.myid
        if action.kind == "restart":
            self.say(
                f"server {slot.myid} on {slot.node}: {action.why}; starting it again in place "
                f"({slot.tries + 1} of {self.start.restarts})"
            )
            time.sleep(RESTART_PAUSE_S)
            slot.tries += 1
            self._launch(slot)
        elif action.kind == "replace":
            self._replace(target, action)
        elif action.kind == "give up":
            self.say(f"server {slot.myid} on {slot.node}: {action.why}; it stays down")

    def _replace(self, target: int, action: Action) -> None:
        """A new server on the spare node, joining in the place of ``target``."""
        if self.next_myid > MAX_MYID:
            self.say(f"server {target}: {action.why}; no myid is left for a replacement")
            return
        self.spares.remove(action.node)
        slot = Slot(self.next_myid, action.node, replaces=target, joined=False)
        self.next_myid += 1
        self.slots[slot.myid] = slot
        self.say(
            f"server {target}: {action.why}; server {slot.myid} starts on the spare node "
            f"{slot.node} to take its place"
        )
        self._launch(slot)

    def _serving(self) -> files.Ensemble | None:
        with contextlib.suppress(EnsembleError):
            current = files.load_ensemble(self.layout)
            if current is not None and current.job_id == self.job_id:
                return current
        return None

    def _join_waiting(self) -> None:
        """Each server on a spare node that has synced with the leader is made a member."""
        for slot in self.slots.values():
            if slot.joined or slot.process is None or self.stopping():
                continue
            joiner = _published(self.layout, slot.myid)
            if joiner is None or not _synced(joiner):
                continue
            try:
                self._reconfigure(joiner, slot.replaces)
            except HpcElasticError as error:
                self.say(f"server {slot.myid}: {error}")
                continue
            slot.joined = True

    def _reconfigure(self, joiner: Server, leaving: int) -> None:
        from hpc_elastic.ensemble import admin  # noqa: PLC0415 (it loads the ZooKeeper client)

        ensemble = self._serving()
        secret = files.load_secret(self.layout)
        if ensemble is None or secret is None:
            raise EnsembleError(
                f"'{self.layout.ensemble_file}' or '{self.layout.secret_file}' is missing, "
                f"so server {joiner.myid} cannot be added; stop the ensemble with "
                "`hpc-elastic zk stop --force` and start a new one."
            )
        began = time.monotonic()
        admin.replace_member(ensemble, joiner, leaving, secret, RECONFIG_TIMEOUT_S)
        files.write_private(
            self.layout.ensemble_file, files.encode(replaced(ensemble, joiner, leaving))
        )
        self.layout.peer_file(leaving).unlink(missing_ok=True)
        full = replaced(ensemble, joiner, leaving)
        self.say(
            f"server {joiner.myid} on {joiner.node} took the place of server {leaving} "
            f"({time.monotonic() - began:.1f} s to reconfigure); the ensemble is "
            f"{full.connect}"
        )


def _published(layout: Layout, myid: int) -> Server | None:
    try:
        return files.load_peers(layout).get(myid)
    except EnsembleError as error:
        log.debug("peers of %s unreadable: %s", layout.run_dir, error)
        return None


def _synced(server: Server) -> bool:
    """Whether a joiner follows the leader and is in sync (mntr's peer state)."""
    try:
        text = fourletter.ask(server.host, server.client_port, "mntr", timeout=1.0)
    except OSError:
        return False
    return fourletter.synced(fourletter.parse_mntr(text))


def run(layout: Layout, environ: Mapping[str, str] = os.environ) -> int:
    """The job's script: supervise every server, then clean every node still in the job."""
    start = files.load_start(layout)
    if start is None:
        print(f"hpc-elastic zk supervise: '{layout.start_file}' is missing; nothing to run.")
        return 1
    job_id = environ.get("SLURM_JOB_ID", "")
    batch_node = environ.get("SLURMD_NODENAME", "")
    nodes = expand_nodelist(environ.get("SLURM_JOB_NODELIST", ""))
    try:
        server_nodes, spares = place(nodes, batch_node, start.servers)
    except EnsembleError as error:
        print(f"hpc-elastic zk supervise: {error}", flush=True)
        return 1
    files.write_private(layout.supervisor_file, files.encode(SupervisorRecord(batch_node, job_id)))
    print(
        f"hpc-elastic zk: servers on {', '.join(server_nodes)}"
        + (f"; spare node(s) {', '.join(spares)}" if spares else ""),
        flush=True,
    )
    supervisor = Supervisor(layout, start, job_id, spares, lambda: _job_nodes(job_id))

    def terminated(signum: int, _frame: FrameType | None) -> None:
        supervisor.terminated = True  # the job ends: its steps get the signal themselves

    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGINT, terminated)
    supervisor.run(server_nodes)
    remaining = sorted(_job_nodes(job_id) or set(nodes), key=nodes.index)
    subprocess.run(clean_argv(sys.executable, layout.run_dir, remaining), check=False)
    return 0


def _job_nodes(job_id: str) -> set[str] | None:
    from hpc_elastic.slurm import commands  # noqa: PLC0415

    try:
        listed = [status for status in commands.squeue([job_id]) if status.job_id == job_id]
    except HpcElasticError as error:
        log.debug("cannot ask Slurm for job %s's nodes: %s", job_id, error)
        return None
    return set(expand_nodelist(listed[0].nodes)) if listed else set()
