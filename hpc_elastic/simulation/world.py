"""A seeded, single-threaded world that drives the real rendezvous and agent rules.

What runs is production code: ``rendezvous/state.py`` through ``StoreRendezvous``'s step
functions (``begin_round``/``round_step``, ``begin_barrier``/``barrier_step``,
``report_failure``), over the stores engineer's ``MemoryStore`` (ZooKeeper's semantics: CAS,
sessions that expire at tick granularity, SUSPENDED/LOST/CONNECTED), the agent's pure
poll (``rules.poll_decision``: the lease rule, ``round_outcome``, ``connection_fenced``),
and the agent's reaction to how a round ended (``rules.after_round``: drain, barrier, stop,
report, leave or rejoin), looked up on the module at every call so that a test can break
it for both. ``SimAgent`` only executes the actions in the simulated world; it holds no
rule of its own. What is simulated is only what surrounds them: time, the delivery of
watches (late, twice), worker processes, one to three per node (a stale lease makes one exit
``FENCED_EXIT_CODE``, as train/lease.py does), agent processes (crash, freeze, partition),
and Slurm (start, preempt, requeue).

The world checks the properties of docs/reliability.md as it goes: every state the server
accepts is compared with the one before it (``Properties.written``), every round a node
starts with what the others started (``Properties.check_start``), every failure report with
what it must spend (``Properties.check_report``), and the job's end with the faults that were
injected (``Properties.check_end``).

One schedule is one seed: ``simulate(seed)`` is reproducible bit for bit, and a violated
property prints the command that replays it. See docs/reliability.md for the properties.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import logging
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hpc_elastic.agent import links, rules
from hpc_elastic.agent.rules import AfterRound, Outcome, RoundEnd, fence_after, poll_decision
from hpc_elastic.contract import FENCED_EXIT_CODE
from hpc_elastic.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousUnreachableError,
)
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import (
    Failure,
    JobFailedError,
    NodeInfo,
    RendezvousSettings,
    Round,
)
from hpc_elastic.rendezvous.backend import ABSENT
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.memory import Deliver, ManualClock, MemoryServer, MemoryStore, View
from hpc_elastic.spec import NodeRange

SESSION = 6.0
TICK = 1.0
"""How often the server looks for expired sessions, connected clients ping, and running
agents poll (the real agent polls every 0.1 s, and also reacts at once to every event that
wakes the simulated one): ZooKeeper's expiry is noticed at tick granularity."""
LEASE = fence_after(SESSION)
"""The workers' lease timeout, as the agent passes it in HPC_ELASTIC_LEASE_TIMEOUT."""
HANG_TIMEOUT = 30.0
"""A hung worker is killed (and counted as a failure) this long after it stopped beating."""
FAULT_WINDOW = 90.0
LIVENESS_BOUND = 400.0
"""Seconds after the last fault by which every job must have ended: min_wait (60) + the
straggler deadline + the exit barrier (60) + requeue delays, with room to spare."""
HORIZON = 5000.0
SHRUNK_IN_REPORT = 5
"""A report shrinks (and shows) its first five violations: the rest are usually the same bug."""
AFTER_ROUND_STEPS = 20
"""More actions than ``after_round`` ever takes for one round (it takes at most seven): a
rule that keeps asking for more is a liveness bug of its own."""
UNREACHABLE = "unreachable"
"""How an agent cut off for longer than the outage limit ends (``SimAgent._guard``)."""
FAULT_KINDS = ("worker_fail", "hang", "crash", "freeze", "partition", "preempt", "stuck")
"""``stuck``: the agent hangs for good on an unkillable worker while its ZooKeeper client
keeps the session alive: the others must go on without it (``straggler_timeout``, the exit
barrier's deadline). The job's end is then judged without it; Slurm's time limit ends it."""
PROPERTIES = frozenset(
    {
        "liveness",
        "ranks",
        "rounds",
        "budget",
        "closure",
        "success",
        "state",
        "cause",
        "crash",
        "speed",
    }
)
"""The properties a violation names first (``violated_property``)."""
BUGGIFY_SHARE = 0.25
"""The share of schedules in which faults are also planted at the moments that matter."""
BUGGIFY_CHANCE = 0.3
"""How often such a moment gets its fault in a buggified schedule (once per node and round)."""
PORT_BASE = 29500
LINK_DELAY = 0.001
"""Seconds for the end of a link (agent/links.py) to reach the agent at its other end."""
SPARE_SHARE = 0.25
"""The share of schedules whose job has one hot spare (``submit --spares 1``): a slot beyond
MAX, which waits beside a full round and joins the next one when a member is lost."""
EVERYWHERE_SHARE = 1 / 3
"""The share of ``worker_fail`` faults that hit every node's workers at once (a bug that
every rank hits at the same step): each node reports it, and the round is charged once."""
WORKERS_PER_NODE = (1, 2, 3)
"""Each slot's node runs one of these many workers (LOCAL_WORLD_SIZE), drawn per slot: a node
is done only when every one of its workers exited 0."""
FAILING = frozenset({"worker_fail", "hang", "stuck"})
"""Faults that make a worker really fail (a stuck node counts as one, see ``World.fault``):
the only ones that may spend a restart."""
NODE_LOSS = frozenset({"crash", "freeze", "partition", "preempt", "stuck"})
"""Faults that take a node away from the rendezvous (for a while, or for good)."""
CAUSES = {
    "restarts are spent": "budget",
    "nodes needed joined within": "below_min",
    "before its workers finished": "member_lost",
    "did not finish round": "unfinished",
}
"""The job's failure summaries (``rendezvous/state.py``, ``handler.py``) by the cause they
name; a failure with none of them is a violation."""
EXPLAINED_BY = {
    "budget": FAILING,
    "below_min": NODE_LOSS,
    "member_lost": NODE_LOSS,
    "unfinished": NODE_LOSS,
}
"""Which injected faults can explain each cause of a failed job: at least one of them must
have hit the job (and for ``budget``, more rounds really failed than the budget allows)."""


@dataclass
class Worker:
    round: int
    rank_node: str
    exit_at: float
    code: int
    """Exit code at ``exit_at``: 0 succeeds, 1 fails (a real failure, charged)."""
    training: bool = True
    exited: bool = False
    echo: bool = False
    """It died of a peer's death (its collective broke): an echo, never to be charged."""
    local_rank: int = 0


