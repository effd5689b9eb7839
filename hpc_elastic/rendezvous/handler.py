"""The rendezvous state machine, on top of any Store.

An agent in ``next_round`` loops: read the state and the membership, ask ``state.next_action``
what to do, do it (one compare-and-set at most) and, when there is nothing to do, sleep until
the store reports a change or the last-call / min-wait deadline passes. No polling: the
store's watches wake the loop, and they also set ``changed`` while workers run.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from hpc_elastic import contract
from hpc_elastic.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousUnreachableError,
)
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous import tables
from hpc_elastic.rendezvous.api import (
    Failure,
    JobFailedError,
    NodeInfo,
    Rendezvous,
    RendezvousSettings,
    Round,
)
from hpc_elastic.rendezvous.backend import ABSENT, NOTE_SEPARATOR, ConnectionState, Mark, Store
from hpc_elastic.rendezvous.deadlines import Deadlines
from hpc_elastic.spec import MASTER_PORTS_ENV, parse_port_range

PROPOSER_STAGGER = 0.1
"""Seconds between the turns of successive node ids to complete a round, at the least."""
PROPOSAL_WORK = 0.00025
"""Seconds a proposal takes per candidate (fetching its record, writing its row of the table),
as measured with thousands of agents on two cores. Turns are never closer together than one
proposal of the round at hand: at 4,096 candidates 0.1 s apart, dozens of proposers fetched
every record at once, a stampede that starved sessions until they expired."""
STAGGERED = 50
"""The node ids whose turns are a whole gap apart; those beyond follow a tenth of it apart."""
SPREAD = 0.1
"""The fraction of a gap between the turns of node ids past ``STAGGERED``. Once capped, the
turns made every node beyond the fiftieth propose at once whenever the first fifty had not
committed by then (a loaded join storm)."""
SUCCESSES_IN_STATE = 50
"""The members of a round that records each of their workers' successes in the state, by
compare-and-set, at the most. A larger round records its first success there (every agent
then knows it is finishing) and each other one as a ``Mark.DONE`` of its own. N successes in
the state were N compare-and-sets that every member raced at the job's end: 52 attempts an
agent at 496 agents, and at 1,904 the race expired sessions and failed a job whose workers
all succeeded."""
MEMBERS_RETRY = 1.0
"""Seconds before a step is tried again after the store failed to list members or to give a
round's table."""

log = logging.getLogger(__name__)


def _note_key(topic: str, node_id: str) -> str:
    if NOTE_SEPARATOR in topic:
        raise RendezvousError(
            f"Note topic '{topic}' holds '{NOTE_SEPARATOR}', which separates a topic from a "
            "node id; choose a topic without it."
        )
    return f"{topic}{NOTE_SEPARATOR}{node_id}"


def unreachable_sentence(where: str, settings: RendezvousSettings) -> str:
    """Why a node gives up on a store out of reach, naming the store and the bound."""
    flag = "--min-wait" if settings.outage_limit is None else "--zk-outage-limit"
    return (
        f"{where} stayed out of reach for {settings.give_up_after:g} s ({flag}), so this node "
        f"leaves job '{settings.run_id}'; check that the ensemble runs and that this node "
        "reaches it, then submit the job again."
    )


def free_port(
    environ: Mapping[str, str] = os.environ, ephemeral: Path = Path(contract.EPHEMERAL_RANGE_FILE)
) -> int:
    """A port that is free now, for a store that rank 0 opens moments later.

    With ``HPC_ELASTIC_MASTER_PORTS=LOW:HIGH`` (``submit --master-port-range``) only ports in
    that range are tried, so a site can open just those between its nodes. Otherwise one below
    the kernel's ephemeral range (``unraced_ports``): a port of that range, free now, can be
    the local port of anyone's next outgoing connection before rank 0 binds it (rank 0 then
    fails with EADDRINUSE, seen on a busy machine); any free port where there is none below.
    """
    configured = environ.get(MASTER_PORTS_ENV)
    low, high = port_range(configured) if configured else unraced_ports(ephemeral)
    port = _probe(low, high)
    if port is None and not configured:
        port = _probe(0, 0)  # every candidate below the ephemeral range is taken: any port
    if port is not None:
        return port
    raise RendezvousError(
        f"No free port in {MASTER_PORTS_ENV} '{low}:{high}' for the workers' MASTER_PORT; "
        "widen --master-port-range."
    )


