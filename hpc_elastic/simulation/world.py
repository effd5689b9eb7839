"""A seeded, single-threaded world that drives the real rendezvous and agent rules.

What runs is production code: ``rendezvous/state.py`` through ``StoreRendezvous``'s step
functions (``begin_round``/``round_step``, ``begin_barrier``/``barrier_step``,
``report_failure``), over the stores engineer's ``MemoryStore`` (ZooKeeper's semantics: CAS,
sessions that expire at tick granularity, SUSPENDED/LOST/CONNECTED), the agent's pure
poll (``agent.poll_decision``: the lease rule, ``round_outcome``, ``connection_fenced``),
and the agent's reaction to how a round ended (``agent.after_round``: drain, barrier, stop,
report, leave or rejoin), looked up on the module at every call so that a test can break
it for both. ``SimAgent`` only executes the actions in the simulated world; it holds no
rule of its own. What is simulated is only what surrounds them: time, the delivery of
watches (late, twice), worker processes (a stale lease makes one exit ``FENCED_EXIT_CODE``,
as train/lease.py does), agent processes (crash, freeze, partition), and Slurm (start,
preempt, requeue).

One schedule is one seed: ``simulate(seed)`` is reproducible bit for bit, and a violated
property prints the command that replays it. See docs/reliability.md for the properties.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hpc_elastic.agent import agent as production
from hpc_elastic.agent.agent import AfterRound, Outcome, RoundEnd, fence_after, poll_decision
from hpc_elastic.errors import RendezvousClosedError, RendezvousError
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import Failure, JobFailedError, NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.memory import ManualClock, MemoryServer, MemoryStore
from hpc_elastic.spec import NodeRange
from hpc_elastic.train.exitcodes import FENCED_EXIT_CODE

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
FAULT_KINDS = ("worker_fail", "hang", "crash", "freeze", "partition", "preempt", "stuck")
"""``stuck``: the agent hangs for good on an unkillable worker while its ZooKeeper client
keeps the session alive: the others must go on without it (``straggler_timeout``, the exit
barrier's deadline). The job's end is then judged without it; Slurm's time limit ends it."""


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

    def replay(self) -> str:
        """The command that runs this schedule again, trace and all."""
        command = f"python -m hpc_elastic.simulation --seed {self.seed}"
        if self.chosen:
            command += f" --faults '{','.join(fault.text() for fault in self.faults)}'"
        return f"{command} --trace"

    def summary(self) -> str:
        if self.violation is None:
            return f"seed {self.seed}: ok, {self.outcome} at t={self.end_time:.1f} s"
        return f"seed {self.seed}: VIOLATION: {self.violation}\nreplay: {self.replay()}"


@dataclass
class Report:
    first_seed: int
    schedules: int
    failures: list[Result] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [
            f"{self.schedules} schedules from seed {self.first_seed}: "
            f"{len(self.failures)} violated a property; "
            f"outcomes {dict(sorted(self.outcomes.items()))}"
        ]
        lines += [failure.summary() for failure in self.failures[:5]]
        return "\n".join(lines)


class Violation(Exception):
    """A property did not hold."""


class SimAgent:
    """One agent process (one incarnation) of slot ``slot``: the real agent's decisions
    (``poll_decision``, ``after_round``), executed in the simulated world."""

    def __init__(self, world: World, slot: int, incarnation: int) -> None:
        self.world = world
        self.slot = slot
        self.node = NodeInfo(f"n{slot}.{incarnation}", f"host{slot}", 1, str(slot))
        self.store: MemoryStore = world.server.connect("job", SESSION)
        self.handler = StoreRendezvous(
            world.settings,
            self.node,
            self.store,
            clock=world.clock,
            pick_port=lambda: 29500,
        )
        self.phase = "joining"
        self.worker: Worker | None = None
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
        self.wait_started = 0.0
        """When an echo's wait for the peer's news began (``production.echo_deadline``)."""
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
        """The real agent's loop: job over, job closed, or rendezvous out of reach (exit 75)."""
        try:
            action()
        except JobFailedError as error:
            self._finish("failed", str(error))
        except RendezvousClosedError:
            self._finish("closed", "")
        except RendezvousError as error:
            self._exit_requeue(f"rendezvous error: {error}")

    def _join_step(self) -> None:
        if self.stop_signal:
            self._exit_requeue("signalled while joining")
            return
        for _ in range(100):
            step = self.handler.round_step()
            if not step.again:
                break
        else:
            raise Violation(f"{self.node.node_id}: round_step never settles")
        self.seen_generation = self.handler.generation
        if step.round is not None:
            self._start_worker(step.round.number, [m.node_id for m in step.round.members])
        elif step.wake_at is not None:
            self.world.at(step.wake_at, self.step)

    def _barrier_step(self) -> None:
        """The exit barrier, one decision; its answer (or a stop signal) goes back to
        ``after_round``, as ``report_success``'s does in the agent."""
        if self.stop_signal:  # the real barrier wait is interruptible
            self._after_round(self.ending)
            return
        step = self.handler.barrier_step()
        while step.again:
            step = self.handler.barrier_step()
        self.seen_generation = self.handler.generation
        if step.done is not None:
            self._after_round(replace(self.ending, barrier=step.done))
        elif step.wake_at is not None:
            self.world.at(step.wake_at, self.step)

    def _wait_step(self) -> None:
        """An echo's wait to hear of the peer that really failed, as ``Agent._wait_for_change``
        waits: until the rendezvous says something changed, a stop signal, or ``echo_wait``."""
        heard = not self.stop_signal and self.handler.changed.is_set()
        # A freeze here is an outage too (``World.inject``): the handler counts it.
        unheard = self.handler.time_cut_off() - self.cut_off_before
        wait_until = production.echo_deadline(self.wait_started, self.world.settings, unheard)
        if heard or self.stop_signal or self.world.now >= wait_until:
            stalled = not heard and production.overslept(wait_until, self.world.now)
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

    def _start_worker(self, number: int, members: list[str]) -> None:
        world = self.world
        now = world.now
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
        self.worker = Worker(number, self.node.node_id, exit_at, code)
        self.phase = "running"
        self.lease = now
        world.log(f"{self.node.node_id} runs round {number} with {members}")
        world.at(exit_at, self._worker_exits(self.worker))

    def _worker_exits(self, worker: Worker) -> Callable[[], None]:
        def exits() -> None:
            if not worker.exited:
                worker.exited = True
                worker.training = False
                echo = " (echo of a peer)" if worker.echo else ""
                self.world.log(
                    f"{self.node.node_id} worker of round {worker.round} exits {worker.code}{echo}"
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

    def _stop_worker(self) -> None:
        if self.worker is not None and not self.worker.exited:
            self.worker.exited = True
            self.worker.training = False
            self.worker.code = -15
            self.world.peers_echo(self.worker)

    def check_lease(self) -> None:
        """The worker's side of the lease: it stops on its own once the lease went stale."""
        worker = self.worker
        if worker is not None and worker.training and self.world.now - self.lease > LEASE:
            self.world.log(f"{self.node.node_id} worker fences itself (lease stale)")
            worker.training = False
            worker.exited = True
            worker.code = FENCED_EXIT_CODE  # as train/lease.py exits: the round is not ours
            self.world.peers_echo(worker)

    def _poll(self) -> None:
        world = self.world
        worker = self.worker
        assert worker is not None
        decision = poll_decision(
            [worker.code if worker.exited else None],
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
        world.log(f"{self.node.node_id} round {worker.round} ends: {outcome.value}")
        # The sim's workers have no in-place loop, and there are no user errors or breaker:
        # those inputs are False. An echo is known from how the worker died, as the agent
        # reads it from the worker's own error (``rootcause.is_echo``).
        end = RoundEnd(outcome, echo=failed is not None and worker.echo)
        self._guard(lambda: self._after_round(end))

    def _after_round(self, end: RoundEnd) -> None:
        """``Agent._finish_round`` in the simulated world: the production ``after_round``
        decides each action from the facts, this executes it, until one ends the round (or
        the exit barrier or an echo's wait has to wait: ``_barrier_step`` or ``_wait_step``
        goes on from the fact it learns)."""
        for _ in range(AFTER_ROUND_STEPS):
            end = replace(end, stop_signal=self.stop_signal)
            action = production.after_round(end)
            self.world.log(f"{self.node.node_id} after the round: {action.value}")
            if action in (AfterRound.DRAIN, AfterRound.DRAIN_PREEMPTED, AfterRound.LEAVE):
                # The simulated stop signal is always the preemption signal: exit 75.
                self._exit_requeue(f"{action.value} on the preemption signal")
                return
            if action is AfterRound.DONE:
                self.world.check_success(self.node.node_id)
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
            self._stop_worker()  # no in-place loop here: kept survivors would only wait
            return replace(end, workers_stopped=True)
        if action is AfterRound.ANNOUNCE_FAILURE:
            return replace(end, announced=True)
        if action is AfterRound.FAIL_JOB:
            self.handler.fail(f"node {self.node.node_id}: no restart can fix it")
        else:
            assert action is AfterRound.REPORT_FAILURE, action
            node = self.node
            self.handler.report_failure(
                Failure(node.node_id, node.host, 0, 1, None, "boom", self.world.now)
            )
        return replace(end, reported=True)

    # --- endings ---------------------------------------------------------------------------------

    def _finish(self, how: str, reason: str) -> None:
        self._stop_worker()
        self.world.log(f"{self.node.node_id} done: {how} {reason}")
        self.gone = True
        self.world.endings.append((how, reason))
        self.store.release()

    def _exit_requeue(self, why: str) -> None:
        self._stop_worker()
        self.world.log(f"{self.node.node_id} exits for requeue: {why}")
        self.gone = True
        if self.store.connected:
            self.handler.leave()
        else:
            self.store.release()
        self.world.requeue(self.slot)

    def crash(self) -> None:
        """The node dies: workers die with it (PDEATHSIG); the session expires on its own."""
        self._stop_worker()
        self.gone = True
        self.store.disconnect()
        self.world.requeue(self.slot)


class World:
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
        self.clock = ManualClock()
        self.nodes = rng.choice(
            [NodeRange(1, 1), NodeRange(1, 2), NodeRange(2, 2), NodeRange(2, 3)]
        )
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
        self.server = MemoryServer(clock=self.clock, deliver=self._deliver)
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._due: dict[int, float] = {}
        """Per connection: when its latest queued notification arrives (FIFO delivery)."""
        self._seq = itertools.count()
        self.trace: list[str] = []
        self.agents: list[SimAgent] = []
        self.incarnations = itertools.count(1)
        self.pending_requeues = 0
        self.requeues_left = 6
        self.endings: list[tuple[str, str]] = []
        self.real_failure_rounds: set[int] = set()
        self.last_fault = 0.0
        self.last_round = 0
        self.last_members: tuple[str, ...] = ()
        self.last_state: st.JobState | None = None
        self.was_closed = False
        self._checked_token = -2

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
        every other member's worker still in that round dies of it soon after, an echo, as
        gloo/NCCL raise "Connection closed by peer". A stuck worker breaks nothing: it hangs."""
        if worker.code == 0:
            return
        for agent in self.agents:
            peer = agent.worker
            if peer is None or peer is worker or peer.exited or peer.round != worker.round:
                continue
            if agent.stuck:
                continue
            self.at(self.now + self.echo_rng.uniform(0.05, 3.0), agent.echo(peer))

    def training(self) -> list[Worker]:
        return [
            agent.worker
            for agent in self.agents
            if agent.worker is not None and agent.worker.training
        ]

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
        agent.start()

    # --- faults -------------------------------------------------------------------------------

    def plan(self) -> None:
        count = self.nodes.max
        for slot in range(count):
            self.at(self.rng.uniform(0.0, 5.0), functools.partial(self.spawn, slot))
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
        self.log(f"FAULT {kind} on {agent.node.node_id}")
        if kind == "worker_fail":
            agent.fail_next = True
            if agent.worker is not None and not agent.worker.exited:
                agent.worker.exit_at = self.now
                agent.worker.code = 1
                self.real_failure_rounds.add(agent.worker.round)
                self.at(self.now, agent._worker_exits(agent.worker))
        elif kind == "hang":
            agent.hang_next = True
        elif kind == "crash":
            agent.crash()
        elif kind == "stuck":
            agent.stuck = True
            if agent.worker is not None:
                agent.worker.training = False  # In uninterruptible sleep: no more steps.
                # A node that hangs for good is a real failure of its round, as a hung worker
                # is: its session lives on, so its peers, whose workers died with it, hear
                # nothing and charge the round once their echo wait runs out (seeds 1421113,
                # 1467254). They cannot tell it from a node whose workers failed and whose
                # agent cannot report, and a charge is what bounds echoes with no originator.
                self.real_failure_rounds.add(agent.worker.round)
        elif kind == "preempt":
            agent.stop_signal = True
            self.at(self.now, agent.step)
        else:
            duration = self.rng.uniform(1.0, 3 * SESSION)
            agent.store.disconnect()
            if kind == "freeze":
                agent.frozen_until = self.now + duration

            def back() -> None:
                # The client's connection thread handles the reconnection (LOST, CONNECTED,
                # the fresh view) before the agent's loop runs on: step once those are in.
                agent.store.reconnect()
                self.at(max(self.now, self._due.get(id(agent.store), -1.0)), agent.step)

            self.at(self.now + duration, back)

    # --- the loop and the properties ------------------------------------------------------------

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
            agent.gone or agent.stuck for agent in self.agents
        )

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
                action()
                self._wake_changed()
                self._check_state()
                if self.agents and self.ended():
                    break
                if self.now > self.last_fault + LIVENESS_BOUND or self.now > HORIZON:
                    raise Violation(
                        f"liveness: the job did not end within {LIVENESS_BOUND:g} s of its last "
                        f"fault (t={self.last_fault:.1f})"
                    )
            self._check_end()
        except Violation as error:
            violation = str(error)
            self.log(f"VIOLATION {violation}")
        restarts = self.last_state.restarts_used if self.last_state else 0
        # "stuck": nothing but agents stuck for good is left; only Slurm's time limit ends it.
        outcome = self.endings[-1][0] if self.endings else "stuck"
        return Result(
            self.seed,
            outcome,
            violation,
            self.trace,
            restarts,
            self.now,
            self.faults,
            chosen=self.chosen_faults is not None,
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

    def _check_state(self) -> None:
        data, token = self.server.state
        if self.server.closed:
            self.was_closed = True
        if data is None or (token == self._checked_token and not self.was_closed):
            return
        self._checked_token = token
        if self.was_closed:
            raise Violation("closure: a closed job has a state again")
        state = st.decode(data)
        self.last_state = state
        if state.round != self.last_round:
            members = tuple(member.node_id for member in state.members)
            survivors = [node for node in self.last_members if node in members]
            # Only consecutive rounds compare: one agent's step may form two in a row.
            consecutive = state.round == self.last_round + 1
            if consecutive and list(members[: len(survivors)]) != survivors:
                raise Violation(
                    f"ranks: round {state.round} {list(members)} does not keep the survivors "
                    f"{survivors} of round {self.last_round} first, in order"
                )
            self.last_round, self.last_members = state.round, members
            self.log(f"round {state.round} formed: {list(members)}")
        if state.restarts_used > len(self.real_failure_rounds):
            raise Violation(
                f"budget: {state.restarts_used} restarts spent for "
                f"{len(self.real_failure_rounds)} rounds with a real worker failure"
            )

    def check_success(self, node_id: str) -> None:
        """A node exits 0 only when the job succeeded: every member of its last round
        succeeded (the last one closes the job, which only a success does here). A node that
        exits 0 while the others rerun is never requeued, and the job runs on without it."""
        data, _ = self.server.state
        if self.server.closed or (data is not None and st.all_succeeded(st.decode(data))):
            return
        state = st.decode(data) if data is not None else None
        round_number = state.round if state is not None else 0
        raise Violation(
            f"success: {node_id} exits 0 while round {round_number} of the job has not "
            "succeeded on every member"
        )

    def _check_end(self) -> None:
        if not self.ended():
            raise Violation("liveness: agents still wait with nothing left to happen")
        if not self.endings and not any(agent.stuck for agent in self.agents):
            raise Violation("liveness: every agent left for requeue and none ever came back")
        for how, reason in self.endings:
            if how == "failed" and not reason:
                raise Violation("liveness: the job failed without a reason")


def simulate(seed: int, faults: tuple[Fault, ...] | None = None) -> Result:
    """Run the schedule of ``seed`` (with ``faults`` instead of its own, when given) and
    check every property; reproducible."""
    return World(seed, faults).run()


def violated_property(violation: str) -> str:
    """The property a violation message names (``liveness``, ``ranks``, ``budget``,
    ``closure``, ``success``, ``split brain``), so that shrinking keeps to the same bug."""
    if violation.startswith("two groups train at once"):
        return "split brain"
    head, _, _ = violation.partition(":")
    return head if head in {"liveness", "ranks", "budget", "closure", "success"} else violation


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
    """Run ``schedules`` seeds; the handlers' warnings (a straggler left out) stay quiet."""
    logging.disable(logging.WARNING)
    report = Report(first_seed, schedules)
    for seed in range(first_seed, first_seed + schedules):
        result = simulate(seed)
        report.outcomes[result.outcome] = report.outcomes.get(result.outcome, 0) + 1
        if result.violation is not None:
            shrunk = len(report.failures) < SHRUNK_IN_REPORT
            report.failures.append(shrink(result) if shrunk else result)
    return report