@dataclass(frozen=True)
class Fault:
    """One planned fault: ``kind`` hits the agent of ``slot`` at ``when`` seconds."""

    when: float
    kind: str
    slot: int

    def text(self) -> str:
        """Exact (``repr`` of the float), so that the replay is the same schedule."""
        return f"{self.kind}@{self.when!r}:{self.slot}"

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``crash@12.5:1`` (as ``text`` writes it): the replay command's ``--faults``."""
        kind, _, rest = text.partition("@")
        when, _, slot = rest.partition(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault '{text}' names no kind of {', '.join(FAULT_KINDS)}")
        return cls(float(when), kind, int(slot))


@dataclass
class Result:
    seed: int
    outcome: str
    violation: str | None
    trace: list[str]
    restarts_used: int
    end_time: float
    faults: tuple[Fault, ...] = ()
    """The faults that ran: the seed's own, or those given in place of them."""
    chosen: bool = False
    """Whether ``faults`` replaced the seed's own (a shrunk schedule's replay needs them)."""
    cause: str | None = None
    """For a failed job, what its failure names (``CAUSES``): budget, below_min, ..."""
    rounds: int = 0
    """Rounds formed."""

    @property
    def kind(self) -> str:
        """The outcome with the failure's cause: ``failed (budget)``, ``succeeded``."""
        return self.outcome if self.cause is None else f"{self.outcome} ({self.cause})"

    def replay(self) -> str:
        """The command that runs this schedule again, trace and all."""
        command = f"python -m hpc_elastic.simulation --seed {self.seed}"
        if self.chosen:
            command += f" --faults '{','.join(fault.text() for fault in self.faults)}'"
        return f"{command} --trace"

    def summary(self) -> str:
        if self.violation is None:
            return f"seed {self.seed}: ok, {self.kind} at t={self.end_time:.1f} s"
        return f"seed {self.seed}: VIOLATION: {self.violation}\nreplay: {self.replay()}"


@dataclass
class Report:
    first_seed: int
    schedules: int
    failures: list[Result] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    """Schedules per outcome and cause (``Result.kind``)."""
    restarts: int = 0
    """Restarts spent, over all schedules."""
    rounds: int = 0
    """Rounds formed, over all schedules."""

    def add(self, result: Result) -> None:
        self.outcomes[result.kind] = self.outcomes.get(result.kind, 0) + 1
        self.restarts += result.restarts_used
        self.rounds += result.rounds

    def merge(self, other: Report) -> None:
        """Add a report of other seeds (``bench/simulate.py``'s chunks)."""
        self.failures.extend(other.failures)
        for kind, count in other.outcomes.items():
            self.outcomes[kind] = self.outcomes.get(kind, 0) + count
        self.restarts += other.restarts
        self.rounds += other.rounds

    def figures(self) -> dict[str, object]:
        """What a behaviour change shows up in: outcomes by cause, restarts and rounds."""
        return {
            "outcomes": dict(sorted(self.outcomes.items())),
            "restarts": self.restarts,
            "rounds": self.rounds,
        }

    def summary(self) -> str:
        lines = [
            f"{self.schedules} schedules from seed {self.first_seed}: "
            f"{len(self.failures)} violated a property; "
            f"outcomes {dict(sorted(self.outcomes.items()))}; "
            f"{self.restarts} restarts spent in {self.rounds} rounds"
        ]
        lines += [failure.summary() for failure in self.failures[:5]]
        return "\n".join(lines)


class Violation(Exception):
    """A property did not hold."""


class SimAgent:
    """One agent process (one incarnation) of slot ``slot``: the real agent's decisions
    (``poll_decision``, ``after_round``), executed in the simulated world.

    Why 22 methods: it stands for ``Agent``'s loop, one step method per phase (joining, the
    exit barrier, an echo's wait, running), for its workers (their start, exit, echo and
    fencing) and for each way its process ends (done, exit for requeue, crash). Every
    decision is a production rule; what is left is one small executor per action, and the
    checks of what it does are ``Properties``'.
    """

    def __init__(self, world: World, slot: int, incarnation: int) -> None:
        self.world = world
        self.slot = slot
        nproc = world.nprocs[slot]
        self.node = NodeInfo(f"n{slot}.{incarnation}", f"host{slot}", nproc, str(slot))
        self.store: MemoryStore = world.server.connect("job", SESSION)
        self.handler = StoreRendezvous(
            world.settings,
            self.node,
            self.store,
            clock=world.clock,
            pick_port=functools.partial(port_of, self.node),
        )
        self.phase = "joining"
        self.workers: list[Worker] = []
        """The workers of the latest round this node started (one per local rank)."""
        self.last_started = 0
        """The latest round this incarnation started workers in."""
        self.centre = ""
        """That round's group rank 0, the centre of its links (agent/links.py): this node
        holds links of ``last_started`` to it (or, at the centre, from every other member)."""
        self.lease = 0.0
        self.seen_generation = -1
        self.frozen_until = 0.0
        self.stop_signal = False
        self.fail_next = False
        self.hang_next = False
        self.gone = False
        self.stuck = False
        self.ending = RoundEnd(Outcome.SUCCEEDED)
        """The facts of the round being wound up while the exit barrier or an echo waits."""
        self.reported = False
        """Whether this round's failure was reported (``Properties.check_reaction``)."""
        self.wait_started = 0.0
        """When an echo's wait for the peer's news began (``rules.echo_deadline``)."""
        self.cut_off_before = 0.0
        """The handler's ``time_cut_off`` when that wait began."""
        self.wait_until = 0.0
        """The deadline of that wait a step is due at (a given-back outage moves it)."""

    # --- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self.world.log(f"{self.node.node_id} starts")
        self._guard(self.handler.begin_round)
        self.step()

    def step(self) -> None:
        """React to whatever happened: one decision of the phase we are in."""
        if self.gone or self.stuck or self.world.now < self.frozen_until:
            return
        if self.phase == "joining":
            self._guard(self._join_step)
        elif self.phase == "barrier":
            self._guard(self._barrier_step)
        elif self.phase == "waiting":
            self._guard(self._wait_step)
        elif self.phase == "running":
            self._poll()

    def _guard(self, action: Callable[[], None]) -> None:
        """The real agent's loop (``Agent.run``): job over, job closed, cut off for longer
        than the outage limit (exit 69, not requeued), or out of reach (exit 75, requeued)."""
        try:
            action()
        except JobFailedError as error:
            self._finish("failed", str(error))
        except RendezvousClosedError:
            self._finish("closed", "")
        except RendezvousUnreachableError as error:
            # ``Agent._unreachable``: the node leaves for good and its slot is not requeued.
            # No drawn schedule gets here: its longest outage (``_cut_off``: three sessions,
            # 18 s, plus a notification up to 3 s late) is far under the limit
            # (``give_up_after``: ``min_wait``, 60 s), so ``check_end`` counts it a violation.
            self._finish(UNREACHABLE, str(error))
        except RendezvousError as error:
            self._exit_requeue(f"rendezvous error: {error}")

    def _join_step(self) -> None:
        if self.stop_signal:
            self._exit_requeue("signalled while joining")
            return
        for _ in range(100):
            # The view the decision is made on (none is judged after a reconnection, when the
            # handler first reads the server's state again).
            view = None if self.handler._stale else self._view()
            step = self.handler.round_step()
            if view is not None:
                self.world.properties.check_last_call(self, step.action, *view)
            if not step.again:
                break
        else:
            raise Violation(f"liveness: {self.node.node_id}: round_step never settles")
        self.seen_generation = self.handler.generation
        if step.round is not None:
            self._start_workers(step.round)
        elif step.wake_at is not None:
            self.world.at(step.wake_at, self.step)

    def _view(self) -> tuple[st.JobState | None, frozenset[str], frozenset[str]] | None:
        """What this node decides on now: the state, the live nodes, and who it knows to be
        back from the state's round (the handler's own reading of the marks). None for a
        state so old that the server no longer has its round's table: the handler reads
        the state again before it decides."""
        data, _ = self.store.get_state()
        alive = self.store.alive()
        if data is None:
            return None, alive, frozenset()
        state = held(data, self.world.server)
        if state is None:
            return None
        return state, alive, self.handler._back(state, alive)

    def _barrier_step(self) -> None:
        """The exit barrier, one decision; its answer (or a stop signal) goes back to
        ``after_round``, as ``report_success``'s does in the agent."""
        if self.stop_signal:  # the real barrier wait is interruptible
            self._after_round(self.ending)
            return
        for _ in range(100):
            step = self.handler.barrier_step()
            if not step.again:
                break
        else:
            raise Violation(f"liveness: {self.node.node_id}: barrier_step never settles")
        self.seen_generation = self.handler.generation
        if step.done is not None:
            self._after_round(replace(self.ending, barrier=step.done))
        elif step.wake_at is not None:
            self.world.at(step.wake_at, self.step)

    def _wait_step(self) -> None:
        """An echo's wait to hear of the peer that really failed, as ``Agent._wait_for_change``
        waits: until the rendezvous says something changed, a stop signal, or ``echo_wait``."""
        heard = not self.stop_signal and self.handler.changed.is_set()
        # A freeze here is an outage too (``World.fault``): the handler counts it.
        unheard = self.handler.time_cut_off() - self.cut_off_before
        wait_until = rules.echo_deadline(self.wait_started, self.world.settings, unheard)
        if heard or self.stop_signal or self.world.now >= wait_until:
            stalled = not heard and rules.overslept(wait_until, self.world.now)
            cut_off = not heard and self.handler.suspended_since() is not None
            self._after_round(
                replace(self.ending, heard_change=heard, stalled=stalled, cut_off=cut_off)
            )
        elif wait_until != self.wait_until:
            self.wait_until = wait_until
            self.world.at(wait_until, self.step)

    def _rejoin(self) -> None:
        self.phase = "joining"
        self.handler.begin_round()
        self._join_step()

    # --- workers -------------------------------------------------------------------------------

    def _start_workers(self, started: Round) -> None:
        """One worker per local rank. The drawn fate (fail, hang or finish) is one rank's; the
        others finish a little after a finishing one (training ends at the same step on every
        rank), or die of the failing one (an echo). Their draws come from the world's
        ``workers_rng``, so a one-worker node draws from ``rng`` exactly as before."""
        world = self.world
        now = world.now
        number = started.number
        if self.hang_next:
            self.hang_next = False
            exit_at, code = now + HANG_TIMEOUT, 1
        elif self.fail_next:
            self.fail_next = False
            exit_at, code = now + world.rng.uniform(0.5, 10.0), 1
        else:
            exit_at, code = now + world.rng.uniform(5.0, 25.0), 0
        if code:
            world.real_failure_rounds.add(number)
        for other in world.training():
            if other.round != number:
                raise Violation(
                    f"two groups train at once: {self.node.node_id} starts round {number} while "
                    f"{other.rank_node} still trains round {other.round}"
                )
        world.properties.check_start(self, started)
        nproc = self.node.nproc
        drawn = world.workers_rng.randrange(nproc) if nproc > 1 else 0
        self.workers = []
        for local in range(nproc):
            if local == drawn:
                when, fate = exit_at, code
            elif code == 0:
                when, fate = exit_at + world.workers_rng.uniform(0.0, 2.0), 0
            else:
                when, fate = now + world.workers_rng.uniform(5.0, 25.0), 0
            self.workers.append(Worker(number, self.node.node_id, when, fate, local_rank=local))
        self.last_started = number
        self.centre = started.members[0].node_id
        self.phase = "running"
        self.lease = now
        self.reported = False
        members = [member.node_id for member in started.members]
        world.log(f"{self.node.node_id} runs round {number} with {members}")
        for worker in self.workers:
            world.at(worker.exit_at, self._worker_exits(worker))

    def running(self) -> list[Worker]:
        return [worker for worker in self.workers if not worker.exited]

    def _worker_exits(self, worker: Worker) -> Callable[[], None]:
        def exits() -> None:
            if not worker.exited:
                worker.exited = True
                worker.training = False
                echo = " (echo of a peer)" if worker.echo else ""
                rank = f" rank {worker.local_rank}" if self.node.nproc > 1 else ""
                self.world.log(
                    f"{self.node.node_id} worker{rank} of round {worker.round} exits "
                    f"{worker.code}{echo}"
                )
                self.world.at(self.world.now, self.step)
                self.world.peers_echo(worker)

        return exits

    def echo(self, worker: Worker) -> Callable[[], None]:
        """``worker`` dies of a peer's death, unless it ended first: exit 1, an echo."""

        def dies() -> None:
            if not worker.exited:
                worker.code, worker.echo = 1, True
                self._worker_exits(worker)()

        return dies

    def fail_a_worker(self) -> None:
        """One running worker (drawn among them) fails now: a real failure of its round."""
        running = self.running()
        if not running:
            return
        drawn = self.world.workers_rng.randrange(len(running)) if len(running) > 1 else 0
        worker = running[drawn]
        worker.exit_at = self.world.now
        worker.code = 1
        self.world.real_failure_rounds.add(worker.round)
        self.world.at(self.world.now, self._worker_exits(worker))

    def _stop_workers(self) -> None:
        for worker in self.running():
            worker.exited = True
            worker.training = False
            worker.code = -15
            self.world.peers_echo(worker)

    def check_lease(self) -> None:
        """The workers' side of the lease: they stop on their own once it went stale."""
        if self.world.now - self.lease <= LEASE:
            return
        for worker in self.workers:
            if worker.training:
                self.world.log(f"{self.node.node_id} worker fences itself (lease stale)")
                worker.training = False
                worker.exited = True
                worker.code = FENCED_EXIT_CODE  # as train/lease.py exits: the round is not ours
                self.world.peers_echo(worker)

    def _poll(self) -> None:
        world = self.world
        workers = self.workers
        decision = poll_decision(
            [worker.code if worker.exited else None for worker in workers],
            stop_requested=self.stop_signal,
            changed=self.handler.changed.is_set(),
            suspended_since=self.handler.suspended_since(),
            now=world.now,
            session_timeout=SESSION,
        )
        if decision.renew_lease:
            self.lease = world.now
        decided = decision.ended
        if decided is None:
            return
        outcome, failed = decided
        if outcome is Outcome.SUCCEEDED and world.buggify(
            self, "freeze", "as its workers finished"
        ):
            return  # frozen before it could act on its success: it decides again once awake
        world.log(f"{self.node.node_id} round {self.last_started} ends: {outcome.value}")
        # The sim's workers have no in-place loop, and there are no user errors or breaker:
        # those inputs are False. An echo is known from how the worker died, as the agent
        # reads it from the worker's own error (``rootcause.is_echo``).
        end = RoundEnd(outcome, echo=failed is not None and workers[failed].echo)
        self._guard(lambda: self._after_round(end))

    def _after_round(self, end: RoundEnd) -> None:
        """``Agent._finish_round`` in the simulated world: the production ``after_round``
        decides each action from the facts, this executes it, until one ends the round (or
        the exit barrier or an echo's wait has to wait: ``_barrier_step`` or ``_wait_step``
        goes on from the fact it learns)."""
        for _ in range(AFTER_ROUND_STEPS):
            end = replace(end, stop_signal=self.stop_signal)
            action = rules.after_round(end)
            self.world.log(f"{self.node.node_id} after the round: {action.value}")
            self.world.properties.check_reaction(self, end, action)
            if action in (AfterRound.DRAIN, AfterRound.DRAIN_PREEMPTED, AfterRound.LEAVE):
                # The simulated stop signal is always the preemption signal: exit 75.
                self._exit_requeue(f"{action.value} on the preemption signal")
                return
            if action is AfterRound.DONE:
                self.world.properties.check_success(self.node.node_id)
                self._finish("succeeded", "")
                return
            if action is AfterRound.REJOIN:
                self._rejoin()
                return
            if action is AfterRound.BARRIER:
                self.ending = end
                self.phase = "barrier"
                if self.handler.begin_barrier():
                    end = replace(end, barrier=True)
                    continue
                self._barrier_step()
                return
            if action is AfterRound.WAIT_FOR_CHANGE:
                self.world.buggify_later(self, st.echo_wait(self.world.settings))
                self.ending = end
                self.phase = "waiting"
                self.wait_started = self.world.now
                self.cut_off_before = self.handler.time_cut_off()
                self.wait_until = -1.0
                self._wait_step()
                return
            end = self._act(action, end)
        raise Violation(
            f"liveness: {self.node.node_id}'s reaction to its round never settles ({end})"
        )

    def _act(self, action: AfterRound, end: RoundEnd) -> RoundEnd:
        """One action that does not end the round, in the simulated world."""
        if action in (AfterRound.STOP_WORKERS, AfterRound.KEEP_WORKERS):
            self._stop_workers()  # no in-place loop here: kept survivors would only wait
            return replace(end, workers_stopped=True)
        if action is AfterRound.ANNOUNCE_FAILURE:
            return replace(end, announced=True)
        if action is AfterRound.FAIL_JOB:
            self.handler.fail(f"node {self.node.node_id}: no restart can fix it")
        else:
            assert action is AfterRound.REPORT_FAILURE, action
            node = self.node
            before = self.world.properties.server_state()
            self.handler.report_failure(
                Failure(node.node_id, node.host, 0, 1, None, "boom", self.world.now)
            )
            self.reported = True
            self.world.properties.check_report(before, self.handler.last_round, node.node_id)
        return replace(end, reported=True)

    # --- endings ---------------------------------------------------------------------------------

    def link_ended(self, node_id: str, number: int, end: links.LinkEnd) -> Callable[[], None]:
        """This node's link of round ``number`` to ``node_id`` ends (``end``): the production
        rule (``links.is_evidence``, then ``report_departed``) decides, as the agent's links
        thread does, once this agent can read its socket (a frozen one, when it wakes)."""

        def ended() -> None:
            if self.gone or self.stuck or self.last_started != number:
                return  # its links of that round are closed, or nobody reads them
            if self.world.now < self.frozen_until:
                self.world.at(self.frozen_until, ended)
                return
            self.world.log(
                f"{self.node.node_id} sees its link of round {number} to {node_id} {end.value}"
            )
            if not links.is_evidence(end):
                return
            try:
                self.handler.report_departed(node_id, number)
            except RendezvousError as error:
                # Cut off (the real report waits for the connection, then the rule decides on
                # the state of that time), or the job is over: nothing to mark.
                self.world.log(f"{self.node.node_id} cannot report {node_id}: {error}")

        return ended

    def _finish(self, how: str, reason: str) -> None:
        self._stop_workers()
        self.world.links_end(self, links.LinkEnd.CLOSED)
        self.world.log(f"{self.node.node_id} done: {how} {reason}")
        self.gone = True
        self.world.endings.append((how, reason))
        self.store.release()

    def _exit_requeue(self, why: str) -> None:
        self._stop_workers()
        self.world.log(f"{self.node.node_id} exits for requeue: {why}")
        self.gone = True
        if self.store.connected:
            self.handler.leave()
        else:
            self.store.release()
        self.world.links_end(self, links.LinkEnd.CLOSED)  # the process exits: its kernel closes
        self.world.requeue(self.slot)

    def crash(self) -> None:
        """The node's processes die: workers die with their agent (PDEATHSIG), the kernel
        closes the agent's links at once (agent/links.py); the session expires on its own."""
        self._stop_workers()
        self.world.links_end(self, links.LinkEnd.CLOSED)
        self.gone = True
        self.store.disconnect()
        self.world.requeue(self.slot)


def unfinished(state: st.JobState) -> list[str]:
    """The members of the state's round that have not succeeded, by the state's own fields
    (the checks use none of the rules under test to judge them)."""
    return sorted(
        member.node_id for member in state.members if member.node_id not in state.succeeded
    )


def everyone_succeeded(state: st.JobState) -> bool:
    return state.round > 0 and not unfinished(state)


def held(data: bytes, server: MemoryServer) -> st.JobState | None:
    """The state ``data`` holds, with its round's members as the server keeps them; None if
    the server no longer has that table (an old state's, which ``forget_rounds`` removed).
    Every agent must be able to read it."""
    try:
        document = st.decode(data)
        if not document.table:
            return document.state
        table = server._read_table(document.state.round, document.table)
        return None if table is None else document.filled(table)
    except RendezvousError as error:
        raise Violation(f"state: the server holds a state no agent can read: {error}") from error


def decoded(data: bytes, server: MemoryServer) -> st.JobState:
    """The server's current state, whose round's table it must hold: it is written before
    the commit that names it, and forgotten only two rounds later."""
    state = held(data, server)
    if state is None:
        raise Violation(f"state: the server holds a state whose table is missing: {data[:80]!r}")
    return state


def port_of(node: NodeInfo) -> int:
    """The free port a node's host picks for the master: one of its own, so that a port
    published by any node but rank 0 shows (``Properties.check_start``)."""
    return PORT_BASE + int(node.slot)


class _Server(MemoryServer):
    """The in-memory ZooKeeper, showing the world every state it accepts (``Properties.written``)
    the moment it accepts it, before any watch fires on it: the checks see each write, not
    only what is left once an agent's step is over."""

    def __init__(
        self, clock: ManualClock, deliver: Deliver, written: Callable[[bytes], None]
    ) -> None:
        super().__init__(clock=clock, deliver=deliver)
        self._written = written
        self._shown = ABSENT

    def _changed(self) -> View:
        state, version = self.state
        if state is not None and version != self._shown:
            self._shown = version
            self._written(state)
        return super()._changed()


class World:
    """One seeded schedule of one job: everything around the real rules (time, Slurm, worker
    and agent processes, faults; see the module's docstring), and the loop that runs it.

    It owns the event queue (``at``, ``run``, ``tick``), the delivery of watches
    (``_deliver``), the agents it starts and requeues (``spawn``, ``requeue``), the faults it
    draws and plants (``plan``, ``fault``, ``buggify``) and what processes do to each other
    (a dead worker's echo, ``peers_echo``; a link's end, ``links_end``). Every random draw
    of a schedule is made here or by its ``SimAgent``s, from the generators ``__init__``
    names, so that one seed is one schedule. Checking the properties is another job,
    ``Properties`` (``properties``): the world calls it where a check is due.
    """

    def __init__(self, seed: int, faults: tuple[Fault, ...] | None = None) -> None:
        """``faults``, when given, replace the seed's own (which are drawn all the same, so
        that everything else the seed decides stays as close as it can)."""
        self.seed = seed
        self.chosen_faults = faults
        self.faults: tuple[Fault, ...] = ()
        self.rng = random.Random(seed)
        rng = self.rng
        self.echo_rng = random.Random(f"{seed}:echo")
        """Echo delays have a generator of their own, so that they shift none of the draws
        of the schedule (its faults, deliveries, partitions) from what they were without."""
        self.workers_rng = random.Random(f"{seed}:workers")
        """So have the workers beyond one per node: how many, which one fails, when the others
        end. A schedule whose nodes all run one worker is the schedule it was before."""
        self.buggify_rng = random.Random(f"{seed}:buggify")
        """Faults planted at the moments that matter (``buggify``), from a generator of
        their own: a schedule none of them hits is drawn as before."""
        self.buggified = self.buggify_rng.random() < BUGGIFY_SHARE
        self.buggified_rounds: set[tuple[str, int]] = set()
        self.clock = ManualClock()
        self.nodes = rng.choice(
            [NodeRange(1, 1), NodeRange(1, 2), NodeRange(2, 2), NodeRange(2, 3)]
        )
        self.spares = 1 if self.workers_rng.random() < SPARE_SHARE else 0
        self.slots = self.nodes.max + self.spares
        self.nprocs = tuple(self.workers_rng.choice(WORKERS_PER_NODE) for _ in range(self.slots))
        self.settings = RendezvousSettings(
            run_id="job",
            nodes=self.nodes,
            last_call=2.0,
            session_timeout=SESSION,
            min_wait=60.0,
            max_restarts=rng.randint(0, 2),
            stop_grace=2.0,
            exit_barrier_timeout=60.0,
        )
        self.properties = Properties(self)
        self.server = _Server(self.clock, self._deliver, self.properties.written)
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._due: dict[int, float] = {}
        """Per connection: when its latest queued notification arrives (FIFO delivery)."""
        self._seq = itertools.count()
        self.trace: list[str] = []
        self.agents: list[SimAgent] = []
        self.by_id: dict[str, SimAgent] = {}
        self.incarnations = itertools.count(1)
        self.pending_requeues = 0
        self.requeues_left = 6
        self.endings: list[tuple[str, str]] = []
        self.real_failure_rounds: set[int] = set()
        """Rounds in which a worker really failed: the only ones that may spend a restart."""
        self.injected: list[str] = []
        """The kinds of the faults that hit an agent (a fault on a slot with none is void)."""
        self.last_fault = 0.0

    @property
    def now(self) -> float:
        return self.clock.now

    def log(self, message: str) -> None:
        self.trace.append(f"{self.now:9.2f}  {message}")

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), action))

    def _deliver(self, store: MemoryStore, notification: Callable[[], None]) -> None:
        """Watches arrive at once, late, or twice, but in order per connection, as a
        ZooKeeper client's single event thread delivers them."""
        roll = self.rng.random()
        due = self._due.get(id(store), -1.0)
        if roll < 0.6 and due < self.now:  # Nothing of this connection still in flight.
            notification()
            return
        delay = self.rng.choice((0.0, 0.01, 0.2, 1.0, 3.0))
        when = max(self.now + delay, due)
        self._due[id(store)] = when
        self.at(when, notification)
        if roll > 0.95:
            self.at(when, notification)

    def peers_echo(self, worker: Worker) -> None:
        """A worker that died (not one that finished: exit 0) breaks its round's collectives:
        every other worker still in that round, on its node or another, dies of it soon
        after, an echo, as gloo/NCCL raise "Connection closed by peer". A stuck worker breaks
        nothing: it hangs."""
        if worker.code == 0:
            return
        for agent in self.agents:
            if agent.stuck:
                continue
            for peer in agent.workers:
                if peer is worker or peer.exited or peer.round != worker.round:
                    continue
                self.at(self.now + self.echo_rng.uniform(0.05, 3.0), agent.echo(peer))

    def links_end(self, gone: SimAgent, end: links.LinkEnd) -> None:
        """``gone``'s links of the round it holds end (``end``): closed when its process exits,
        reset by a middlebox in a partition (its process lives on). A star, as the agents link
        up: the centre (group rank 0) holds a link from every other member of the round that
        started it and has not moved on to a later one."""
        number = gone.last_started
        mine = gone.node.node_id
        if number == 0:
            return
        for peer in self.agents:
            if peer is gone or peer.gone or peer.last_started != number:
                continue
            if gone.centre not in (mine, peer.node.node_id):  # a star: one end is the centre
                continue
            self.at(self.now + LINK_DELAY, peer.link_ended(mine, number, end))

    def training(self) -> list[Worker]:
        return [worker for agent in self.agents for worker in agent.workers if worker.training]

    def requeue(self, slot: int) -> None:
        if self.requeues_left <= 0:
            return
        self.requeues_left -= 1
        self.pending_requeues += 1

        def start() -> None:
            self.pending_requeues -= 1
            self.spawn(slot)

        self.at(self.now + self.rng.uniform(1.0, 10.0), start)

    def spawn(self, slot: int) -> None:
        agent = SimAgent(self, slot, next(self.incarnations))
        self.agents.append(agent)
        self.by_id[agent.node.node_id] = agent
        agent.start()

    # --- faults -------------------------------------------------------------------------------

    def plan(self) -> None:
        count = self.slots
        for slot in range(self.nodes.max):
            self.at(self.rng.uniform(0.0, 5.0), functools.partial(self.spawn, slot))
        for slot in range(self.nodes.max, count):  # the spare's start, from its own generator
            self.at(self.workers_rng.uniform(0.0, 5.0), functools.partial(self.spawn, slot))
        drawn = tuple(
            Fault(
                self.rng.uniform(0.0, FAULT_WINDOW),
                self.rng.choice(FAULT_KINDS),
                self.rng.randrange(count),
            )
            for _ in range(self.rng.randint(0, 3))
        )
        self.faults = drawn if self.chosen_faults is None else self.chosen_faults
        for fault in self.faults:
            self.at(fault.when, functools.partial(self.fault, fault.kind, fault.slot % count))
        self.at(TICK, self.tick)

    def _current(self, slot: int) -> SimAgent | None:
        for agent in reversed(self.agents):
            if agent.slot == slot and not agent.gone:
                return agent
        return None

    def fault(self, kind: str, slot: int) -> None:
        agent = self._current(slot)
        if agent is None:
            return
        self.last_fault = self.now
        self.injected.append(kind)
        self.log(f"FAULT {kind} on {agent.node.node_id}")
        if kind == "worker_fail":
            self._fail_workers(agent)
        elif kind == "hang":
            agent.hang_next = True
        elif kind == "crash":
            agent.crash()
        elif kind == "stuck":
            agent.stuck = True
            for worker in agent.workers:
                worker.training = False  # In uninterruptible sleep: no more steps.
                # A node that hangs for good is a real failure of its round, as a hung worker
                # is: its session lives on, so its peers, whose workers died with it, hear
                # nothing and charge the round once their echo wait runs out (seeds 1421113,
                # 1467254). They cannot tell it from a node whose workers failed and whose
                # agent cannot report, and a charge is what bounds echoes with no originator.
                self.real_failure_rounds.add(worker.round)
        elif kind == "preempt":
            agent.stop_signal = True
            self.at(self.now, agent.step)
        else:
            self._cut_off(agent, kind)

    def _fail_workers(self, agent: SimAgent) -> None:
        """A worker of ``agent`` fails now, and its next round's will too; one time in three
        (``EVERYWHERE_SHARE``) a worker of every node fails now with it."""
        agent.fail_next = True
        if self.workers_rng.random() >= EVERYWHERE_SHARE:
            agent.fail_a_worker()
            return
        self.log("every node's workers fail at once")
        for other in self.agents:
            if not (other.gone or other.stuck):
                other.fail_a_worker()

    def buggify(self, agent: SimAgent, kind: str, when: str) -> bool:
        """In a buggified schedule, now and then (once per node and round), plant ``kind``
        (a freeze or a partition) on ``agent`` at this moment, as FoundationDB's BUGGIFY
        does: the races that need a fault at one exact moment are rare in drawn schedules."""
        key = (agent.node.node_id, agent.last_started)
        if not self.buggified or key in self.buggified_rounds or agent.gone or agent.stuck:
            return False
        if self.buggify_rng.random() >= BUGGIFY_CHANCE:
            return False
        self.buggified_rounds.add(key)
        self.last_fault = self.now
        self.injected.append(kind)
        self.log(f"FAULT {kind} on {agent.node.node_id} (planted {when})")
        self._cut_off(agent, kind, self.buggify_rng.uniform(SESSION, 3 * SESSION))
        return True

    def buggify_later(self, agent: SimAgent, within: float) -> None:
        """Maybe plant a freeze or a partition on ``agent`` at some moment of its echo wait."""
        if not self.buggified:
            return
        kind = self.buggify_rng.choice(("freeze", "partition"))
        delay = self.buggify_rng.uniform(0.0, within)

        def plant() -> None:
            self.buggify(agent, kind, "during an echo wait")

        self.at(self.now + delay, plant)

    def _cut_off(self, agent: SimAgent, kind: str, duration: float | None = None) -> None:
        """A partition (the connection) or a freeze (the whole agent) for up to 18 s."""
        if duration is None:
            duration = self.rng.uniform(1.0, 3 * SESSION)
        agent.store.disconnect()
        if kind == "freeze":
            agent.frozen_until = self.now + duration
        else:  # a middlebox on the way may reset the links of a node that lives on
            self.links_end(agent, links.LinkEnd.RESET)

        def back() -> None:
            # The client's connection thread handles the reconnection (LOST, CONNECTED, the
            # fresh view) before the agent's loop runs on: step once those are in.
            agent.store.reconnect()
            self.at(max(self.now, self._due.get(id(agent.store), -1.0)), agent.step)

        self.at(self.now + duration, back)

    # --- the loop --------------------------------------------------------------------------------

    def tick(self) -> None:
        self.server.tick()
        for agent in self.agents:
            if not agent.gone and self.now >= agent.frozen_until:
                agent.store.touch()
                if agent.phase == "running" and not agent.stuck:
                    agent.step()
            agent.check_lease()
        self.at(self.now + TICK, self.tick)

    def ended(self) -> bool:
        return self.pending_requeues == 0 and all(
            agent.gone or agent.stuck or self._beside_stuck(agent) for agent in self.agents
        )

    def _beside_stuck(self, agent: SimAgent) -> bool:
        """A hot spare waiting beside a round whose every member is stuck for good: their
        sessions live on, so nothing will ever end that round (only Slurm's time limit)."""
        state = self.properties.last_state
        if agent.phase != "joining" or state is None or agent.node in state.members:
            return False
        members = [self.by_id.get(member.node_id) for member in state.members]
        return bool(members) and all(member is not None and member.stuck for member in members)

    def run(self) -> Result:
        self.plan()
        violation = None
        try:
            spins = 0
            while self._queue:
                when, _, action = heapq.heappop(self._queue)
                spins = spins + 1 if when == self.clock.now else 0
                if spins > 10_000:
                    raise Violation(f"liveness: a loop spins at t={when:.2f} s without waiting")
                self.clock.now = when
                try:
                    action()
                except Violation:
                    raise
                except Exception as error:  # a watch or a step of production code failed
                    raise Violation(f"crash: {type(error).__name__}: {error}") from error
                self._wake_changed()
                self.properties.check_closure()
                if self.agents and self.ended():
                    break
                if self.now > self.last_fault + LIVENESS_BOUND or self.now > HORIZON:
                    raise Violation(
                        f"liveness: the job did not end within {LIVENESS_BOUND:g} s of its last "
                        f"fault (t={self.last_fault:.1f})"
                    )
            self.properties.check_end()
        except Violation as error:
            violation = str(error)
            self.log(f"VIOLATION {violation}")
        last_state = self.properties.last_state
        restarts = last_state.restarts_used if last_state else 0
        # "stuck": nothing but agents stuck for good is left; only Slurm's time limit ends it.
        hows = {how for how, _ in self.endings}
        outcome = next((how for how in ("failed", "succeeded", "closed") if how in hows), "stuck")
        return Result(
            self.seed,
            outcome,
            violation,
            self.trace,
            restarts,
            self.now,
            self.faults,
            chosen=self.chosen_faults is not None,
            cause=self.properties.cause() if outcome == "failed" else None,
            rounds=self.properties.rounds,
        )

    def _wake_changed(self) -> None:
        """A handler whose store notified it decides again, as the real loop wakes up."""
        for agent in self.agents:
            if (
                not agent.gone
                and agent.handler.generation != agent.seen_generation
                and self.now >= agent.frozen_until
            ):
                agent.seen_generation = agent.handler.generation
                self.at(self.now, agent.step)