def _probe(low: int, high: int) -> int | None:
    """A port of ``low..high`` that binds now (0..0: the kernel's pick); None if none of up to
    256 tried does."""
    for candidate in random.sample(range(low, high + 1), min(high - low + 1, 256)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", candidate))
            except OSError:
                continue
            port: int = probe.getsockname()[1]
            return port
    return None


def unraced_ports(ephemeral: Path) -> tuple[int, int]:
    """``contract.DEFAULT_MASTER_PORTS`` less the kernel's ephemeral range (read from
    ``ephemeral``); (0, 0), any port, where nothing is left or the range cannot be read."""
    low, high = contract.DEFAULT_MASTER_PORTS
    try:
        first, last = (int(part) for part in ephemeral.read_text().split())
    except (OSError, ValueError):
        return 0, 0
    if first > low:
        high = min(high, first - 1)
    elif last < high:
        low = max(low, last + 1)
    else:
        return 0, 0
    return (low, high) if low <= high else (0, 0)


def port_range(text: str | None) -> tuple[int, int]:
    """The configured range, or (0, 0): bind port 0, and the kernel picks any free one."""
    if not text:
        return 0, 0
    low, high = parse_port_range(text).split(":")
    return int(low), int(high)


_FAILING = (st.Barrier.MEMBER_LOST, st.Barrier.TIMED_OUT)
"""The exit barrier's decisions that fail the job."""


def _marked_successes(state: st.JobState) -> bool:
    """Whether ``state``'s round records its successes but the first as marks
    (``SUCCESSES_IN_STATE``, ``StoreRendezvous._record_success``)."""
    return len(state.members) > SUCCESSES_IN_STATE


def turn(position: int, candidates: int = 0) -> float:
    """Seconds a node waits before it completes a round, ``position`` lower node ids ahead of
    it among ``candidates``: a gap apart (``PROPOSER_STAGGER``, or one proposal's work if
    longer) for the first ``STAGGERED``, a tenth of a gap (``SPREAD``) beyond them."""
    gap = max(PROPOSER_STAGGER, candidates * PROPOSAL_WORK)
    staggered = min(position, STAGGERED)
    return gap * staggered + gap * SPREAD * (position - staggered)


@dataclass(frozen=True)
class Step:
    """One decision of a waiting loop (``next_round`` or the exit barrier) and its outcome.

    The blocking loops in production and the single-threaded simulator both drive the
    handler by these steps: act again at once (``again``), return (``round`` / ``done``),
    or sleep until the store reports a change or the clock reaches ``wake_at``.
    """

    action: st.Action | st.Barrier
    again: bool = False
    wake_at: float | None = None
    round: Round | None = None
    done: bool | None = None
    """The exit barrier's result: True when the job finished, False to rejoin."""


_WRITES = frozenset({st.Action.PUBLISH_PORT, st.Action.READMIT})
"""Actions that write one new state and look again (``StoreRendezvous._written``)."""


class StoreRendezvous(Rendezvous):
    """One node's rendezvous over a Store; ``expected_nodes`` says how many nodes could
    arrive soon (e.g. the Slurm allocation), so a round need not wait for the last call.

    ``clock`` and ``pick_port`` are injected by the simulator (hpc_elastic/simulation);
    production uses the monotonic clock and a free local port.

    Why one class of over forty methods: it is the whole ``Rendezvous`` interface the agent
    calls (eighteen methods, most a line or two over the store), plus the steps the
    simulator drives one at a time (``begin_round``/``round_step``,
    ``begin_barrier``/``barrier_step``); the rest are those steps' small parts, one action
    each. What can live apart does: every decision is a pure rule of ``state``, and every
    deadline is kept by ``deadlines.Deadlines``.
    """

    def __init__(
        self,
        settings: RendezvousSettings,
        node: NodeInfo,
        store: Store,
        expected_nodes: Callable[[], int | None] | None = None,
        owns_store: bool = True,
        *,
        clock: Callable[[], float] = time.monotonic,
        pick_port: Callable[[], int] = free_port,
    ) -> None:
        super().__init__(settings, node)
        self._store = store
        self._expected_nodes = expected_nodes
        self._expected: int | None = None
        """The last ``expected_nodes()`` the loop saw: the watch thread reads this value and
        never calls ``expected_nodes`` itself (it runs squeue, which may block for a minute)."""
        self._owns_store = owns_store
        self._clock = clock
        self._pick_port = pick_port
        self._round = 0
        self._in_round = False
        """From returning a round until the next ``next_round``: only then is ``changed`` set."""
        self._arrivals_only = False
        """Whether every change that superseded the round was an arrival (``only_arrivals``):
        decided in the watch thread from what it read anyway, so the agent never waits on
        the store (it may be cut off) to choose its workers' grace."""
        self._peer_lost = False
        """Whether the superseded round lost a rank (``state.peer_lost``), decided alike."""
        self._generation = 0
        self._waiting_on: st.Action | None = None
        self._wake = threading.Condition()
        self._rejoin = threading.Event()
        self._deadlines = Deadlines(settings, clock)
        """Every wait's deadline and the outage clock; it has its own lock (see there)."""
        self._uncounted: frozenset[str] = frozenset()
        """The departed nodes last taken off ``expected_nodes()`` (``st.uncounted``)."""
        self._spare_round: int | None = None
        """The latest round this node was told to wait beside as a hot spare."""
        self._stale = False
        """Set by a disconnection: the cached view must be read from the server once more."""
        self._back_from: int | None = None
        """The round this node's ``Mark.BACK`` was last written for, in its current session."""
        self._done_in: int | None = None
        """The round this node's ``Mark.DONE`` was written for (``_record_success``)."""
        self._members: tuple[NodeInfo, ...] = ()
        """The members of ``_round``, which the round's table holds (``_seen``)."""
        self._record = st.encode_node(node)
        """This node's member record, encoded once: every round's join hands it to the store
        (a restart of thousands of agents spent an eighth of its CPU encoding them again)."""
        store.subscribe(self._on_change, self._on_session_lost)
        store.subscribe_connection(self._on_connection)

    @property
    def generation(self) -> int:
        """Bumped by every store notification that may change the loop's decision."""
        return self._generation

    @property
    def last_round(self) -> int:
        """The latest round this node returned from ``next_round`` (0: none yet)."""
        return self._round

    def next_round(self) -> Round:
        self.begin_round()
        while True:
            generation = self._generation
            step = self.round_step()
            if step.round is not None:
                return step.round
            if not step.again:
                assert isinstance(step.action, st.Action)
                self._sleep(generation, step.wake_at, step.action)

    def begin_round(self) -> None:
        """Enter ``next_round``: join (idempotently) and restart its deadlines."""
        self._in_round = False
        self.changed.clear()
        self._arrivals_only = False
        self._peer_lost = False
        self._join()
        self._deadlines.begin_round()
        log.debug("%s: waiting for a round after round %d", self.node.node_id, self._round)

    def round_step(self) -> Step:
        """Read the state and membership once, decide (``state.next_action``) and act."""
        give_up_at = self._deadlines.give_up_at()
        if give_up_at is not None:
            # Cut off: our view may be stale (a round may have formed without us), so
            # nothing is decided on it; the reconnection wakes us, or we give up.
            self.check_reach()
            log.debug("%s: connection down, waiting for it", self.node.node_id)
            return Step(st.Action.WAIT, wake_at=give_up_at)
        if self._rejoin.is_set():
            self._join()
        data, token = self._store.get_state()
        if self._stale and data is not None:
            # Back after a disconnection: the watches re-fire later, and a round decided on
            # the old view may have been superseded meanwhile, so the server's state is read.
            data, token = self._store.refresh_state(data, token)
            self._stale = False
            log.debug("%s: view refreshed after the reconnection", self.node.node_id)
        read = self._stored((data, token))
        if read is None:
            return Step(st.Action.WAIT, wake_at=self._clock() + MEMBERS_RETRY)
        stored, token = read
        if stored is None:
            self._create_state()
            return Step(st.Action.WAIT, again=True)
        alive = self._store.alive()
        state = self._usable(self._decided_on(stored, alive))
        now = self._clock()
        if not self._listed_for(state, alive):
            log.debug("%s: round %d has a member not listed yet", self.node.node_id, state.round)
            return Step(st.Action.WAIT, wake_at=now + MEMBERS_RETRY)
        if self._expected_nodes is not None:
            self._expected = self._expected_nodes()
            self._note_uncounted(state, alive)
        self._deadlines.judge_stragglers(state.round, st.has_stragglers(state, alive), now)
        action = self._action(state, alive)
        log.debug(
            "%s: round %d, alive %d, decided %s",
            self.node.node_id,
            state.round,
            len(alive),
            action.value,
        )
        if action is st.Action.WAIT:
            self._note_spare(state, alive)
        return self._act(action, state, token, alive, now)

    def _note_uncounted(self, state: st.JobState, alive: frozenset[str]) -> None:
        """Say when the departed nodes taken off ``expected_nodes()`` change (``still_coming``)."""
        gone = st.uncounted(state, alive)
        if gone == self._uncounted:
            return
        self._uncounted = gone
        log.debug(
            "%s: nodes expected: %s, %s without the departed %s",
            self.node.node_id,
            self._expected,
            st.still_coming(state, alive, self._expected),
            sorted(gone),
        )

    def _note_spare(self, state: st.JobState, alive: frozenset[str]) -> None:
        """Say once per round that this node waits beside it as a hot spare."""
        if not self._spare_news(state, alive):
            return
        self._spare_round = state.round
        log.debug("%s: a hot spare beside round %d", self.node.node_id, state.round)
        if self.on_spare is not None:
            self.on_spare(state.round)

    def _act(
        self, action: st.Action, state: st.JobState, token: int, alive: frozenset[str], now: float
    ) -> Step:
        if action is st.Action.RETURN:
            self._round = state.round
            self._members = state.members
            self._in_round = True
            self._on_change()
            return Step(action, round=state.to_round())
        if action in _WRITES:
            self._write(self._written(action, state), state, token)
            return Step(action, again=True)
        if action is st.Action.MARK_READY:
            return self._mark_ready_step(action, state, token, now)
        if action is st.Action.BELOW_MIN:
            min_wait_ends = self._deadlines.below_min(now)
            if min_wait_ends is None:
                # The nodes the decision counted: a live member left out as a stuck straggler
                # is none of them ("only 2 of the 2 nodes" said the simulation's seed 393).
                self._fail_below_min(state, token, st.candidate_count(state, alive))
                return Step(action, again=True)
            return Step(action, wake_at=min_wait_ends)
        if action is st.Action.LAST_CALL:
            last_call_ends = self._deadlines.last_call(now)
            if last_call_ends is not None:
                return Step(action, wake_at=last_call_ends)
        if action in (st.Action.COMPLETE, st.Action.LAST_CALL):
            propose_at = self._deadlines.proposal(now, self._stagger(state, alive))
            if propose_at is None:
                return self._complete(action, state, token, alive, now)
            return Step(action, wake_at=propose_at)
        self._deadlines.drop_proposal()
        if action is st.Action.FINISHING:
            return self._finishing_step(action, state, now)
        if action is st.Action.AWAIT_PORT:
            return self._await_port_step(action, state, token, now)
        if action is st.Action.STRAGGLERS:
            return Step(action, wake_at=self._deadlines.straggler_wait())
        return Step(action)

    def _written(self, action: st.Action, state: st.JobState) -> st.JobState:
        """The state this node writes for one of the ``_WRITES`` actions."""
        if action is st.Action.PUBLISH_PORT:
            pick = self.pick_master_port or self._pick_port
            return st.publish_master(state, state.round, pick())
        return st.readmit(state, self.node.node_id)

    def _mark_back(self, state: st.JobState, token: int) -> None:
        """Say that this member is back from ``state``'s round: a ``Mark.BACK`` of its own,
        fenced by ``token`` (refused, and decided again, if the state moved on). The first
        member back in a round that had not ended otherwise ends it in the state first
        (``ended``), so that every agent learns it without reading the marks; the mark then
        goes under the token that write made."""
        if not st.round_over(state):
            _, token, won = self._write(st.mark_ready(state, self.node.node_id), state, token)
            if not won:
                return
        if self._store.mark(Mark.BACK, state.round, self.node.node_id, token):
            self._back_from = state.round
            log.debug("%s: back from round %d", self.node.node_id, state.round)
            return
        # Refused: the state moved on, and the watch that tells of it may be on its way. A
        # compare-and-set on the stale token cannot win; its answer is the state as it is
        # now, which the store keeps, so the next decision is made on that.
        self._write(state, state, token)
        log.debug(
            "%s: state moved on; not marked back from round %d", self.node.node_id, state.round
        )

    def _await_port_step(
        self, action: st.Action, state: st.JobState, token: int, now: float
    ) -> Step:
        """Wait for rank 0's port up to ``straggler_timeout``, then end the round."""
        port_wait_ends = self._deadlines.port_wait(state.round, now)
        if port_wait_ends is not None:
            return Step(action, wake_at=port_wait_ends)
        log.warning(
            "%s: rank 0 of round %d published no master port within %g s; ending the round",
            self.node.node_id,
            state.round,
            st.straggler_timeout(self.settings),
        )
        self._mark_back(state, token)
        return Step(action, again=True)

    def _finishing_step(self, action: st.Action, state: st.JobState, now: float) -> Step:
        """Wait for a finishing round, but not for ever: past the exit barrier's timeout,
        fail the job naming a member that never finished."""
        deadline = self._deadlines.finishing(state.round, now)
        if deadline is not None:
            return Step(action, wake_at=deadline)
        timeout = self.settings.exit_barrier_timeout
        slow = sorted(st.unfinished(state))[0]
        summary = (
            f"node '{slow}' did not finish round {state.round} within {timeout:g} s of its "
            "first member that did; its workers may hang, see its log"
        )
        self._update(partial(st.fail, summary=summary))
        return Step(action, again=True)

    def _spare_news(self, state: st.JobState, alive: frozenset[str]) -> bool:
        """Whether this node is a hot spare beside a round it has not announced yet."""
        return self._spare_round != state.round and st.is_spare(
            state, alive, self.node.node_id, self.settings.nodes
        )

    def report_failure(self, failure: Failure) -> None:
        log.debug("%s: reporting a failure of round %d", self.node.node_id, self._round)
        self._update(lambda state: st.record_failure(state, self._round, failure))

    def fail(self, summary: str) -> None:
        log.debug("%s: failing the job: %s", self.node.node_id, summary)
        self._update(partial(st.fail, summary=summary))

    def report_success(self) -> bool:
        if self.begin_barrier():
            return True
        while True:
            generation = self._generation
            step = self.barrier_step()
            if step.done is not None:
                return step.done
            if not step.again:
                self._sleep(generation, step.wake_at)

    def begin_barrier(self) -> bool:
        """Record our success and enter the exit barrier; True if ours was the last success
        (then the job is closed and there is nothing to wait for)."""
        try:
            state = self._record_success()
        except RendezvousClosedError:
            # Closed before our write: only the last success (or a cancel) closes a job, and
            # the barrier reads a removed state as done (``state.barrier_action``). Seen in
            # local mode at load 11: the agent took it for an error and exited 1.
            log.debug("%s: the job closed before our success was recorded", self.node.node_id)
            return True
        if st.all_succeeded(state):
            self.close()
            return True
        self._deadlines.begin_barrier()
        log.debug("%s: in the exit barrier of round %d", self.node.node_id, self._round)
        return False

    def barrier_step(self) -> Step:
        """One decision of the exit barrier (``state.barrier_action``).

        Membership is read before the state: a node missing from the (older) membership left
        before the state was read, so the state holds its success if it had one. The other
        way round, the last success, its close and that node's exit could all land between
        the two reads, and a node that finished looked lost (seen in local mode: "all workers
        finished", then exit 1). A failure is written on the state that was read, never on
        a newer one (``_fail_barrier``)."""
        alive = self._store.alive()
        read = self._stored()
        if read is None:
            return Step(st.Barrier.WAIT, wake_at=self._clock() + MEMBERS_RETRY)
        state, token = read
        if state is None:
            return Step(st.Barrier.DONE, done=True)  # removed: only a close does that
        view = self._with_done(state, alive)
        timeout = self.settings.exit_barrier_timeout
        deadline = self._deadlines.barrier_ends()
        decision = st.barrier_action(view, alive, self._round, self._clock(), deadline)
        if decision in _FAILING and _marked_successes(view):
            # Only the round's proposer follows the marks, and as its watch last listed them:
            # a member that finished, then died, is not lost, nor one that finished is slow.
            # The marks are read from the server once, before failing the job.
            view = st.with_done(state, self._store.marks(Mark.DONE, state.round))
            decision = st.barrier_action(view, alive, self._round, self._clock(), deadline)
        log.debug("%s: exit barrier decided %s", self.node.node_id, decision.value)
        if decision is not st.Barrier.MEMBER_LOST:
            self._deadlines.nobody_gone()
        if decision is st.Barrier.DONE:
            if not view.closed and _marked_successes(view):
                return self._closing_step(view, alive)
            return Step(decision, done=True)
        if decision is st.Barrier.RESTART:
            return Step(decision, done=False)
        if decision is st.Barrier.FAILED:
            raise JobFailedError(f"Job '{self.settings.run_id}' failed: {state.failure_summary}")
        if decision is st.Barrier.MEMBER_LOST:
            return self._member_lost_step(view, alive, state, token)
        if decision is st.Barrier.TIMED_OUT:
            slow = sorted(st.unfinished(view))[0]
            summary = (
                f"node '{slow}' did not finish round {state.round} within {timeout:g} s of node "
                f"'{self.node.node_id}'; its workers may hang, see its log"
            )
            return self._fail_barrier(decision, state, token, summary)
        return Step(decision, wake_at=deadline)

    def _member_lost_step(
        self, view: st.JobState, alive: frozenset[str], state: st.JobState, token: int
    ) -> Step:
        """A member is gone from the exit barrier before its success was recorded: fail the
        job, once it has been gone for a session timeout (``Deadlines.member_gone``). Its
        agent may live on: its session expired as its workers finished (frozen for a moment,
        or starved on a loaded machine: a job of 1,904 agents whose workers all succeeded
        failed so), and it records its success with a new session meanwhile."""
        lost = sorted(st.unfinished(view) - alive)[0]
        fails_at = self._deadlines.member_gone(state.round, self._clock())
        if fails_at is not None:
            log.debug("%s: node '%s' gone unfinished; waiting for it", self.node.node_id, lost)
            return Step(st.Barrier.MEMBER_LOST, wake_at=fails_at)
        summary = f"node '{lost}' left round {state.round} before its workers finished"
        return self._fail_barrier(st.Barrier.MEMBER_LOST, state, token, summary)

    def _closing_step(self, state: st.JobState, alive: frozenset[str]) -> Step:
        """Every member of a round whose successes are marks succeeded: the round's proposer
        closes the job, and the others wait for the close. Leaving before it, their going
        could reach the closer before their marks do, and look like members lost."""
        if st.proposer(state, alive) != self.node.node_id:
            return Step(st.Barrier.WAIT, wake_at=self._clock() + MEMBERS_RETRY)
        log.debug("%s: every member of round %d succeeded; closing", self.node.node_id, state.round)
        self.close()
        return Step(st.Barrier.DONE, done=True)

    def _record_success(self) -> st.JobState:
        """Record this node's success in its round (``st.record_success``) and return the
        state it went on, unchanged where there is nothing to record (the round ended, the job
        failed or closed). The round's first success goes into the state, so that every agent
        learns the round is finishing (its first ranks race for it, the others wait their
        turn: ``_first_success_turn``), and so does every success of a round of up to
        ``SUCCESSES_IN_STATE`` members; any other is a fenced ``Mark.DONE``, which races
        nobody (``_with_done``)."""
        me = self.node.node_id
        since = self._clock()
        while True:
            generation = self._generation
            state, token = tables.current(self._store)
            if state is None:
                raise RendezvousClosedError(f"Job '{self.settings.run_id}' is closed.")
            recorded = st.record_success(state, self._round, me)
            if recorded is state:
                return state
            if not state.succeeded or not _marked_successes(state):
                first_at = self._first_success_turn(state, since)
                if first_at is not None:
                    self._sleep(generation, first_at)
                elif self._write(recorded, state, token)[2]:
                    return recorded
            elif self._store.mark(Mark.DONE, state.round, me, token):
                self._done_in = state.round
                return state
            else:
                self._write(state, state, token)  # refused: the state moved; this reads it

    def _first_success_turn(self, state: st.JobState, since: float) -> float | None:
        """When this member, finished in a round of marked successes that holds none yet,
        writes the first one into the state itself (None: now), having finished at
        ``since``. The first ``STAGGERED`` ranks write it at once, and one of their
        compare-and-sets wins; the ranks past them take turns (``turn``) in case all of those
        are slow or gone, and mark as soon as the first success is there (its write wakes
        them). At a job's end every member finishes at about the same step, and each raced
        that compare-and-set: at 1,904 agents, 1.2 writes and 1.3 reads of the state an
        agent, and a session lost on a saturated machine."""
        if not _marked_successes(state):
            return None
        rank = st.rank_of(state, self.node.node_id)
        if rank < STAGGERED:
            return None
        at = since + turn(rank - STAGGERED + 1)
        return None if self._clock() >= at else at

    def _fail_barrier(
        self, decision: st.Barrier, state: st.JobState, token: int, summary: str
    ) -> Step:
        """Fail the job on the state the barrier decided from, then decide again.

        A compare-and-set on that state's token, not ``_update``: if the state moved on
        meanwhile (the last success, or its close), the decision was made on an old picture
        and is dropped, instead of failing a job that succeeded or raising "closed"."""
        _, _, won = self._write(st.fail(state, summary), state, token)
        log.debug(
            "%s: exit barrier %s: %s",
            self.node.node_id,
            "failed the job" if won else "state moved on, deciding again",
            summary,
        )
        return Step(decision, again=True)

    def report_departed(self, node_id: str, round_number: int) -> bool:
        me = self.node.node_id
        state = self._update(
            lambda state: st.depart(state, self._store.alive(), me, node_id, round_number)
        )
        marked = state.round == round_number and node_id in state.departed
        log.debug(
            "%s: link of round %d to %s closed by its peer; %s",
            me,
            round_number,
            node_id,
            "departed" if marked else "not marked (the round moved on, or it left already)",
        )
        return marked

    def share(self, topic: str, data: bytes) -> None:
        log.debug("%s: sharing a note on %s", self.node.node_id, topic)
        self._store.put_note(_note_key(topic, self.node.node_id), data)

    def shared(self, topic: str) -> dict[str, bytes]:
        prefix = _note_key(topic, "")
        notes = self._store.notes(topic)
        return {key[len(prefix) :]: data for key, data in notes.items() if key != prefix}

    def topics(self, prefix: str) -> frozenset[str]:
        return frozenset(t for t in self._store.note_topics() if t.startswith(prefix))

    def sharers(self, topic: str) -> frozenset[str]:
        prefix = _note_key(topic, "")
        keys = self._store.note_keys(topic)
        return frozenset(key[len(prefix) :] for key in keys if key != prefix)

    def agree(self, topic: str, data: bytes) -> bytes:
        answer = self._store.claim_note(_note_key(topic, ""), data)
        log.debug(
            "%s: %s on %s", self.node.node_id, "agreed" if answer == data else "adopted", topic
        )
        return answer

    def agreed(self, topic: str) -> bytes | None:
        key = _note_key(topic, "")
        return self._store.notes(topic).get(key)

    def forget(self, topic: str) -> None:
        log.debug("%s: forgetting the notes on %s", self.node.node_id, topic)
        self._store.forget_notes(topic)

    def check_reach(self) -> None:
        if self._deadlines.out_of_reach():
            log.debug("%s: out of reach for %g s", self.node.node_id, self.settings.give_up_after)
            raise RendezvousUnreachableError(unreachable_sentence(self._store.where, self.settings))

    def suspended_since(self) -> float | None:
        return self._deadlines.suspended_since()

    def time_cut_off(self) -> float:
        return self._deadlines.time_cut_off()

    def only_arrivals(self) -> bool:
        return self._arrivals_only

    def peer_lost(self) -> bool:
        return self._peer_lost

    def _on_connection(self, state: ConnectionState) -> None:
        """Note when the connection went down; it is up again only once CONNECTED (after LOST
        a new session follows, and this node's membership must be remade)."""
        if state is ConnectionState.CONNECTED:
            self._deadlines.connection_up()
        else:
            self._stale = True
            self._deadlines.connection_down()
        log.debug("%s: connection %s", self.node.node_id, state.value)
        with self._wake:
            self._generation += 1
            self._wake.notify_all()

    def close(self) -> None:
        if self._store.get_state()[0] is not None:
            self._update(st.close)
        self._store.close_job()

    def leave(self) -> None:
        self._store.unsubscribe(self._on_change)
        self._store.unsubscribe_connection(self._on_connection)
        self._store.leave(self.node.node_id)
        if self._owns_store:
            self._store.release()

    def snapshot(self) -> st.JobState | None:
        """The job's state for ``hpc-elastic status``; None before the first agent arrives."""
        return tables.current(self._store)[0]

    def document(self) -> st.JobState | None:
        """The job's state without its members, as this connection last saw it: no request
        (the members are in the round's table, which ``snapshot`` reads)."""
        data, _ = self._store.get_state()
        return st.decode(data).state if data is not None else None

    def job_running(self) -> bool:
        return st.running(self.document())

    def _join(self) -> None:
        self._rejoin.clear()
        self._store.join(self.node.node_id, self._record)

    def _create_state(self) -> None:
        if self._store.is_closed():
            raise RendezvousClosedError(
                f"Job '{self.settings.run_id}' is closed (finished or cancelled); nothing to join."
            )
        initial = st.JobState(max_restarts=self.settings.max_restarts)
        self._write(initial, None, ABSENT)

    def _usable(self, state: st.JobState) -> st.JobState:
        if state.closed:
            raise RendezvousClosedError(
                f"Job '{self.settings.run_id}' is closed (finished or cancelled); nothing to join."
            )
        if state.failed:
            raise JobFailedError(f"Job '{self.settings.run_id}' failed: {state.failure_summary}")
        return state

    def _complete(
        self, action: st.Action, state: st.JobState, token: int, alive: frozenset[str], now: float
    ) -> Step:
        present = st.candidates(state, alive)
        try:
            records = self._store.members(present)
        except RendezvousError as error:
            # A transient store error (connection loss): decide again a moment later.
            log.debug("%s: fetching members failed (%s); retrying", self.node.node_id, error)
            return Step(action, wake_at=now + MEMBERS_RETRY)
        if self._store.get_state()[1] != token:
            return Step(action, again=True)  # Changed meanwhile: decide again, do not encode.
        if len(records) < len(present):
            # A candidate left after our view was taken (its watch is still on the way): the
            # round would be decided on who is gone, and could form below MIN (simulation
            # seed 27655). Decide again once the view caught up, or a moment later.
            log.debug("%s: a candidate left meanwhile; deciding again", self.node.node_id)
            return Step(action, wake_at=now + MEMBERS_RETRY)
        overdue = self._deadlines.stragglers_overdue
        exclude = st.stragglers(state, alive) if overdue else frozenset()
        if exclude:
            log.warning(
                "%s: leaving out nodes %s, which did not come back from round %d within %g s",
                self.node.node_id,
                sorted(exclude),
                state.round,
                st.straggler_timeout(self.settings),
            )
        candidates = [st.decode_node(record) for record in records]
        new = self._with_own_port(
            st.complete_round(state, candidates, self.settings.nodes, exclude=exclude)
        )
        _, _, won = self._write(new, state, token)
        if won:
            log.debug(
                "%s: completed round %d %s",
                self.node.node_id,
                new.round,
                "after the last call" if action is st.Action.LAST_CALL else "at once",
            )
            # The marks of the rounds before the one that just ended: nobody decides on
            # them any more (those of the one that ended, laggards may still read).
            self._store.forget_rounds(state.round)
        return Step(action, again=True)

    def _with_own_port(self, new: st.JobState) -> st.JobState:
        """``new`` with this node's master port when this node is its rank 0, as the proposer
        of a round after a round usually is (``st.proposer``: survivors keep their order).
        The round is then committed ready to start: one write through the quorum, one wave
        of notifications and one read a connection, where the commit and then the port made
        two of each. A port picked for a proposal that loses its compare-and-set is dropped
        with it."""
        if new.members and new.members[0].node_id == self.node.node_id:
            return self._written(st.Action.PUBLISH_PORT, new)
        return new

    def _mark_ready_step(
        self, action: st.Action, state: st.JobState, token: int, now: float
    ) -> Step:
        """Mark this member back (``_mark_back``), once it is its turn to end the round."""
        ends_at = self._ending_turn(state, now)
        if ends_at is not None:
            return Step(action, wake_at=ends_at)
        self._mark_back(state, token)
        return Step(action, again=True)

    def _ending_turn(self, state: st.JobState, now: float) -> float | None:
        """When this member, back from a round nobody has ended yet, ends it in the state
        itself (None: now, or the round is over and it only marks). The first ``STAGGERED``
        ranks end it at once, one of their compare-and-sets wins, and the others find it
        ended; the ranks past them take turns (``turn``) in case all of those are gone. When
        a member of thousands was lost, every member once wrote the end at the same moment:
        thousands of compare-and-sets through the quorum, all but one refused."""
        if st.round_over(state):
            return None
        rank = st.rank_of(state, self.node.node_id)
        if rank < STAGGERED:
            return None
        return self._deadlines.ending(
            state.round, now, turn(rank - STAGGERED + 1, len(state.members))
        )

    def _stagger(self, state: st.JobState, alive: frozenset[str]) -> float:
        """Seconds to let lower node ids complete the round first: with hundreds of nodes,
        one proposal instead of a stampede of compare-and-sets that all but one lose. The
        proposer of a round that is over (``st.proposer``) goes first: the others do not see
        who is back, and propose only once the stragglers are overdue."""
        if st.round_over(state) and st.proposer(state, alive) == self.node.node_id:
            return 0.0
        return turn(st.position_among(alive, self.node.node_id), len(alive))

    def _fail_below_min(self, state: st.JobState, token: int, present: int) -> None:
        summary = (
            f"only {present} of the {self.settings.nodes.min} nodes needed joined within "
            f"{self.settings.min_wait:g} s; check that the job got its nodes or lower --nodes"
        )
        self._write(st.fail(state, summary), state, token)

    def _update(self, step: Callable[[st.JobState], st.JobState]) -> st.JobState:
        """Apply ``step`` by compare-and-set until it sticks or changes nothing."""
        state = tables.update(self._store, step)
        if state is not None:
            return state
        raise RendezvousClosedError(
            f"Job '{self.settings.run_id}' is closed (finished or cancelled); nothing to update."
        )

    def _stored(
        self, view: tuple[bytes | None, int] | None = None
    ) -> tuple[st.JobState | None, int] | None:
        """The store's state with its round's members (``tables.current``), or None where
        the table could not be read: a store error, as when the connection has just failed
        and the notice of it is on its way. Decide again a moment later, as after a failed
        listing of the members (a cached view alone never raised here)."""
        try:
            return tables.current(self._store, view)
        except tables.UnreadTable as error:
            log.debug(
                "%s: reading the round's table failed (%s); retrying", self.node.node_id, error
            )
            return None

    def _write(
        self, new: st.JobState, after: st.JobState | None, token: int
    ) -> tuple[bytes | None, int, bool]:
        """Compare-and-set ``new``, decided on ``after`` with ``token`` (``tables.write``:
        a new round's table goes first)."""
        return tables.write(self._store, new, token, after=after)

    def _with_done(self, state: st.JobState, alive: frozenset[str]) -> st.JobState:
        """``state`` with the ``Mark.DONE`` marks of its round as successes, where the round
        is finishing and records its successes as marks (``_record_success``); any other
        state as it is. The round's proposer, which closes the job, follows the marks (as its
        connection last heard them); the others know their own, as they know their own
        ``Mark.BACK`` (``_back``): a finishing round of N costs each of them no listing of
        N marks, and they read them once before failing the job (``barrier_step``)."""
        if not state.succeeded or not _marked_successes(state) or st.round_over(state):
            return state
        me = self.node.node_id
        if st.proposer(state, alive) == me:
            return st.with_done(state, self._store.seen_marks(Mark.DONE, state.round))
        return st.with_done(state, frozenset({me})) if self._done_in == state.round else state

    def _listed_for(self, state: st.JobState, alive: frozenset[str]) -> bool:
        """Whether ``alive`` may be decided on with ``state``: a member of its round that the
        list does not show is gone only if the list is as new as the state. Otherwise it may
        have joined again just before the round that counts it was committed, and deciding
        it gone would end a round nobody left (a restart of every member for nothing)."""
        return not st.unlisted(state, alive) or self._store.alive_is_current()

    def _decided_on(self, state: st.JobState, alive: frozenset[str]) -> st.JobState:
        """The state a decision is made on: the stored one, and once its round is over, the
        members that are back from it (``_back``). While the round runs nobody is back."""
        if state.round == 0:
            return state
        if not st.round_over(state):
            return self._with_done(state, alive)
        return st.with_back(state, self._back(state, alive))

    def _back(self, state: st.JobState, alive: frozenset[str]) -> frozenset[str]:
        """Who this node knows to be back from ``state``'s round. The round's proposer
        (``st.proposer``), and any node that has waited out the stragglers, follow the
        ``Mark.BACK`` marks (``Store.seen_marks``: as its connection last heard them, no
        request). The others know only their own mark: they wait for the commit, and a
        restart of N nodes costs each of them no listing of N marks."""
        me = self.node.node_id
        if self._deadlines.stragglers_overdue or st.proposer(state, alive) == me:
            return self._store.seen_marks(Mark.BACK, state.round)
        return frozenset({me}) if self._back_from == state.round else frozenset()

    def _action(self, state: st.JobState, alive: frozenset[str]) -> st.Action:
        """The pure rule with what the loop last saw; safe in the watch thread (no I/O)."""
        return st.next_action(
            state,
            alive,
            self.node.node_id,
            self._round,
            self.settings.nodes,
            expected=self._expected,
            stragglers_overdue=self._deadlines.stragglers_overdue,
        )

    def _sleep(
        self, generation: int, deadline: float | None, action: st.Action | None = None
    ) -> None:
        """Sleep until a change (one that alters ``action``, if given) or the deadline."""
        with self._wake:
            if self._generation != generation:
                return
            timeout = None if deadline is None else max(0.0, deadline - self._clock())
            self._waiting_on = action
            self._wake.wait(timeout)
            self._waiting_on = None

    def _on_change(self) -> None:
        """Called from the store's watch thread: flag a superseded round, wake the loop."""
        if self._in_round:
            self._note_supersession()
        if self._nothing_new():
            return
        with self._wake:
            self._generation += 1
            self._wake.notify_all()

    def _nothing_new(self) -> bool:
        """Whether the sleeping loop would decide what it already waits on. Deciding here,
        in the watch thread, spares hundreds of handlers sharing a store from waking up
        for every join (the 1024-agent benchmark)."""
        waiting_on = self._waiting_on
        data, _ = self._store.get_state()
        if waiting_on is None or data is None:
            return False
        stored = tables.read(self._store, data, fetch=False)
        if stored is None:
            return False  # A new round's table, not read yet: the loop reads it.
        alive = self._store.alive()
        state = self._decided_on(stored, alive)
        if not self._listed_for(state, alive):
            return True  # The store tells again once its list catches up with the state.
        if state.closed or state.failed:
            return False
        if waiting_on is st.Action.MARK_READY and st.round_over(state):
            return False  # Waiting for its turn to end the round, which another has ended.
        if self._spare_news(state, alive):
            # Still WAIT, but now as a hot spare (e.g. it first waited for its own membership
            # to show): the loop must run once to announce it.
            return False
        return self._action(state, alive) is waiting_on

    def _on_session_lost(self) -> None:
        self._back_from = None  # the mark was ephemeral: it went with the session
        self._rejoin.set()
        self._arrivals_only = False
        self.changed.set()
        self._on_change()

    def _note_supersession(self) -> None:
        """Set ``changed`` once the round is superseded, and keep ``_arrivals_only`` true only
        while every change seen since then was an arrival (a later departure makes it false).
        A change that leaves the round live reads nothing more after the first supersession."""
        first = not self.changed.is_set()
        if not first and not self._arrivals_only:
            return  # Already superseded for a reason other than arrivals: nothing to learn.
        data, _ = self._store.get_state()
        alive = self._store.alive()
        state = None if data is None else self._with_done(self._seen(data), alive)
        if state is not None and not self._listed_for(state, alive):
            return  # The store tells again once its list catches up with the state.
        superseded = state is None or (
            state.round != self._round
            or state.closed
            or state.failed
            or not st.round_is_live(state, alive, self.settings.nodes)
        )
        if not superseded and first:
            return
        self._arrivals_only = state is not None and st.only_arrivals(state, alive, self._round)
        self._peer_lost = state is not None and st.peer_lost(state, alive, self._round)
        if first:
            log.debug(
                "%s: round %d superseded (%s)",
                self.node.node_id,
                self._round,
                "arrivals only" if self._arrivals_only else "a member left, failed or finished",
            )
        self.changed.set()

    def _seen(self, data: bytes) -> st.JobState:
        """The state ``data`` holds, as a watch callback reads it: without a request. The
        members of the round this node runs are its own (a round's table never changes); a
        newer round's may not have been read yet, and only its number matters then (the
        round is superseded, and ``only_arrivals`` and ``peer_lost`` of an older round are
        false whatever its members), so they are left out."""
        stored = tables.read(self._store, data, fetch=False)
        if stored is not None:
            return stored
        document = st.decode(data)
        if document.state.round == self._round:
            return replace(document.state, members=self._members)
        return document.state
