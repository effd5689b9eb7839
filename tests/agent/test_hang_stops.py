"""A stop signal or the outage limit during a hang's investigation still ends the agent.

The investigation shares what the agent saw and waits for the others' evidence through the
rendezvous; on ZooKeeper each request may be held by kazoo until the connection comes back,
for ever when the ensemble is gone. Here the store holds every ``share`` of the investigation
(a real agent, real workers, the real rendezvous on the in-memory store, whose ``share`` is
held as kazoo would hold it): a SIGTERM must still end the agent, its workers stopped within
its grace, and a cut-off that outlasts the outage limit must still end it with exit 69.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from agent_fakes import MemoryJob
from test_agent_watchdog import QUICK

from hpc_elastic.agent.agent import Agent
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.agent.workers import Worker
from hpc_elastic.errors import RendezvousUnreachableError
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.memory import MemoryStore
from hpc_elastic.spec import NodeRange

WORKER = Path(__file__).parents[1] / "workloads" / "worker.py"
DEADLINE = 60.0
"""Seconds to wait for what happens within a second or two (the hang's deadline is learned
from 0.1 s beats, at least half a second)."""
GRACE = 2.0


class HeldShares(StoreRendezvous):
    """The real rendezvous, but a hang's note is held until ``release`` (as kazoo holds a
    request while the connection is down); ``cut_off`` makes the outage limit pass."""

    def __init__(self, settings: RendezvousSettings, node: NodeInfo, store: MemoryStore) -> None:
        super().__init__(settings, node, store)
        self.held = threading.Event()
        self.release = threading.Event()
        self.cut_off = False

    def share(self, topic: str, data: bytes) -> None:
        self.held.set()
        self.release.wait()
        super().share(topic, data)

    def suspended_since(self) -> float | None:
        return 0.0 if self.cut_off else super().suspended_since()

    def check_reach(self) -> None:
        if self.cut_off:
            raise RendezvousUnreachableError(
                "The rendezvous stayed out of reach for 8 s (--zk-outage-limit); leaving."
            )
        super().check_reach()


@dataclass
class Held:
    """An agent whose hang's investigation waits on a held request."""

    agent: Agent
    rdzv: HeldShares
    workers: list[Worker]
    thread: threading.Thread
    result: dict[str, ExitCode]

    def ended(self) -> bool:
        """Whether the agent ended by itself; the held request is let go either way, so that
        no thread of the test outlives it."""
        self.thread.join(GRACE + DEADLINE)
        alive = self.thread.is_alive()
        self.rdzv.release.set()
        self.thread.join(DEADLINE)
        return not alive


def start_agent(tmp_path: Path) -> Held:
    """One node of two ranks whose rank 0 stops beating in round 1: a hang."""
    settings = RendezvousSettings(
        "held", NodeRange.parse("1"), last_call=0.3, session_timeout=1.0, min_wait=5.0
    )
    job = MemoryJob(settings)
    store = job.server.connect(settings.run_id, settings.session_timeout)
    rdzv = HeldShares(settings, NodeInfo("node0", "127.0.0.1", 2, "n0"), store)
    out = tmp_path / "out"
    out.mkdir()
    spec = AgentSpec(
        job_dir=tmp_path / "job",
        command=(sys.executable, str(WORKER)),
        nproc_per_node=2,
        grace=GRACE,
    )
    environ = {
        **os.environ,
        "FAKE_WORKER_OUT": str(out),
        "FAKE_WORKER_STOP": "1:0",
        "FAKE_WORKER_SECONDS": "600",
    }
    said: list[str] = []
    agent = Agent(spec, rdzv, environ=environ, say=said.append, deadline_rules=QUICK)
    result: dict[str, ExitCode] = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", agent.run()), daemon=True)
    thread.start()
    assert rdzv.held.wait(DEADLINE), f"the hang was never investigated: {said}"
    group = agent._group  # the round's workers, to see them gone at the end
    assert group is not None
    return Held(agent, rdzv, list(group.workers), thread, result)


def test_a_sigterm_during_a_hangs_investigation_ends_the_agent_and_its_workers(
    tmp_path: Path,
) -> None:
    held = start_agent(tmp_path)
    held.agent.request_stop(signal.SIGTERM)  # what the agent command's handler does
    assert held.ended(), "the agent was still in the investigation's request"
    assert held.result["code"] == ExitCode.TERMINATED
    assert None not in [worker.returncode for worker in held.workers], "its workers were stopped"


def test_the_outage_limit_during_a_hangs_investigation_ends_the_agent(tmp_path: Path) -> None:
    held = start_agent(tmp_path)
    held.rdzv.cut_off = True
    assert held.ended(), "the agent was still in the investigation's request"
    assert held.result["code"] == ExitCode.UNREACHABLE
    assert None not in [worker.returncode for worker in held.workers], "its workers were stopped"