class Properties:
    """The properties of docs/reliability.md, checked as the world runs (the simulation's
    oracle): every state the server accepts against the one before it (``written``), every
    round a node starts against what the others started (``check_start``), every failure
    report against what it must spend (``check_report``), every reaction to a round's end
    (``check_reaction``, ``check_last_call``, ``check_success``), and the job's end against
    the faults that were injected (``check_end``). Each check raises ``Violation``.

    It keeps what the checks remember (the last state, the rounds formed and charged, what
    each node was told) and reads the rest from ``world``: the settings, the agents, the
    server, the faults injected and how the agents ended. It draws no random number and acts
    on nothing in the world (it only adds to the trace), so a check never shifts a schedule.
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self.charged: set[int] = set()
        """Rounds whose failure spent a restart (or, the budget spent, failed the job)."""
        self.started: dict[int, dict[str, tuple[str, ...]]] = {}
        """Per round, the members each node that started it was told of."""
        self.rounds = 0
        self.left_before_expiry: list[str] = []
        """Members of a round whose agent was gone (crashed or exited) and that the next round
        left out while the store still listed them: the links' doing (agent/links.py)."""
        self.last_round = 0
        self.last_members: tuple[str, ...] = ()
        self.last_state: st.JobState | None = None
        self.was_closed = False
        self._checked_token = -2

    def server_state(self) -> st.JobState | None:
        """The state as the server holds it now (None once closed, or before the first)."""
        data, _ = self.world.server.state
        return decoded(data, self.world.server) if data is not None else None

    def cause(self) -> str:
        """What the failure of a failed job names (``CAUSES``); a violation if nothing."""
        summary = self.last_state.failure_summary if self.last_state is not None else ""
        for words, cause in CAUSES.items():
            if words in summary:
                return cause
        raise Violation(f"cause: the job failed with no known cause: {summary!r}")

    def check_closure(self) -> None:
        data, token = self.world.server.state
        if self.world.server.closed:
            self.was_closed = True
        if data is None or (token == self._checked_token and not self.was_closed):
            return
        self._checked_token = token
        if self.was_closed:
            raise Violation("closure: a closed job has a state again")

    def written(self, data: bytes) -> None:
        """Every state the server accepts, checked against the one before it."""
        raw = json.loads(data)  # before decoding, which refuses a state beyond its budget
        if raw["restarts_used"] > raw["max_restarts"]:
            raise Violation(
                f"budget: {raw['restarts_used']} restarts spent of a budget of "
                f"{raw['max_restarts']}"
            )
        new = decoded(data, self.world.server)
        old, self.last_state = self.last_state, new
        if new.max_restarts != self.world.settings.max_restarts:
            raise Violation(f"budget: the state's budget became {new.max_restarts}")
        if old is None:
            if new.round or new.restarts_used or new.failed or new.closed:
                raise Violation(f"state: the job's first state is not a fresh one: {new}")
            return
        if old.closed:
            raise Violation("closure: a closed job's state was written again")
        if old.failed and new.failure_summary != old.failure_summary:
            raise Violation(
                f"state: the job's failure {old.failure_summary!r} became {new.failure_summary!r}"
            )
        if new.round == old.round + 1:
            self._new_round(old, new)
        elif new.round != old.round:
            raise Violation(f"rounds: round {new.round} follows round {old.round}")
        else:
            self._same_round(old, new)
        self._spent(old, new)
        self._succeeded(old, new)
        if new.failed and not old.failed:
            self._failed(new)
        if new.closed and not (everyone_succeeded(new) and not new.failed):
            raise Violation(
                f"closure: the job closed in round {new.round} while {unfinished(new)} had not "
                f"succeeded{' and it had failed' if new.failed else ''}"
            )

    def _new_round(self, old: st.JobState, new: st.JobState) -> None:
        """Round ``new.round`` formed: members unique, MIN to MAX of them, survivors first."""
        members = tuple(member.node_id for member in new.members)
        if len(set(members)) != len(members):
            raise Violation(f"ranks: round {new.round} has a member twice: {list(members)}")
        if not self.world.nodes.min <= len(members) <= self.world.nodes.max:
            raise Violation(
                f"ranks: round {new.round} has {len(members)} members {list(members)}, outside "
                f"{self.world.nodes.min}:{self.world.nodes.max}"
            )
        for member in new.members:
            agent = self.world.by_id.get(member.node_id)
            if agent is None or member != agent.node:
                raise Violation(f"ranks: round {new.round} names a node nobody runs: {member}")
        # Its port is none yet, or the one its rank 0 picked as it proposed the round.
        own_port = new.master_port in (None, port_of(new.members[0]))
        fresh = own_port and not (new.succeeded or new.ended)
        if not fresh or new.restarts_used != old.restarts_used:
            raise Violation(f"state: round {new.round} does not start afresh: {new}")
        survivors = [node for node in self.last_members if node in members]
        if list(members[: len(survivors)]) != survivors:
            raise Violation(
                f"ranks: round {new.round} {list(members)} does not keep the survivors "
                f"{survivors} of round {self.last_round} first, in order"
            )
        self.rounds += 1
        for node in sorted(set(self.last_members) - set(members)):
            agent = self.world.by_id.get(node)
            if agent is not None and agent.gone and node in self.world.server.member_ids:
                self.left_before_expiry.append(node)
                self.world.log(f"{node} left out before its session expired")
        self.last_round, self.last_members = new.round, members
        self.world.log(f"round {new.round} formed: {list(members)}")

    def _same_round(self, old: st.JobState, new: st.JobState) -> None:
        """Within a round, members stay, the port is published once, who succeeded only
        grows, among the members, and an ended round stays ended."""
        number = new.round
        if new.members != old.members:
            raise Violation(f"state: the members of round {number} changed: {new.members}")
        if old.master_port is not None and new.master_port != old.master_port:
            raise Violation(f"state: round {number}'s master port changed")
        members = new.member_ids
        before, after = set(old.succeeded), set(new.succeeded)
        if not before <= after or not after <= members or len(after) != len(new.succeeded):
            raise Violation(f"state: round {number}'s succeeded went from {before} to {after}")
        if old.ended and not new.ended:
            raise Violation(f"state: round {number} ended, then was live again")
        over = old.failed_round == old.round or old.ended
        if set(new.succeeded) - set(old.succeeded) and over:
            raise Violation(f"state: a success was recorded in round {number}, which had ended")

    def _spent(self, old: st.JobState, new: st.JobState) -> None:
        """A restart is spent (or, the budget spent, the job failed) once per round, on the
        current round, and only for a round in which a worker really failed."""
        spent = new.restarts_used - old.restarts_used
        budget = not old.failed and "restarts are spent" in new.failure_summary
        charged = new.failed_round != old.failed_round
        if spent < 0 or spent > 1:
            raise Violation(
                f"budget: {old.restarts_used} restarts spent became {new.restarts_used}"
            )
        if charged != bool(spent or budget) or (budget and spent):
            raise Violation(
                f"budget: round {new.failed_round} recorded as failed, {spent} restart(s) spent, "
                f"restarts {old.restarts_used} -> {new.restarts_used} of {new.max_restarts}"
            )
        if budget and new.restarts_used != new.max_restarts:
            raise Violation(
                f"budget: the job failed for its budget with {new.restarts_used} of "
                f"{new.max_restarts} restarts spent"
            )
        if not charged:
            return
        if new.failed_round != new.round or new.failed_round in self.charged:
            raise Violation(
                f"budget: round {new.failed_round} charged in round {new.round} "
                f"(charged before: {sorted(self.charged)})"
            )
        if new.failed_round not in self.world.real_failure_rounds:
            raise Violation(
                f"budget: round {new.failed_round} spent the budget, but no worker really failed "
                f"in it (rounds with a real failure: {sorted(self.world.real_failure_rounds)})"
            )
        self.charged.add(new.failed_round)

    def _succeeded(self, old: st.JobState, new: st.JobState) -> None:
        """A node counts as done only when every one of its workers exited 0."""
        for node in set(new.succeeded) - set(old.succeeded):
            agent = self.world.by_id.get(node)
            if agent is None:
                raise Violation(f"success: {node}, which no agent runs, recorded a success")
            codes = [
                worker.code if worker.exited else None
                for worker in agent.workers
                if worker.round == new.round
            ]
            if len(codes) != agent.node.nproc or any(code != 0 for code in codes):
                raise Violation(
                    f"success: {node} recorded a success of round {new.round} while its "
                    f"{agent.node.nproc} workers exited {codes}"
                )

    def _failed(self, new: st.JobState) -> None:
        """The job failed: its summary names a known cause, and a node it blames for not
        finishing really had not finished (by the state the failure was written on)."""
        cause = self.cause()
        if cause == "below_min":
            here, needed = map(
                int, re.findall(r"only (\d+) of the (\d+) nodes", new.failure_summary)[0]
            )
            if here >= needed:
                raise Violation(f"cause: the job failed below MIN with {here} of {needed} nodes")
            return
        if cause not in ("member_lost", "unfinished"):
            return
        named = new.failure_summary.split("'")[1]
        if named not in new.member_ids or named in new.succeeded:
            raise Violation(
                f"cause: the job failed naming node {named}, which had finished round "
                f"{new.round} or was no member of it: {new.failure_summary}"
            )

    def check_start(self, agent: SimAgent, started: Round) -> None:
        """Rounds a node starts only go up, and every node of a round is told the same
        members, so that the ranks of a round are unique and contiguous."""
        number = started.number
        if number <= agent.last_started:
            raise Violation(
                f"rounds: {agent.node.node_id} starts round {number} after round "
                f"{agent.last_started}"
            )
        if agent.handler.suspended_since() is not None:
            raise Violation(
                f"rounds: {agent.node.node_id} starts round {number} while it knows it is cut "
                "off from the rendezvous (a cut-off handler decides nothing)"
            )
        members = tuple(member.node_id for member in started.members)
        told = self.started.setdefault(number, {})
        for other, seen in told.items():
            if seen != members:
                raise Violation(
                    f"ranks: {agent.node.node_id} starts round {number} with {list(members)}, "
                    f"{other} with {list(seen)}"
                )
        told[agent.node.node_id] = members
        ranks = [
            rank
            for member in started.members
            for rank in range(
                started.first_rank(member.node_id),
                started.first_rank(member.node_id) + member.nproc,
            )
        ]
        if started.master_port != port_of(started.members[0]):
            raise Violation(
                f"ranks: round {number}'s master port {started.master_port} was not picked on "
                f"its master's host {started.members[0].host}"
            )
        first = started.first_rank(agent.node.node_id)
        mine = range(first, first + agent.node.nproc)
        if agent.node.node_id not in members or ranks != list(range(started.world_size)):
            raise Violation(
                f"ranks: {agent.node.node_id} starts round {number} as ranks {list(mine)} of "
                f"{started.world_size} with {list(members)}"
            )

    def check_last_call(
        self,
        agent: SimAgent,
        action: st.Action | st.Barrier,
        state: st.JobState | None,
        alive: frozenset[str],
        back: frozenset[str],
    ) -> None:
        """A round waits the last call only while a newcomer may still come: with MAX nodes
        ready, or when it only lost members (all back, none excluded but alive), it forms at
        once (docs/design.md, docs/rendezvous.md). Judged on the node's own view, with no rule
        under test: the simulation passes no count of coming nodes."""
        if action not in (st.Action.LAST_CALL, st.Action.COMPLETE) or state is None:
            return
        excluded = set(state.excluded)
        present = alive - excluded - set(state.departed)
        members = {member.node_id for member in state.members}
        waited_for = (members & present) - back
        here = present - waited_for
        full = len(here) >= self.world.nodes.max
        shrink = state.round > 0 and not waited_for and not alive & excluded and here <= members
        at_once = full or (shrink and len(here) >= self.world.nodes.min)
        if (action is st.Action.LAST_CALL) == at_once:
            raise Violation(
                f"speed: {agent.node.node_id} decided {action.value} in round {state.round} with "
                f"{sorted(here)} ready of MAX {self.world.nodes.max}, members {sorted(members)}"
            )

    def check_report(self, before: st.JobState | None, number: int, node: str) -> None:
        """A failure report spends one restart for its round when that round is the job's
        current one and not charged yet (the budget spent, it fails the job), else nothing."""
        after = self.server_state()
        if before is None:
            return  # no state yet: nothing to charge, and the report cannot make one
        current = not (before.closed or before.failed) and before.round == number
        if not current or before.failed_round == number:
            spent = after is not None and after.restarts_used != before.restarts_used
            if spent or (after is not None and after.failed_round != before.failed_round):
                raise Violation(
                    f"budget: {node}'s report of round {number}, charged already or not the "
                    f"current round {before.round}, changed the budget"
                )
            return
        if after is None or after.failed_round != number:
            raise Violation(f"budget: {node}'s report of round {number} was not recorded")
        if before.restarts_used < before.max_restarts:
            if after.restarts_used != before.restarts_used + 1 or after.failed:
                raise Violation(
                    f"budget: {node}'s report of round {number} left {after.restarts_used} of "
                    f"{after.max_restarts} restarts spent (before: {before.restarts_used})"
                )
        elif not after.failed or after.restarts_used != before.restarts_used:
            raise Violation(
                f"budget: {node}'s report of round {number}, with all {before.max_restarts} "
                f"restarts spent, left the job running with {after.restarts_used}"
            )

    def check_reaction(self, agent: SimAgent, end: RoundEnd, action: AfterRound) -> None:
        """A node whose own worker really failed (no echo) reports it before it rejoins,
        unless a stop signal made it leave: otherwise a failure never spends a restart."""
        if action is not AfterRound.REJOIN or end.outcome is not Outcome.FAILED:
            return
        if end.echo or end.stop_signal or agent.reported:
            return
        raise Violation(
            f"budget: {agent.node.node_id} rejoins after a real worker failure of round "
            f"{agent.last_started} without reporting it"
        )

    def check_success(self, node_id: str) -> None:
        """A node exits 0 only when the job succeeded: every member of its last round
        succeeded (the last one closes the job, which only a success does here). A node that
        exits 0 while the others rerun is never requeued, and the job runs on without it."""
        state = self.server_state()
        if self.world.server.closed or (state is not None and everyone_succeeded(state)):
            return
        round_number = state.round if state is not None else 0
        raise Violation(
            f"success: {node_id} exits 0 while round {round_number} of the job has not "
            "succeeded on every member"
        )

    def check_end(self) -> None:
        if not self.world.ended():
            raise Violation("liveness: agents still wait with nothing left to happen")
        if not self.world.endings and not any(agent.stuck for agent in self.world.agents):
            raise Violation("liveness: every agent left for requeue and none ever came back")
        hows = {how for how, _ in self.world.endings}
        for how, reason in self.world.endings:
            if how == "failed" and not reason:
                raise Violation("liveness: the job failed without a reason")
            if how == UNREACHABLE:
                raise Violation(
                    f"liveness: an agent gave up though no outage lasted so long: {reason}"
                )
        if {"succeeded", "failed"} <= hows:
            raise Violation("success: one node succeeded and another failed the same job")
        if "succeeded" in hows and not self.world.server.closed:
            raise Violation("success: a node exited 0 and the job never closed")
        self._check_explained(hows)

    def _check_explained(self, hows: set[str]) -> None:
        """Every way a job ends is explained by the faults injected into it."""
        injected = set(self.world.injected)
        restarts = self.last_state.restarts_used if self.last_state is not None else 0
        # Without faults every node succeeds; one that came after the end finds it closed.
        if not injected and (hows - {"closed"} != {"succeeded"} or restarts):
            raise Violation(
                f"cause: a job with no fault ended {sorted(hows)} with {restarts} restarts spent"
            )
        if "failed" in hows:
            cause = self.cause()
            if not injected & EXPLAINED_BY[cause]:
                raise Violation(
                    f"cause: the job failed ({cause}) but no fault that explains it hit it: "
                    f"{sorted(injected)}"
                )
            if cause == "budget" and len(self.charged) <= self.world.settings.max_restarts:
                raise Violation(
                    f"cause: the job failed for its budget of {self.world.settings.max_restarts} "
                    f"after {len(self.charged)} charged rounds"
                )
        if not self.world.endings and "stuck" not in injected:
            raise Violation("cause: only stuck agents are left, but no agent was stuck")


