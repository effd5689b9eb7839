"""Real ZooKeeper servers for tests and benchmarks, in the spirit of ``kazoo.testing``.

Each server gets its own data dir and free loopback ports, and a short ``tickTime`` so that
sessions of 1 s are allowed (ZooKeeper clamps sessions to 2..20 ticks).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpc_elastic.rendezvous.handler import free_port

ZOOKEEPER_JAR = Path(os.environ.get("HPC_ELASTIC_ZOOKEEPER_JAR", "/usr/share/java/zookeeper.jar"))
SLF4J_SIMPLE = Path("/usr/share/java/slf4j-simple.jar")
"""slf4j's simple logger (Debian's libslf4j-java), put on the server's class path where it is
installed: without a binding ZooKeeper 3.8 logs nothing at all, and the ``zk.out`` a failed
test shows was empty. With it the server's INFO log, timestamped, goes to ``zk.out``."""
LOGGER_FLAGS = (
    "-Dorg.slf4j.simpleLogger.showDateTime=true",
    "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free now, picked as the agents pick the workers'
    MASTER_PORT: below the kernel's ephemeral range. A port of that range, free now, is
    anyone's to take before the server binds it, by a ``bind(0)`` (gloo's listeners, another
    test's pick) or as an outgoing connection's local port, and a ZooKeeper whose port was
    taken exits at start: a busy machine lost a whole test cluster so."""
    ports: dict[int, None] = {}
    while len(ports) < count:
        ports[free_port(environ={})] = None
    return list(ports)


def serving(port: int) -> bool:
    """Whether a ZooKeeper server on ``port`` serves clients: its ``srvr`` four-letter word
    answers with its version. Not ``ruok``: that answers ``imok`` as soon as the port is open,
    while the server still turns sessions away ("not currently serving requests"; 0.2 s here
    unloaded, and a CI run under load saw a client time out after 10 s right after ``imok``)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as probe:
            probe.sendall(b"srvr")
            return probe.recv(len(SERVING)) == SERVING
    except OSError:
        return False


SERVING = b"Zookeeper version"
"""How a serving server's ``srvr`` reply begins."""


@dataclass
class ZooKeeperServer:
    """One server process; standalone unless ``peers`` lists the ensemble's quorum ports."""

    data_dir: Path
    port: int = field(default_factory=lambda: free_ports(1)[0])
    myid: int = 1
    peers: list[tuple[int, int]] = field(default_factory=list)
    """(quorum port, election port) of every server, in myid order; empty for standalone."""
    process: subprocess.Popen[bytes] | None = None
    heap: str = "256m"
    """The JVM's ``-Xmx``: the default suits tests; the scale bench's thousands of sessions
    and watches need more."""
    options: dict[str, str] = field(default_factory=dict)
    """More ``zoo.cfg`` lines, e.g. ``maxClientCnxns=0``: by default a server takes 60
    connections from one address, and every client of a loopback bench is 127.0.0.1."""

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, wait: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "zoo.cfg"
        lines = [
            "tickTime=500",
            "minSessionTimeout=1000",
            "maxSessionTimeout=60000",
            "initLimit=20",
            "syncLimit=10",
            f"dataDir={self.data_dir}",
            f"clientPort={self.port}",
            "clientPortAddress=127.0.0.1",
            "admin.enableServer=false",
            "4lw.commands.whitelist=ruok,srvr,stat,mntr,conf",
            *(f"{key}={value}" for key, value in self.options.items()),
        ]
        for number, (quorum, election) in enumerate(self.peers, start=1):
            lines.append(f"server.{number}=127.0.0.1:{quorum}:{election}")
        if self.peers:
            (self.data_dir / "myid").write_text(f"{self.myid}\n")
        config.write_text("\n".join(lines) + "\n")
        main = (
            "org.apache.zookeeper.server.quorum.QuorumPeerMain"
            if self.peers
            else "org.apache.zookeeper.server.ZooKeeperServerMain"
        )
        classpath = [str(ZOOKEEPER_JAR), *([str(SLF4J_SIMPLE)] if SLF4J_SIMPLE.exists() else [])]
        with (self.data_dir / "zk.out").open("ab") as log:
            self.process = subprocess.Popen(
                [
                    "java",
                    f"-Xmx{self.heap}",
                    *LOGGER_FLAGS,
                    "-cp",
                    ":".join(classpath),
                    main,
                    str(config),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        if wait:
            self.wait_ready(wait)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not serving(self.port):
            if time.monotonic() > deadline or (self.process and self.process.poll() is not None):
                self.stop()
                raise RuntimeError(
                    f"ZooKeeper on port {self.port} did not start; see {self.data_dir}/zk.out"
                )
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def ensemble(
    base: Path, size: int = 3, *, heap: str = "256m", options: dict[str, str] | None = None
) -> list[ZooKeeperServer]:
    """``size`` servers that form one quorum on loopback; start them all, then wait."""
    ports = free_ports(3 * size)
    peers = [(ports[size + 2 * i], ports[size + 2 * i + 1]) for i in range(size)]
    return [
        ZooKeeperServer(
            base / f"zk{i + 1}",
            port=ports[i],
            myid=i + 1,
            peers=peers,
            heap=heap,
            options=dict(options or {}),
        )
        for i in range(size)
    ]


def mode(port: int) -> str | None:
    """The role the server on ``port`` says it plays (``srvr``'s ``Mode:`` line: "leader",
    "follower", "standalone"), or None when it does not answer."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as probe:
            probe.sendall(b"srvr")
            reply = b""
            while chunk := probe.recv(4096):
                reply += chunk
    except OSError:
        return None
    for line in reply.decode(errors="replace").splitlines():
        if line.startswith("Mode:"):
            return line.split(":", 1)[1].strip()
    return None
