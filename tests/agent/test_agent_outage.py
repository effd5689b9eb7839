"""Agents as real processes against a ZooKeeper server of the test's own, with fast torch-free
workers: a dead ensemble ends them with one sentence, and a stop signal ends them in every
phase of their life (docs/agent.md, "Signals"; docs/rendezvous.md, "Faults").

No Slurm is needed, so these are not cluster tests: like the store contract's ZooKeeper
tests they fail in CI, and skip elsewhere, when ZooKeeper is not installed
(``private_zookeeper``). The tests that stop the server for good start one of their own;
the others share the module's server under a chroot each. Every wait is for something the
agent shows (an event, a line of its debug log, its exit) with a generous deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hpc_elastic import events
from hpc_elastic.agent.api import ExitCode
from hpc_elastic.ops import timeline
from hpc_elastic.rendezvous import testing

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parents[1] / "workloads" / "worker.py"
DEADLINE = 60.0
"""Seconds to wait for what a working agent shows within a second or two."""
OUTAGE_LIMIT = 8.0
"""The agents' ``--zk-outage-limit`` where the test waits for it to pass."""
GRACE = 5.0


def wait_for(condition: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
    ends = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < ends, f"never saw {what} within {deadline:g} s"
        time.sleep(0.05)


class Agents:
    """The agent processes of one job, each with its log (stdout and stderr) in a file."""

    def __init__(self, tmp_path: Path, hosts: str, nodes: str, **flags: str) -> None:
        self.zk = hosts
        self.nodes = nodes
        self.flags = flags
        self.dir = tmp_path / "job"
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, slot: str, seconds: str = "600", **env: str) -> None:
        """Agent ``slot``, whose workers train ``seconds`` (FAKE_WORKER_SECONDS)."""
        options = {
            "run-id": "run",
            "job-dir": str(self.dir),
            "zk": self.zk,
            "nodes": self.nodes,
            "nproc-per-node": "1",
            "grace": f"{GRACE:g}",
            "session-timeout": "2",
            "last-call": "0.5",
            "min-wait": "600",
            "slot": slot,
            "host": "127.0.0.1",
            **self.flags,
        }
        argv = [
            sys.executable,
            "-m",
            "hpc_elastic",
            "agent",
            *(f"--{key}={value}" for key, value in options.items()),
            "--zk-open-acl",
            "--no-preflight",
            "--",
            sys.executable,
            str(WORKER),
        ]
        environ = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "HPC_ELASTIC_LOG": "debug",
            "FAKE_WORKER_OUT": str(self.out),
            "FAKE_WORKER_SECONDS": seconds,
            **env,
        }
        with (self.logs / slot).open("wb") as log:
            self.procs[slot] = subprocess.Popen(
                argv, env=environ, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )

    def log(self, slot: str) -> str:
        return (self.logs / slot).read_text(errors="replace")

    def said(self, slot: str, text: str) -> Callable[[], bool]:
        return lambda: text in self.log(slot)

    def events(self) -> list[events.Event]:
        return list(events.read(self.dir / "events.jsonl"))

    def count(self, kind: str) -> Callable[[], int]:
        return lambda: sum(1 for event in self.events() if event.kind == kind)

    def exit_code(self, slot: str, deadline: float = DEADLINE) -> int:
        """The agent's exit status, once it has exited by itself."""
        try:
            return self.procs[slot].wait(deadline)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {slot} was still running {deadline:g} s later; its log ends:\n"
                + self.log(slot)[-3000:]
            ) from None

    def stop(self, slot: str, signum: int = signal.SIGTERM) -> int:
        """Send ``signum`` and return the exit status; the deadline allows its grace."""
        self.procs[slot].send_signal(signum)
        return self.exit_code(slot, GRACE + DEADLINE)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def own_server(tmp_path: Path, private_zookeeper: str) -> Iterator[testing.ZooKeeperServer]:
    """A server of the test's own, to stop for good."""
    del private_zookeeper  # Only for its skip-or-fail when ZooKeeper is missing.
    server = testing.ZooKeeperServer(tmp_path / "zk")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def chroot(private_zookeeper: str) -> str:
    """The module's server under a chroot of the test's own."""
    return f"{private_zookeeper}/outage-{uuid.uuid4().hex}"


def test_a_dead_ensemble_ends_every_agent_with_one_sentence_naming_it_and_the_bound(
    tmp_path: Path, own_server: testing.ZooKeeperServer
) -> None:
    """The server stops for good under a running 2-node job: the agents fence their workers,
    wait out ``--zk-outage-limit`` and exit 69 (not requeued) by themselves, each with the
    one sentence that names the ensemble and the bound, which the job's status shows too.
    Before, they retried the connection for ever and not even SIGTERM ended them."""
    agents = Agents(
        tmp_path, f"{own_server.hosts}/job", "2", **{"zk-outage-limit": f"{OUTAGE_LIMIT:g}"}
    )
    try:
        for slot in ("a0", "a1"):
            agents.start(slot)
        wait_for(lambda: agents.count("start")() == 2, "both agents start their workers")
        own_server.stop()
        codes = {slot: agents.exit_code(slot, OUTAGE_LIMIT + DEADLINE) for slot in ("a0", "a1")}
    finally:
        agents.kill_all()
    sentence = (
        f"ZooKeeper at '{own_server.hosts}/job' stayed out of reach for {OUTAGE_LIMIT:g} s "
        "(--zk-outage-limit), so this node leaves job 'run'"
    )
    assert codes == {"a0": ExitCode.UNREACHABLE, "a1": ExitCode.UNREACHABLE}
    for slot in ("a0", "a1"):
        log = agents.log(slot)
        said = [line for line in log.splitlines() if line.startswith("hpc-elastic agent: ")]
        assert [line for line in said if sentence in line] == [
            f"hpc-elastic agent: {sentence}; check that the ensemble runs and that this node "
            "reaches it, then submit the job again."
        ], log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    found = agents.events()
    assert sum(event.kind == "restart" for event in found) == 2, "fenced first: workers stopped"
    gave_up = [event for event in found if event.kind == "error"]
    assert sorted(str(event.details["reason"]).startswith(sentence) for event in gave_up) == [
        True,
        True,
    ]
    assert {event.details["exit_code"] for event in gave_up} == {ExitCode.UNREACHABLE}
    last_failure = timeline.summarize(found).last_failure
    assert last_failure is not None
    assert last_failure.startswith(sentence)