def drawn_faults(seed: int) -> tuple[Fault, ...]:
    """The faults the schedule of ``seed`` draws, without running it (a test that keeps only
    some of them passes the rest to ``simulate``)."""
    world = World(seed)
    world.plan()
    return world.faults


def simulate(seed: int, faults: tuple[Fault, ...] | None = None) -> Result:
    """Run the schedule of ``seed`` (with ``faults`` instead of its own, when given) and
    check every property; reproducible."""
    return World(seed, faults).run()


def violated_property(violation: str) -> str:
    """The property a violation message names (``liveness``, ``ranks``, ``rounds``,
    ``budget``, ``closure``, ``success``, ``state``, ``cause``, ``split brain``), so that
    shrinking keeps to the same bug."""
    if violation.startswith("two groups train at once"):
        return "split brain"
    head, _, _ = violation.partition(":")
    return head if head in PROPERTIES else violation


def shrink(result: Result) -> Result:
    """The smallest schedule found that still violates ``result``'s property.

    Greedy, as delta debugging does it one element at a time: drop any fault whose removal
    keeps the violation (until none can go), then pull each remaining fault earlier by
    halving its time while the violation stays. Every candidate is a full simulated run of
    a few milliseconds, so a few dozen of them cost well under a second. Dropping a fault
    shifts the draws after it (delivery delays, partition lengths), so a shrunk schedule is
    its own schedule: its replay command names its faults."""
    assert result.violation is not None, "only a violating schedule shrinks"
    wanted = violated_property(result.violation)

    def still_violates(faults: tuple[Fault, ...]) -> Result | None:
        tried = simulate(result.seed, faults)
        if tried.violation is not None and violated_property(tried.violation) == wanted:
            return tried
        return None

    best = result
    dropped = True
    while dropped:
        dropped = False
        for index in range(len(best.faults)):
            smaller = still_violates(best.faults[:index] + best.faults[index + 1 :])
            if smaller is not None:
                best, dropped = smaller, True
                break
    for index in range(len(best.faults)):
        fault = best.faults[index]
        for when in (_to_10ms(fault.when), *_halvings(fault.when)):
            moved = Fault(when, fault.kind, fault.slot)
            sooner = still_violates((*best.faults[:index], moved, *best.faults[index + 1 :]))
            if sooner is None:
                break
            best = sooner
    return best


def _halvings(when: float) -> list[float]:
    """``when`` halved again and again down to a second, cut to 10 ms for a short replay
    command: 14.66, 7.33, 3.66, 1.83."""
    times = []
    while when >= 2.0:
        when /= 2
        times.append(_to_10ms(when))
    return times


def _to_10ms(when: float) -> float:
    """Cut (never rounded up: a shrunk fault comes no later than the original)."""
    return math.floor(when * 100) / 100


def run_many(first_seed: int, schedules: int) -> Report:
    """Run ``schedules`` seeds; the handlers' warnings (a straggler left out) stay quiet while
    they run, and only then: the level is the whole process's, so it is put back after."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        report = Report(first_seed, schedules)
        for seed in range(first_seed, first_seed + schedules):
            result = simulate(seed)
            report.add(result)
            if result.violation is not None:
                shrunk = len(report.failures) < SHRUNK_IN_REPORT
                report.failures.append(shrink(result) if shrunk else result)
    finally:
        logging.disable(before)
    return report
