"""An in-memory multi-agent rendezvous, so agent tests run in one process without ZooKeeper.

Several ``FakeRendezvous`` (one per agent thread) share one ``FakeJob``. The rules follow
the ``Rendezvous`` contract: a round forms once MIN nodes wait and either MAX are there or
the last call elapsed; a leaving, arriving or failing node supersedes the round and sets
every other member's ``changed``; the first failure report of a round spends the budget.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

from hpc_elastic.errors import RendezvousClosedError
from hpc_elastic.rendezvous.api import (
    Failure,
    JobFailedError,
    NodeInfo,
    Rendezvous,
    RendezvousSettings,
    Round,
)


@dataclass
class FakeJob:
    settings: RendezvousSettings
    cond: threading.Condition = field(default_factory=threading.Condition)
    waiting: dict[str, NodeInfo] = field(default_factory=dict)
    current: Round | None = None
    number: int = 0
    restarts_used: int = 0
    reported_round: int = -1
    root_cause: Failure | None = None
    failed: str | None = None
    closed: bool = False
    succeeded: set[str] = field(default_factory=set)
    agents: dict[str, FakeRendezvous] = field(default_factory=dict)
    min_since: float | None = None

    def supersede(self, by: str) -> None:
        if self.current is None:
            return
        for member in self.current.members:
            if member.node_id != by and member.node_id in self.agents:
                self.agents[member.node_id].changed.set()
        self.current = None

    def try_form(self) -> None:
        nodes = self.settings.nodes
        if len(self.waiting) < nodes.min:
            self.min_since = None
            return
        if self.min_since is None:
            self.min_since = time.monotonic()
        if (
            len(self.waiting) < nodes.max
            and time.monotonic() - self.min_since < self.settings.last_call
        ):
            return
        self.number += 1
        members = tuple(list(self.waiting.values())[: nodes.max])
        self.current = Round(
            number=self.number,
            members=members,
            master_addr="127.0.0.1",
            master_port=_free_port(),
            restarts_used=self.restarts_used,
            max_restarts=self.settings.max_restarts,
        )
        self.waiting.clear()
        self.min_since = None
        self.succeeded.clear()
        self.cond.notify_all()


@dataclass
class FakeRendezvous(Rendezvous):
    job: FakeJob = field(kw_only=True)
    left: bool = False

    def next_round(self) -> Round:
        job = self.job
        with job.cond:
            self.changed.clear()
            job.agents[self.node.node_id] = self
            if job.current is not None and self.node.node_id not in job.waiting:
                job.supersede(self.node.node_id)
            job.waiting[self.node.node_id] = self.node
            deadline = time.monotonic() + self.settings.min_wait
            while True:
                if job.closed:
                    raise RendezvousClosedError("closed")
                if job.failed is not None:
                    raise JobFailedError(job.failed)
                current = job.current
                if current is not None and any(
                    m.node_id == self.node.node_id for m in current.members
                ):
                    return current
                if time.monotonic() > deadline:
                    job.failed = f"fewer than {self.settings.nodes.min} nodes joined in time"
                    job.cond.notify_all()
                    continue
                job.try_form()
                job.cond.wait(0.05)

    def report_failure(self, failure: Failure) -> None:
        job = self.job
        with job.cond:
            if job.reported_round != job.number:
                job.reported_round = job.number
                job.restarts_used += 1
                job.root_cause = failure
                if job.restarts_used > self.settings.max_restarts:
                    job.failed = (
                        f"the restart budget ({self.settings.max_restarts}) is spent; "
                        f"root cause: rank {failure.rank} on {failure.node_id}"
                    )
            job.supersede(self.node.node_id)
            job.cond.notify_all()

    def report_success(self) -> None:
        job = self.job
        with job.cond:
            current = job.current
            assert current is not None
            job.succeeded.add(self.node.node_id)
            while not job.closed:
                if job.failed is not None:
                    raise JobFailedError(job.failed)
                if job.succeeded >= {m.node_id for m in current.members}:
                    job.closed = True
                    job.cond.notify_all()
                    return
                job.cond.wait(0.05)

    def close(self) -> None:
        with self.job.cond:
            self.job.closed = True
            self.job.cond.notify_all()

    def leave(self) -> None:
        job = self.job
        with job.cond:
            self.left = True
            job.waiting.pop(self.node.node_id, None)
            job.agents.pop(self.node.node_id, None)
            if job.current is not None and any(
                m.node_id == self.node.node_id for m in job.current.members
            ):
                job.supersede(self.node.node_id)
            job.cond.notify_all()

    def vanish(self) -> None:
        """What a crashed node looks like to the others once its session expires."""
        self.leave()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
