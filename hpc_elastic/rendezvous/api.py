"""What a node agent needs from a rendezvous, independent of where the state lives.

The agent only ever sees this module: ``Rendezvous`` (implemented on ZooKeeper for clusters
and on an embedded store for local mode) and the value types it returns. Everything is JSON
on the wire; nothing here may be pickled.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from hpc_elastic import contract
from hpc_elastic.errors import RendezvousError
from hpc_elastic.rendezvous.once import Memo
from hpc_elastic.spec import NodeRange


class JobFailedError(RendezvousError):
    """The job as a whole has failed (restart budget spent, MIN never met): stop, do not rejoin."""


@dataclass(frozen=True)
class RendezvousSettings:
    """Knobs shared by every agent of one job; see docs/rendezvous.md for the defaults' reasons."""

    run_id: str
    nodes: NodeRange
    last_call: float = contract.DEFAULT_LAST_CALL
    """Seconds a round waits for more nodes once MIN are present (torchrun waits 30)."""
    session_timeout: float = contract.DEFAULT_SESSION_TIMEOUT
    """ZooKeeper session: a crashed node is noticed within this many seconds."""
    min_wait: float = contract.DEFAULT_MIN_WAIT
    """Seconds the job may stay below MIN nodes before it fails."""
    max_restarts: int = contract.DEFAULT_MAX_RESTARTS
    """Worker-failure restarts for the whole job; membership changes do not spend it."""
    stop_grace: float = 2.0
    """Seconds an agent gives its workers to stop when its round ends (``AgentSpec.stop_grace``);
    part of how long the others wait for it to come back (``state.straggler_timeout``)."""
    exit_barrier_timeout: float = 300.0
    """Seconds a node whose workers finished waits for the others (torchrun's default) before
    it fails the job, naming a node that never finished."""
    outage_limit: float | None = None
    """Seconds the store may stay out of reach before a wait on it gives up with
    ``RendezvousUnreachableError`` (``--zk-outage-limit``); None: ``min_wait``, as before the
    agent had the option (the simulation and the torchrun plugin)."""

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id:
            raise RendezvousError(
                f"Run id '{self.run_id}' is not usable; give a non-empty id without '/'."
            )
        if (
            self.last_call < 0
            or self.session_timeout <= 0
            or self.min_wait < 0
            or self.stop_grace < 0
            or self.exit_barrier_timeout <= 0
        ):
            raise RendezvousError(
                "Rendezvous timeouts must be positive; check --last-call, --session-timeout "
                "and --min-wait."
            )
        if self.max_restarts < 0:
            raise RendezvousError(
                f"--max-restarts '{self.max_restarts}' is negative; give 0 or more."
            )
        if self.outage_limit is not None and self.outage_limit <= 0:
            raise RendezvousError(
                f"--zk-outage-limit '{self.outage_limit:g}' is not positive; give the seconds an "
                "agent may stay cut off from ZooKeeper before it leaves the job."
            )

    @property
    def give_up_after(self) -> float:
        """Seconds cut off from the store after which a wait on it gives up."""
        return self.min_wait if self.outage_limit is None else self.outage_limit


@dataclass(frozen=True)
class NodeInfo:
    """One agent incarnation as the other agents see it."""

    node_id: str
    """Unique per agent process, so a restarted agent on the same node is a new member."""
    host: str
    """Address that workers on other nodes use to reach this node (MASTER_ADDR if rank 0)."""
    nproc: int
    """Workers this node runs (LOCAL_WORLD_SIZE)."""
    slot: str = ""
    """Slurm slot (array task id or node name); empty outside Slurm."""
    link_port: int = 0
    """Where this agent accepts the links of a round it is the centre of (group rank 0), on
    ``host``; 0: it takes none, and its death is noticed by its session alone
    (agent/links.py, docs/rendezvous.md "A killed node noticed at once")."""


_RANKS: Memo[dict[str, int]] = Memo()


def member_ranks(members: tuple[NodeInfo, ...]) -> dict[str, int]:
    """Each member's rank, by node id; computed once for a round's members, which every
    agent of a process holds as one tuple (a scan of 4,096 members, each agent of a round
    asking, was O(N²) a round in a process driving thousands of agents)."""
    return _RANKS.get((members,), lambda: {m.node_id: rank for rank, m in enumerate(members)})


@dataclass(frozen=True)
class Round:
    """A completed rendezvous round: who trains together and where the master listens."""

    number: int
    members: tuple[NodeInfo, ...]
    """Ordered by node rank (GROUP_RANK); index 0 hosts the master."""
    master_addr: str
    master_port: int
    restarts_used: int
    max_restarts: int

    def group_rank(self, node_id: str) -> int:
        rank = member_ranks(self.members).get(node_id)
        if rank is None:
            raise RendezvousError(f"Node '{node_id}' is not a member of round {self.number}.")
        return rank

    @property
    def world_size(self) -> int:
        return sum(member.nproc for member in self.members)

    def first_rank(self, node_id: str) -> int:
        """Global rank of this node's LOCAL_RANK 0."""
        group_rank = self.group_rank(node_id)
        return sum(member.nproc for member in self.members[:group_rank])


@dataclass(frozen=True)
class Failure:
    """The root cause of a worker-group failure, kept in the rendezvous state for `status`."""

    node_id: str
    host: str
    rank: int
    exit_code: int | None
    signal: str | None
    message: str
    """The worker's own error (traceback from TORCHELASTIC_ERROR_FILE), trimmed."""
    time: float
    slot: str = ""


