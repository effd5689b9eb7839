"""The local test cluster (scripts/dev-cluster) as a Python object for the integration tests.

Everything a test starts on the cluster carries ``HPC_ELASTIC_TEST_CLUSTER=<state dir>`` in its
environment (``Cluster.env`` sets it and sbatch passes it on), which is how ``strays`` tells
this cluster's leftovers from everything else on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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

    @property
    def zk_hosts(self) -> str:
        return f"127.0.0.1:{self.zk_port}"

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
        }
        return cls(
            state_dir=state_dir,
            slurm_conf=Path(exported["SLURM_CONF"]),
            zk_port=int(exported["HPC_ELASTIC_ZK"].rsplit(":", 1)[1]),
            env=env,
        )

    @classmethod
    def start(cls, state_dir: Path) -> Cluster:
        """Bring up a private cluster on free ports; raise ClusterError with why not."""
        missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
        if missing:
            raise ClusterError(
                f"Slurm/ZooKeeper tools are missing ({', '.join(missing)}); run scripts/test-all, "
                "or apt-get install slurm-wlm munge zookeeper."
            )
        ports = [
            *("--zk-port", str(free_port())),
            *("--slurmctld-port", str(free_port())),
            *("--slurmd-port-base", str(free_port_block(4))),
        ]
        result = _dev_cluster(state_dir, *ports, "up")
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

    def run(
        self, cmd: str | Sequence[str], check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run a command (a shell line or an argv) with the cluster's environment."""
        argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        return subprocess.run(
            argv, env=self.env, check=check, capture_output=True, text=True, timeout=timeout
        )

    def squeue(self) -> list[tuple[str, str]]:
        """(job id, state) of every job Slurm still lists."""
        lines = self.run(["squeue", "-h", "-o", "%i %T"]).stdout.split("\n")
        return [(job, state) for job, state in (line.split() for line in lines if line.strip())]

    def wait_queue_empty(self, timeout: float = 30) -> bool:
        return wait_until(lambda: not self.squeue(), timeout)

    def wait_no_strays(self, timeout: float = 15) -> bool:
        return wait_until(lambda: not self.strays(), timeout)

    def strays(self) -> list[str]:
        """``pid name args`` of every live process this cluster's tests or jobs left behind."""
        spared = _ancestors(os.getpid())
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


def _dev_cluster(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Daemons started without the marker, so that they never count as strays."""
    env = {key: value for key, value in os.environ.items() if key != MARKER}
    argv = [str(DEV_CLUSTER), "--state-dir", str(state_dir), *args]
    return subprocess.run(argv, env=env, check=False, capture_output=True, text=True, timeout=120)


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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive ports that are free on every interface (for slurmd)."""
    for _ in range(100):
        base = free_port()
        if base + count < 65536 and all(_is_free(base + i) for i in range(count)):
            return base
    raise ClusterError(f"found no {count} consecutive free TCP ports; free some ports.")


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


def _ancestors(pid: int) -> set[int]:
    """This process and its parents: they carry the marker too, but they are not leftovers."""
    chain = set()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return chain