def test_a_sigterm_ends_an_agent_that_waits_for_a_dead_ensemble(
    tmp_path: Path, own_server: testing.ZooKeeperServer
) -> None:
    """The reconnecting phase: workers fenced, the agent waits for the connection, which the
    outage limit (ten minutes here) would end much later. Its rejoin blocks in kazoo, which
    holds the request until the connection comes back; before, the signal's handler only set
    a flag, and the leave that followed blocked the same way."""
    agents = Agents(tmp_path, f"{own_server.hosts}/job", "1", **{"zk-outage-limit": "600"})
    try:
        agents.start("a0")
        wait_for(lambda: agents.count("start")() == 1, "the agent start its workers")
        own_server.stop()
        wait_for(lambda: agents.count("restart")() == 1, "the agent fence its workers")
        wait_for(agents.said("a0", "a0: stopping -> joining"), "the agent rejoin")
        code = agents.stop("a0")
    finally:
        agents.kill_all()
    assert code == ExitCode.TERMINATED, agents.log("a0")[-3000:]
    assert "Traceback" not in agents.log("a0")
    left = [event for event in agents.events() if event.kind == "leave"]
    assert [event.details["exit_code"] for event in left] == [ExitCode.TERMINATED]


def test_a_sigterm_ends_an_agent_that_is_still_connecting(tmp_path: Path) -> None:
    """Starting: the ensemble takes the connection and never answers it. The connection
    runs on a thread of its own, and the signal, caught from the agent's first instant, ends
    the wait at once, long before the connect timeout (10 s)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        hosts = f"127.0.0.1:{silent.getsockname()[1]}"
        agents = Agents(tmp_path, hosts, "1")
        try:
            agents.start("a0")
            wait_for(agents.said("a0", "zookeeper: connecting to"), "the agent connect")
            code = agents.stop("a0")
        finally:
            agents.kill_all()
    log = agents.log("a0")
    assert code == ExitCode.TERMINATED, log[-3000:]
    assert "got SIGTERM before joining job 'run'" in log
    assert "did not answer within" not in log, "stopped by the signal, not by the timeout"
    assert "Traceback" not in log


@pytest.mark.parametrize(
    ("signum", "expected"),
    [(signal.SIGTERM, ExitCode.TERMINATED), (signal.SIGINT, ExitCode.INTERRUPTED)],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_stop_signal_ends_an_agent_that_waits_for_more_nodes(
    tmp_path: Path, chroot: str, signum: int, expected: ExitCode
) -> None:
    agents = Agents(tmp_path, chroot, "2")
    try:
        agents.start("a0")
        wait_for(agents.said("a0", "waiting for a round after round 0"), "the agent join")
        code = agents.stop("a0", signum)
    finally:
        agents.kill_all()
    assert code == expected, agents.log("a0")[-3000:]
    assert "Traceback" not in agents.log("a0"), "no KeyboardInterrupt either"


def test_a_sigterm_ends_an_agent_whose_workers_train(tmp_path: Path, chroot: str) -> None:
    agents = Agents(tmp_path, chroot, "1")
    try:
        agents.start("a0")
        wait_for(lambda: agents.count("start")() == 1, "the agent start its workers")
        code = agents.stop("a0")
    finally:
        agents.kill_all()
    assert code == ExitCode.TERMINATED, agents.log("a0")[-3000:]
    assert "Got SIGTERM; forwarding it to the workers" in agents.log("a0")


def test_a_sigterm_ends_an_agent_whose_workers_stop_for_an_arrival(
    tmp_path: Path, chroot: str
) -> None:
    """Stopping: a node arrives, and the workers get the arrival's grace (seconds) to save;
    these take a minute. The signal cuts that wait to its own grace (1 s here)."""
    agents = Agents(tmp_path, chroot, "1:2", grace="1")
    try:
        agents.start("a0", FAKE_WORKER_SAVE_SECONDS="60")
        wait_for(lambda: agents.count("start")() == 1, "the first agent start its workers")
        agents.start("a1")
        wait_for(agents.said("a0", "a0: running -> stopping"), "the first agent stop its workers")
        code = agents.stop("a0")
    finally:
        agents.kill_all()
    assert code == ExitCode.TERMINATED, agents.log("a0")[-3000:]
    assert "Traceback" not in agents.log("a0")


def test_a_sigterm_ends_an_agent_in_the_exit_barrier(tmp_path: Path, chroot: str) -> None:
    """Its workers are done, the other node's still train: the barrier's wait ends."""
    agents = Agents(tmp_path, chroot, "2")
    try:
        agents.start("a0", seconds="0.5")
        agents.start("a1")
        wait_for(agents.said("a0", "a0: running -> succeeding"), "the first agent finish")
        code = agents.stop("a0")
    finally:
        agents.kill_all()
    assert code == ExitCode.TERMINATED, agents.log("a0")[-3000:]
    assert "waiting for the other nodes" in agents.log("a0")
    assert "Traceback" not in agents.log("a0")
