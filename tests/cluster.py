"""The local test cluster (scripts/dev-cluster) as a Python object for the integration tests.

Everything a test starts on the cluster carries ``HPC_ELASTIC_TEST_CLUSTER=<state dir>`` in its
environment (``Cluster.env`` sets it and sbatch passes it on), which is how ``strays`` tells
this cluster's leftovers from everything else on the machine.

A cluster started with ``netns=True`` runs each node in a network namespace of its own (see
docs/dev-cluster.md), and ``link_cut``/``link_slow``/``link_heal`` act on that node's link.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpc_elastic.contract import USER_SECRET_FILE_ENV
from hpc_elastic.rendezvous.testing import free_ports

REPO = Path(__file__).resolve().parent.parent
DEV_CLUSTER = REPO / "scripts" / "dev-cluster"
MARKER = "HPC_ELASTIC_TEST_CLUSTER"
"""Names a running cluster's state dir: set by the developer to reuse it, and on every process."""

REQUIRED_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "java")
DAEMONS = frozenset({"slurmctld", "slurmscriptd", "slurmd", "munged", "java"})


class ClusterError(Exception):
    """The cluster could not be started, found or switched; the message says why."""


@dataclass
class Cluster:
    """A running dev cluster: its paths, ports, client environment and fault switches."""

    state_dir: Path
    slurm_conf: Path
    zk_port: int
    env: dict[str, str] = field(repr=False)
    nodes: list[str] = field(default_factory=lambda: ["n1", "n2", "n3", "n4"])
    zk_host: str = "127.0.0.1"
    """Where ZooKeeper listens: 127.0.0.1, or the namespaces' bridge address with ``netns``."""
    netns: bool = False
    qos: bool = False
    """Accounting and QoS preemption (``dev-cluster --qos``): QoS normal, high, scavenger."""

    @property
    def zk_hosts(self) -> str:
        return f"{self.zk_host}:{self.zk_port}"

    @classmethod
    def from_state_dir(cls, state_dir: Path) -> Cluster:
        """Attach to a cluster that ``scripts/dev-cluster up`` started in ``state_dir``."""
        env_file = state_dir / "env.sh"
        if not env_file.is_file():
            raise ClusterError(
                f"{env_file} does not exist; run `scripts/dev-cluster --state-dir {state_dir} up`."
            )
        exported = dict(
            line.removeprefix("export ").split("=", 1)
            for line in env_file.read_text().splitlines()
            if line.startswith("export ")
        )
        if not {"SLURM_CONF", "HPC_ELASTIC_ZK"} <= exported.keys():
            raise ClusterError(
                f"{env_file} lacks SLURM_CONF or HPC_ELASTIC_ZK; "
                f"run `scripts/dev-cluster --state-dir {state_dir} up` again."
            )
        env = {
            **os.environ,
            "PATH": _with_sbin(os.environ.get("PATH", "")),
            "SLURM_CONF": exported["SLURM_CONF"],
            MARKER: str(state_dir),
            # The agents' user secret (bad-node memory) lives with the cluster, not in $HOME,
            # so tests leave nothing in the real home and zk_root can clean up after them.
            USER_SECRET_FILE_ENV: str(state_dir / "user-secret"),
        }
        zk_host, zk_port = exported["HPC_ELASTIC_ZK"].rsplit(":", 1)
        return cls(
            state_dir=state_dir,
            slurm_conf=Path(exported["SLURM_CONF"]),
            zk_port=int(zk_port),
            env=env,
            zk_host=zk_host,
            netns=_saved(state_dir, "NETNS_SAVED") == "1",
            qos=_saved(state_dir, "QOS_SAVED") == "1",
        )

    @classmethod
    def start(
        cls, state_dir: Path, netns: bool = False, service_nodes: int = 0, qos: bool = False
    ) -> Cluster:
        """Bring up a private cluster on free ports; raise ClusterError with why not.

        ``netns``: each node in a network namespace of its own, so its links can be cut.
        ``service_nodes``: that many more nodes (s1..) in a partition 'service' of their own,
        for services such as a ZooKeeper ensemble (``hpc-elastic zk start``).
        ``qos``: accounting (MariaDB and slurmdbd) and QoS preemption (PreemptType=preempt/qos).
        """
        missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
        if missing:
            raise ClusterError(
                f"Slurm/ZooKeeper tools are missing ({', '.join(missing)}); run scripts/test-all, "
                "or apt-get install slurm-wlm munge zookeeper."
            )
        ports = [
            *("--zk-port", str(free_port())),
            *("--slurmctld-port", str(free_port())),
            *("--slurmd-port-base", str(free_port_block(4 + service_nodes))),
        ]
        options = [*(["--netns"] if netns else []), "--service-nodes", str(service_nodes)]
        if qos:
            options += ["--qos", "--slurmdbd-port", str(free_port())]
            options += ["--mariadb-port", str(free_port())]
        result = _dev_cluster(state_dir, *ports, *options, "up")
        if result.returncode != 0:
            _dev_cluster(state_dir, "down")
            raise ClusterError(f"scripts/dev-cluster up failed: {result.stderr.strip()}")
        return cls.from_state_dir(state_dir)

    def dev_cluster(self, *args: str) -> None:
        """Run a scripts/dev-cluster command on this cluster (down, zk-stop, node-kill 3, ...)."""
        result = _dev_cluster(self.state_dir, *args)
        if result.returncode != 0:
            raise ClusterError(
                f"scripts/dev-cluster {' '.join(args)} failed: {result.stderr.strip()}"
            )

    def stop(self) -> None:
        self.dev_cluster("down")

    def zk_stop(self) -> None:
        self.dev_cluster("zk-stop")

    def zk_start(self) -> None:
        self.dev_cluster("zk-start")

    def node_kill(self, node: str) -> None:
        """Crash a node: its slurmd, slurmstepds and their tasks die at once."""
        self.dev_cluster("node-kill", node)

    def node_start(self, node: str) -> None:
        self.dev_cluster("node-start", node)

    def node_address(self, node: str) -> str:
        """``node``'s own address on the namespaces' bridge (``netns`` clusters only)."""
        return f"10.231.{_saved(self.state_dir, 'NET_ID_SAVED')}.{10 + int(node[1:])}"

    def in_node_net(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s network namespace (``netns`` clusters only)."""
        netns = f"/run/netns/hpe{_saved(self.state_dir, 'NET_ID_SAVED')}-{node}"
        return ["nsenter", f"--net={netns}", *argv]

    def link_cut(self, node: str, what: str) -> None:
        """Drop ``node``'s traffic to and from ``zk``, its ``peers``, ``both`` or ``all``."""
        self.dev_cluster("link-cut", node, what)

    def link_slow(self, node: str, rate: str = "1mbit", loss_percent: int = 10) -> None:
        """Throttle ``node``'s link to ``rate`` each way; lose ``loss_percent`` of its packets."""
        self.dev_cluster("link-slow", node, rate, str(loss_percent))

    def link_heal(self, node: str) -> None:
        """Undo every link-cut and link-slow on ``node``."""
        self.dev_cluster("link-heal", node)

    @contextlib.contextmanager
    def slurm_conf_lines(self, *lines: str) -> Iterator[None]:
        """Slurm runs with ``lines`` added to slurm.conf (a later line wins) for the block,
        then with the file as it was: ``scontrol reconfigure`` makes slurmctld and every
        slurmd read it again each way, without stopping a job. For one test's setting (a
        lower ``BatchStartTimeout``) on the cluster every test shares."""
        before = self.slurm_conf.read_text()
        self.slurm_conf.write_text(before + "".join(f"{line}\n" for line in lines))
        try:
            self.run(["scontrol", "reconfigure"])
            yield
        finally:
            self.slurm_conf.write_text(before)
            self.run(["scontrol", "reconfigure"])

    def run(
        self, cmd: str | Sequence[str], check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run a command (a shell line or an argv) with the cluster's environment."""
        argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        return subprocess.run(
            argv, env=self.env, check=check, capture_output=True, text=True, timeout=timeout
        )

    def squeue(self, patience: float = 5.0) -> list[tuple[str, str]]:
        """(job id, state) of every job Slurm still lists. A busy slurmctld may not answer one
        query in time (exit 1): it is asked again until it answers, as the agents' own reading
        asks again at its next poll, and only ``patience`` seconds without an answer fail."""
        answers: list[subprocess.CompletedProcess[str]] = []

        def answered() -> bool:
            answers.append(self.run(["squeue", "-h", "-o", "%i %T"], check=False))
            return answers[-1].returncode == 0

        if not wait_until(answered, patience, interval=1.0):
            raise AssertionError(
                f"squeue answered no query in {patience:g} s: {answers[-1].stderr.strip()!r}"
            )
        lines = answers[-1].stdout.split("\n")
        return [(job, state) for job, state in (line.split() for line in lines if line.strip())]

    def wait_queue_empty(self, timeout: float = 30) -> bool:
        return wait_until(lambda: not self.squeue(), timeout)

    def wait_no_strays(self, timeout: float = 15) -> bool:
        return wait_until(lambda: not self.strays(), timeout)

    def strays(self) -> list[str]:
        """``pid name args`` of every live process this cluster's tests or jobs left behind."""
        spared = _ancestors(os.getpid()) | _own_resource_tracker()
        return [
            f"{pid} {name} {args}"
            for pid, name, args, environ in _processes()
            if pid not in spared and name not in DAEMONS and self._owns(name, environ)
        ]

    def _owns(self, name: str, environ: set[str]) -> bool:
        if f"{MARKER}={self.state_dir}" in environ:
            return True
        ours = f"SLURM_CONF={self.slurm_conf}" in environ
        in_job = any(entry.startswith("SLURM_JOB_ID=") for entry in environ)
        return ours and (in_job or name == "slurmstepd")

    def clean_up(self) -> None:
        """Cancel every job and kill every stray, so one failed test does not spoil the next."""
        self.run(["scancel", f"--user={os.getuid()}"], check=False)
        self.wait_queue_empty(30)
        for entry in self.strays():
            pid = int(entry.split()[0])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _saved(state_dir: Path, key: str) -> str:
    """A value that ``scripts/dev-cluster`` saved in the state dir's ``ports`` file, or ""."""
    ports = state_dir / "ports"
    lines = ports.read_text().splitlines() if ports.is_file() else []
    return next((line.split("=", 1)[1] for line in lines if line.startswith(f"{key}=")), "")


def _dev_cluster(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Daemons started without the marker, so that they never count as strays. A command
    that outlives its backstop is killed with every process of its own session (a hung
    ``sinfo``, a ZooKeeper it started) and is a failed one whose stderr says so, after what it
    printed: the caller takes down the rest and raises, as for any other failure."""
    env = {key: value for key, value in os.environ.items() if key != MARKER}
    argv = [str(DEV_CLUSTER), "--state-dir", str(state_dir), *args]
    backstop = UP_BACKSTOP if "up" in args else COMMAND_BACKSTOP
    with subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as command:
        try:
            out, err = command.communicate(timeout=backstop)
        except subprocess.TimeoutExpired:
            os.killpg(command.pid, signal.SIGKILL)
            out, err = command.communicate()
            late = f"scripts/dev-cluster {' '.join(args)} did not finish within {backstop:g} s"
            return subprocess.CompletedProcess(argv, 124, out, f"{err.strip()}\n{late}.")
    return subprocess.CompletedProcess(argv, command.returncode, out, err)


UP_BACKSTOP = 900.0
"""Seconds ``up`` may run: more than its own waits add up to (scripts/dev-cluster gives each
of ZooKeeper, MariaDB, slurmdbd, slurmctld and the nodes START_WAIT = 120 s to answer), so
that its own sentence names the daemon that did not answer. A deadline shorter than those
waits once killed a slow ``up`` unheard and left its daemons running."""
COMMAND_BACKSTOP = 120.0
"""Seconds any other command (down, node-kill, link-cut, ...) may run."""


def _with_sbin(path: str) -> str:
    """Slurm's daemons live in /usr/sbin, which a non-login PATH may lack."""
    parts = path.split(os.pathsep) if path else []
    return os.pathsep.join(parts + [d for d in ("/usr/sbin", "/sbin") if d not in parts])


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def free_port() -> int:
    """A port that is free now, below the kernel's ephemeral range (``testing.free_ports``):
    for a daemon that binds it moments later, or for a port where nobody answers."""
    return free_ports(1)[0]


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive ports that are free on every interface, below the
    kernel's ephemeral range: for daemons that each bind ``base + i`` (slurmd, local mode's
    metrics), some of them seconds later or again after a restart.

    Inside the ephemeral range a port free now can be the source port of anyone's next
    outgoing connection, and Linux gives connections even ports and ``bind(0)`` odd ones, so
    ``base + 1`` after a ``bind(0)`` base is the likeliest of all to go. Below the range only
    an explicit bind takes a port."""
    low = _ephemeral_ports()[0]
    # SystemRandom, not the module's generator: a test may have seeded that one, and the
    # suite's parallel runs would then all try the same blocks in the same order.
    pick = random.SystemRandom()
    for _ in range(200):
        base = pick.randrange(_FIRST_UNPRIVILEGED, low - count)
        if all(_is_free(base + i) for i in range(count)):
            return base
    raise ClusterError(f"found no {count} consecutive free TCP ports below {low}; free some ports.")


_FIRST_UNPRIVILEGED = 10000
"""Where ``free_port_block`` starts looking: above the well-known and most registered ports."""


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for ``bind(0)`` and outgoing connections."""
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def _processes() -> list[tuple[int, str, str, set[str]]]:
    """(pid, name, command line, environment entries) of every live, readable process."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            environ = (proc / "environ").read_bytes()
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
        if state in "ZX":
            continue
        entries = {entry.decode(errors="replace") for entry in environ.split(b"\0") if entry}
        found.append((int(proc.name), name, args.strip(), entries))
    return found


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _own_resource_tracker() -> set[int]:
    """multiprocessing's resource tracker of the test process itself: a test that starts a
    process with shared memory (the checkpoint writer process) starts it once, and it lives
    as long as pytest does. It is pytest's helper, not something a test left behind."""
    me = os.getpid()
    return {
        pid
        for pid, _, args, _ in _processes()
        if "multiprocessing.resource_tracker import main" in args and _parent(pid) == me
    }


def _ancestors(pid: int) -> set[int]:
    """This process and its parents: they carry the marker too, but they are not leftovers."""
    chain = set()
    current: int | None = pid
    while current is not None and current > 1 and current not in chain:
        chain.add(current)
        current = _parent(current)
    return chain