@dataclass
class Rendezvous(ABC):
    """One agent's view of the job's rendezvous.

    ``changed`` is set (from a watch, never by polling) as soon as the current round is
    superseded: a member left or arrived, another node reported a failure, or the job
    closed. The agent then stops its workers and calls ``next_round`` again.
    """

    settings: RendezvousSettings
    node: NodeInfo
    changed: threading.Event = field(default_factory=threading.Event)
    on_spare: Callable[[int], None] | None = None
    """Called once per round (its number) in which this node waits as a hot spare: the round
    is full, and this node joins the next one when a member is lost (``submit --spares``)."""
    pick_master_port: Callable[[], int] | None = None
    """Chooses the port this node publishes as a round's ``master_port`` when it is the round's
    group rank 0; None: a free port. The agent's store host opens the round's TCPStore on it
    first, so that the port is published only once it listens (agent/storehost.py)."""

    @abstractmethod
    def next_round(self) -> Round:
        """Join (idempotently) and block until a round that includes this node completes.

        Clears ``changed``. Raises RendezvousClosedError when the job is finished or
        cancelled, JobFailedError when it failed or stayed below MIN for ``min_wait``.
        """

    @abstractmethod
    def report_failure(self, failure: Failure) -> None:
        """Spend one restart of the job's budget and ask every agent for a new round.

        Only the first report per round spends the budget and becomes the root cause;
        the job fails (JobFailedError from the next ``next_round``) when the budget is spent.
        """

    @abstractmethod
    def fail(self, summary: str) -> None:
        """Fail the whole job now, with ``summary`` as its cause, without spending a restart:
        for failures no restart can fix (a user error, the no-progress breaker). Every
        agent's round is superseded and its next ``next_round`` raises JobFailedError."""

    @abstractmethod
    def report_success(self) -> bool:
        """Record that this node's workers all exited 0, then wait for the other members.

        An exit barrier: returns True once every member of the round has succeeded (the last
        one closes the job), False when a worker failure elsewhere ended the round with
        budget left (call ``next_round``: the job reruns from its checkpoint), or raises
        JobFailedError if the job failed, a member vanished, or a member did not finish
        within ``exit_barrier_timeout``.
        """

    def report_departed(self, node_id: str, round_number: int) -> bool:
        """This node's link of round ``round_number`` to member ``node_id`` ended in order
        (its kernel closed it: the process exited); mark it departed (``state.depart``) so
        that the next round forms without waiting for its session. Whether the state holds
        it departed for that round now. Blocks on the store; False by default (no links)."""
        del node_id, round_number
        return False

    def check_reach(self) -> None:
        """Raise ``RendezvousUnreachableError`` once the store has been out of reach for
        ``settings.give_up_after`` seconds, with the sentence that names it; a rendezvous that
        cannot be cut off never raises."""
        return None

    def suspended_since(self) -> float | None:
        """Monotonic time since which the connection to the store is down (None: it is up).

        The agent stops its workers once this outlasts the session timeout: by then the
        others may form a round without this node (see docs/agent.md, "Fencing")."""
        return None

    def time_cut_off(self) -> float:
        """Seconds the connection to the store was down, summed over the outages that have
        ended: news of that time (a re-fired watch) reaches this node only afterwards."""
        return 0.0

    def job_running(self) -> bool:
        """Whether the job already trains (``state.running``): a node that joins now ends the
        running round. False when it cannot tell."""
        return False

    def only_arrivals(self) -> bool:
        """Whether this node's round was superseded only by nodes waiting to join
        (``state.only_arrivals``): its workers then get ``state.arrival_grace`` to save.
        False when it cannot tell (the short grace is the safe one)."""
        return False

    def peer_lost(self) -> bool:
        """Whether the round that ``changed`` ended lost a rank (a failure was recorded for
        it, or a member is gone): its other ranks cannot reach a step boundary, so the agent
        stops them without waiting its grace (``state.peer_lost``). False by default."""
        return False

    @abstractmethod
    def share(self, topic: str, data: bytes) -> None:
        """Publish this node's note on ``topic`` (replacing its earlier one), for every member
        to read until the job closes: e.g. what this node saw of a hang (agent/hangs.py).
        ``topic`` has no '@'. A new topic wakes every agent (``topics``), a new note on it
        those that follow it (``sharers``)."""

    @abstractmethod
    def shared(self, topic: str) -> dict[str, bytes]:
        """Every node's note on ``topic``, by node id, as the store holds them now."""

    @abstractmethod
    def topics(self, prefix: str) -> frozenset[str]:
        """Every topic starting with ``prefix`` that has a note, or an answer (``agree``).
        From what the store last pushed: no request, so an agent may ask at every poll."""

    @abstractmethod
    def sharers(self, topic: str) -> frozenset[str]:
        """The ids of the nodes that shared on ``topic``, following it from now on: the first
        call asks the store, the next ones make no request (an agent may ask at every poll).
        One topic an agent at a time: a topic of thousands of notes is pushed only to the
        agents that follow it, so only the agent that reads them all should."""

    @abstractmethod
    def agree(self, topic: str, data: bytes) -> bytes:
        """Propose ``data`` as the one answer on ``topic``; return the answer: ours if it was
        the first, else the first one. Agents that decided apart (on evidence that reached
        each at a different time) so act on one answer."""

    @abstractmethod
    def agreed(self, topic: str) -> bytes | None:
        """The answer agreed on ``topic``, or None while nobody proposed one."""

    @abstractmethod
    def forget(self, topic: str) -> None:
        """Remove every note on ``topic`` and its answer, for every member: a topic nobody
        reads again (a past round's hang), whose notes would otherwise stay in the store
        until the job closes."""

    @abstractmethod
    def close(self) -> None:
        """Close the job for everyone: late agents exit cleanly; the job's state is removed."""

    @abstractmethod
    def leave(self) -> None:
        """Leave cleanly (membership is dropped at once) and release the connection."""
