"""The rendezvous state machine on an in-memory Store (unit tests; the real one is ZooKeeper)."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import pytest

from hpc_elastic.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousUnreachableError,
)
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import Failure, JobFailedError, NodeInfo, RendezvousSettings, Round
from hpc_elastic.rendezvous.backend import ABSENT, Mark, Store, place_mark, table_digest
from hpc_elastic.rendezvous.handler import (
    PROPOSAL_WORK,
    PROPOSER_STAGGER,
    SPREAD,
    STAGGERED,
    SUCCESSES_IN_STATE,
    Step,
    StoreRendezvous,
    turn,
)
from hpc_elastic.rendezvous.memory import ManualClock, MemoryServer, MemoryStore
from hpc_elastic.spec import NodeRange


class FakeStore(Store):
    """Everything a ZooKeeper store does, in one process, notifying synchronously."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._state: tuple[bytes | None, int] = (None, ABSENT)
        self._members: dict[str, bytes] = {}
        self._closed = False
        self._subscribers: dict[Callable[[], None], Callable[[], None]] = {}
        self._marks: dict[tuple[Mark, int], dict[str, object]] = {}
        self._tables: dict[tuple[int, str], bytes] = {}

    def get_state(self) -> tuple[bytes | None, int]:
        with self._lock:
            return self._state

    def set_state(self, data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        with self._lock:
            won = token == self._state[1]
            if won:
                self._state = (data, token + 1)
            current = self._state
        if won:
            self._notify()
        return (*current, won)

    def join(self, node_id: str, data: bytes) -> None:
        with self._lock:
            if self._closed:
                raise RendezvousClosedError("closed")
            self._members.setdefault(node_id, data)
        self._notify()

    def leave(self, node_id: str) -> None:
        with self._lock:
            self._members.pop(node_id, None)
        self._notify()

    def alive(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._members)

    def members(self, node_ids: Iterable[str]) -> list[bytes]:
        wanted = set(node_ids)
        with self._lock:
            return [data for node_id, data in self._members.items() if node_id in wanted]

    def subscribe(self, on_change: Callable[[], None], on_session_lost: Callable[[], None]) -> None:
        self._subscribers[on_change] = on_session_lost

    def unsubscribe(self, on_change: Callable[[], None]) -> None:
        self._subscribers.pop(on_change, None)

    def put_note(self, key: str, data: bytes) -> None:
        raise NotImplementedError("the handler's tests write no notes")

    def claim_note(self, key: str, data: bytes) -> bytes:
        raise NotImplementedError("the handler's tests write no notes")

    def notes(self, topic: str) -> dict[str, bytes]:
        return {}

    def note_topics(self) -> frozenset[str]:
        return frozenset()

    def forget_notes(self, topic: str) -> None:
        raise NotImplementedError("the handler's tests write no notes")

    def note_keys(self, topic: str) -> frozenset[str]:
        return frozenset()

    def mark(self, kind: Mark, round_number: int, node_id: str, token: int) -> bool:
        """The stores' own rule (``place_mark``); every node shares this one connection, so
        ``expire`` drops a node's ``BACK`` marks as its session's end would."""
        with self._lock:
            if self._closed:
                raise RendezvousClosedError("closed")
            marked = self._marks.setdefault((kind, round_number), {})
            new = node_id not in marked
            fenced = token != ABSENT and token == self._state[1]
            written = place_mark(marked, kind, node_id, self, fenced=fenced)
        if written and new:
            self._notify()
        return written

    def marks(self, kind: Mark, round_number: int) -> frozenset[str]:
        with self._lock:
            return frozenset(self._marks.get((kind, round_number), ()))

    def follow_marks(self, kind: Mark, round_number: int) -> None:
        """Every change notifies every subscriber here."""

    def put_table(self, round_number: int, table: bytes) -> str:
        with self._lock:
            if self._closed:
                raise RendezvousClosedError("closed")
            digest = table_digest(table)
            self._tables[round_number, digest] = table
            return digest

    def table(self, round_number: int, digest: str) -> bytes | None:
        with self._lock:
            return self._tables.get((round_number, digest))

    def forget_rounds(self, before_round: int) -> None:
        with self._lock:
            for key in [key for key in self._marks if key[1] < before_round]:
                del self._marks[key]
            for done in [key for key in self._tables if key[0] < before_round]:
                del self._tables[done]

    def is_closed(self) -> bool:
        return self._closed

    def close_job(self) -> None:
        with self._lock:
            self._closed = True
            self._state = (None, ABSENT)
            self._members.clear()
            self._marks.clear()
            self._tables.clear()
        self._notify()

    def release(self) -> None:
        """Nothing to release in memory."""

    def expire(self, node_id: str) -> None:
        """What a ZooKeeper session expiry does: the membership vanishes with the node's
        ``BACK`` marks, the owner is told."""
        with self._lock:
            for (kind, _), marked in self._marks.items():
                if kind.ephemeral:
                    marked.pop(node_id, None)
        self.leave(node_id)
        for on_session_lost in list(self._subscribers.values()):
            on_session_lost()

    def _notify(self) -> None:
        for on_change in list(self._subscribers):
            on_change()


def settings(last_call: float = 0.2, min_wait: float = 5.0) -> RendezvousSettings:
    return RendezvousSettings(
        run_id="job", nodes=NodeRange(2, 3), last_call=last_call, min_wait=min_wait
    )


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


@pytest.fixture
def pool(store: FakeStore) -> Iterator[ThreadPoolExecutor]:
    """Threads for agents' blocking calls. The job is closed before the pool is shut down,
    so that an agent still waiting in ``next_round`` (a test that failed) returns instead of
    holding the shutdown, and the run, until its timeout."""
    with ThreadPoolExecutor(8) as executor:
        try:
            yield executor
        finally:
            store.close_job()


def agent(
    store: FakeStore,
    name: str,
    config: RendezvousSettings | None = None,
    expected_nodes: Callable[[], int | None] | None = None,
) -> StoreRendezvous:
    node = NodeInfo(node_id=name, host=f"host-{name}", nproc=1)
    return StoreRendezvous(config or settings(), node, store, expected_nodes)


def rounds(pool: ThreadPoolExecutor, agents: Iterable[StoreRendezvous]) -> list[Round]:
    futures: list[Future[Round]] = [pool.submit(a.next_round) for a in agents]
    return [future.result(timeout=10) for future in futures]


def test_max_nodes_complete_at_once() -> None:
    world = Stepped(settings(last_call=2.0))
    results = world.rounds([world.handler(n) for n in "abc"])
    assert world.clock.now < 2.0, "no last call when MAX are present"
    assert len({(r.number, r.master_port, r.members) for r in results}) == 1
    assert results[0].master_addr == f"host-{results[0].members[0].node_id}"


def test_min_nodes_complete_after_the_last_call() -> None:
    world = Stepped(settings(last_call=2.0))
    results = world.rounds([world.handler(n) for n in "ab"])
    assert world.clock.now >= 2.0
    assert [m.node_id for m in results[0].members] in (["a", "b"], ["b", "a"])


def test_expected_nodes_skip_the_last_call(store: FakeStore, pool: ThreadPoolExecutor) -> None:
    config = settings(last_call=30.0)
    results = rounds(pool, [agent(store, n, config, expected_nodes=lambda: 2) for n in "ab"])
    assert results[0].world_size == 2


def test_a_leaving_member_sets_changed_and_ranks_stay(
    store: FakeStore, pool: ThreadPoolExecutor
) -> None:
    agents = {name: agent(store, name) for name in "abc"}
    first = rounds(pool, agents.values())[0]
    rank0 = first.members[0].node_id
    agents.pop(rank0).leave()
    assert all(survivor.changed.is_set() for survivor in agents.values())
    assert not any(survivor.only_arrivals() for survivor in agents.values())
    second = rounds(pool, agents.values())[0]
    assert second.number == first.number + 1
    assert second.members == first.members[1:], "rank 0 moves to the next survivor"
    assert not any(survivor.changed.is_set() for survivor in agents.values()), (
        "changes seen while waiting for a round must not restart the round just returned"
    )


def test_a_late_node_waits_and_the_running_ones_start_the_next_round() -> None:
    world = Stepped(settings())
    a, b, c = world.handler("a"), world.handler("b"), world.handler("c")
    world.rounds([a, b])
    c.begin_round()
    assert c.round_step().round is None
    assert a.changed.is_set()
    assert b.changed.is_set()
    assert a.only_arrivals(), "its workers get the arrival grace"
    assert b.only_arrivals()
    results = world.rounds([a, b, c])
    assert {r.number for r in results} == {2}
    assert results[0].members[2].node_id == "c"
    assert not any(handler.only_arrivals() for handler in (a, b, c)), "reset for the new round"


def test_a_departure_after_an_arrival_takes_the_arrival_grace_back() -> None:
    world = Stepped(settings())
    a, b, c = world.handler("a"), world.handler("b"), world.handler("c")
    world.rounds([a, b])
    c.begin_round()
    c.round_step()
    assert a.only_arrivals()
    b.leave()  # b's workers may be dead: a's ranks can block on them, so no long grace
    assert not a.only_arrivals()


def test_failure_spends_the_budget_once_and_then_fails_the_job(
    store: FakeStore, pool: ThreadPoolExecutor
) -> None:
    config = RendezvousSettings(run_id="job", nodes=NodeRange(2, 2), max_restarts=1)
    a, b = agent(store, "a", config), agent(store, "b", config)
    rounds(pool, [a, b])
    boom = Failure("a", "host-a", 0, 1, None, "boom", 0.0)
    a.report_failure(boom)
    b.report_failure(boom)
    assert b.changed.is_set()
    assert not b.only_arrivals()
    assert rounds(pool, [a, b])[0].restarts_used == 1
    a.report_failure(boom)
    with pytest.raises(JobFailedError, match=r"all 1 restarts are spent.*boom"):
        b.next_round()


def test_below_min_fails_after_min_wait() -> None:
    world = Stepped(settings(min_wait=30.0))
    lonely = world.handler("a")
    with pytest.raises(JobFailedError, match=r"only 1 of the 2 nodes needed joined within 30 s"):
        world.rounds([lonely])
    assert world.clock.now == 30.0


def one_member_finished() -> tuple[Stepped, StoreRendezvous, StoreRendezvous]:
    """Agents a and b in round 1, a's workers done and a waiting at the exit barrier."""
    world = Stepped(settings())
    a, b = world.handler("a"), world.handler("b")
    world.rounds([a, b])
    assert not a.begin_barrier()
    assert a.barrier_step().action is st.Barrier.WAIT
    return world, a, b


def test_success_barrier_closes_the_job_for_late_agents() -> None:
    world, a, b = one_member_finished()
    assert b.report_success()
    assert a.barrier_step().done is True
    assert world.server.closed
    with pytest.raises(RendezvousClosedError):
        world.rounds([world.handler("late")])


def test_a_member_whose_success_comes_after_the_close_is_done_too() -> None:
    """The exit barrier's rule reads a removed state as done; entering the barrier must agree,
    not raise "closed": a local run exited 1 after all its workers succeeded."""
    world, a, b = one_member_finished()
    assert b.report_success()
    assert world.server.closed
    assert a.begin_barrier()


def test_a_node_arriving_once_a_member_succeeded_waits_and_exits_at_the_close() -> None:
    world, a, b = one_member_finished()
    late = world.handler("c")
    late.begin_round()
    step = late.round_step()
    assert step.action is st.Action.FINISHING
    assert step.round is None
    assert not b.changed.is_set(), "the last steps of b must not restart for a newcomer"
    assert b.report_success()
    assert a.barrier_step().done is True
    with pytest.raises(RendezvousClosedError):
        late.round_step()


def test_a_member_lost_during_the_exit_barrier_fails_the_job_after_a_session_timeout() -> None:
    """A member gone before its success was recorded may be a live agent whose session
    expired: it is waited for one session timeout, then the job fails naming it."""
    world, a, b = one_member_finished()
    b.leave()
    waiting = a.barrier_step()
    assert waiting.action is st.Barrier.MEMBER_LOST
    assert waiting.wake_at == pytest.approx(world.clock.now + world.config.session_timeout)
    assert waiting.wake_at is not None
    world.clock.now = waiting.wake_at
    assert a.barrier_step().again
    with pytest.raises(JobFailedError, match="node 'b' left round 1"):
        a.barrier_step()


def test_a_member_whose_session_expired_as_it_finished_comes_back_and_the_job_succeeds() -> None:
    """Its workers finished as its node froze for a moment (or starved on a loaded machine:
    at 1,904 agents one connection missed its heartbeats at the job's end): its session
    expired, and the others' exit barrier failed a job whose every worker succeeded. Back
    within a session timeout, with a new session, it records its success; the job succeeds."""
    world, a, b = one_member_finished()
    store = b._store
    assert isinstance(store, MemoryStore)
    store.expire_session()
    waiting = a.barrier_step()
    assert waiting.action is st.Barrier.MEMBER_LOST
    world.clock.now += world.config.session_timeout / 2
    assert b.report_success()
    assert a.barrier_step().done is True
    assert world.server.closed


class MembershipHook(MemoryStore):
    """A memory store that runs ``before_alive`` once, just before it next reads membership:
    what another node does between two reads of one decision."""

    before_alive: Callable[[], None] | None = None

    def alive(self) -> frozenset[str]:
        hook, self.before_alive = self.before_alive, None
        if hook is not None:
            hook()
        return super().alive()


def test_a_peer_that_succeeds_closes_and_exits_during_the_barriers_reads_is_not_lost() -> None:
    """b's success (the last), its close and its exit land between a's two reads of the
    exit barrier. The barrier must not take b for a node that left unfinished: a local run
    printed "all workers finished" and then exited 1 ("closed; nothing to update")."""
    world = Stepped(settings())
    store = MembershipHook(world.server, "job", world.config.session_timeout)
    node = NodeInfo(node_id="a", host="host-a", nproc=1)
    a = StoreRendezvous(world.config, node, store, clock=world.clock, pick_port=lambda: 1)
    b = world.handler("b")
    world.rounds([a, b])
    assert not a.begin_barrier()

    def b_finishes() -> None:
        assert b.report_success()
        b.leave()

    store.before_alive = b_finishes
    assert a.barrier_step().done is True
    assert store.before_alive is None, "the barrier never read the membership"


def test_session_loss_rejoins_as_a_new_round(store: FakeStore, pool: ThreadPoolExecutor) -> None:
    a, b = agent(store, "a"), agent(store, "b")
    rounds(pool, [a, b])
    store.expire("b")
    assert b.changed.is_set()
    assert a.changed.is_set()
    assert rounds(pool, [a, b])[0].number == 2


def test_close_tells_running_agents(store: FakeStore, pool: ThreadPoolExecutor) -> None:
    a, b = agent(store, "a"), agent(store, "b")
    rounds(pool, [a, b])
    a.close()
    assert b.changed.is_set()
    with pytest.raises(RendezvousClosedError):
        b.next_round()


# --- driven step by step on a simulated clock (no threads, no wall-clock timing) -------------


class Stepped:
    """Handlers on one MemoryServer with a manual clock, driven by their step functions."""

    def __init__(self, config: RendezvousSettings) -> None:
        self.config = config
        self.clock = ManualClock()
        self.server = MemoryServer(clock=self.clock)

    def handler(
        self, name: str, expected_nodes: Callable[[], int | None] | None = None
    ) -> StoreRendezvous:
        store = self.server.connect("job", self.config.session_timeout)
        node = NodeInfo(node_id=name, host=f"host-{name}", nproc=1)
        return StoreRendezvous(
            self.config, node, store, expected_nodes, clock=self.clock, pick_port=lambda: 1
        )

    def rounds(self, handlers: list[StoreRendezvous], limit: float = 600.0) -> list[Round]:
        """Step every handler until each returned a round, moving the clock to the earliest
        wake-up when nobody can act; fails if that takes more than ``limit`` seconds.

        As ``next_round`` does, a handler that a notification woke since its last step
        (its ``generation`` moved) steps again before the clock moves: the proposer hears
        the last member's mark at once, not at its straggler deadline."""
        for handler in handlers:
            handler.begin_round()
        got: dict[str, Round] = {}
        start = self.clock.now
        for _ in range(10_000):
            if len(got) == len(handlers):
                return [got[handler.node.node_id] for handler in handlers]
            wakes = []
            woken = False
            for handler in handlers:
                if handler.node.node_id in got:
                    continue
                generation = handler.generation
                step = handler.round_step()
                while step.again:
                    step = handler.round_step()
                if step.round is not None:
                    got[handler.node.node_id] = step.round
                elif step.wake_at is not None:
                    wakes.append(step.wake_at)
                woken = woken or handler.generation != generation
            if len(got) < len(handlers) and not woken:
                assert wakes, "every handler waits without a deadline"
                self.clock.now = max(self.clock.now, min(wakes))
                assert self.clock.now - start <= limit, "no round within the limit"
        raise AssertionError("the handlers keep waking each other without a round")


def test_a_success_then_a_peer_failure_reruns_instead_of_deadlocking() -> None:
    world = Stepped(RendezvousSettings(run_id="job", nodes=NodeRange(2, 2), max_restarts=3))
    a, b = world.handler("a"), world.handler("b")
    assert [r.number for r in world.rounds([a, b])] == [1, 1]
    assert not a.begin_barrier()
    assert a.barrier_step().action is st.Barrier.WAIT
    b.report_failure(Failure("b", "host-b", 1, 1, None, "boom", 0.0))
    assert a.barrier_step().done is False
    second = world.rounds([a, b])
    assert [r.number for r in second] == [2, 2]
    assert second[0].restarts_used == 1


def test_the_exit_barrier_fails_the_job_naming_a_node_that_never_finishes() -> None:
    config = RendezvousSettings(run_id="job", nodes=NodeRange(2, 2), exit_barrier_timeout=30.0)
    world = Stepped(config)
    a, b = world.handler("a"), world.handler("b")
    world.rounds([a, b])
    assert not a.begin_barrier()
    step = a.barrier_step()
    assert step.wake_at == 30.0
    world.clock.now = 30.0
    assert a.barrier_step().again
    with pytest.raises(JobFailedError, match="node 'b' did not finish round 1 within 30 s"):
        a.barrier_step()


def test_a_live_straggler_that_never_comes_back_is_left_out_after_its_deadline() -> None:
    """b's agent is stuck (its session lives, it never returns to rendezvous): a re-forms
    without it once ``straggler_timeout`` passed, instead of waiting for ever."""
    config = RendezvousSettings(run_id="job", nodes=NodeRange(1, 2), last_call=1.0)
    world = Stepped(config)
    a, b = world.handler("a"), world.handler("b")
    world.rounds([a, b])
    a.report_failure(Failure("a", "host-a", 0, 1, None, "boom", 0.0))
    (second,) = world.rounds([a], limit=st.straggler_timeout(config) + 10)
    assert [m.node_id for m in second.members] == ["a"]
    assert world.clock.now >= st.straggler_timeout(config)
    assert b.changed.is_set()
    third = world.rounds([a, b])
    assert [m.node_id for m in third[0].members] == ["a", "b"], "b is readmitted when back"


def test_the_watch_thread_never_asks_slurm_for_the_expected_nodes(
    store: FakeStore, pool: ThreadPoolExecutor
) -> None:
    callers: set[str] = set()

    def expected() -> int:
        callers.add(threading.current_thread().name)
        return 2

    a = agent(store, "a", expected_nodes=expected)
    first = pool.submit(a.next_round)
    b = agent(store, "b")
    b_round = b.next_round()  # b's writes notify a's handler in this (main) thread
    assert first.result(timeout=10).number == b_round.number
    assert threading.current_thread().name not in callers
    assert len(callers) == 1


class FlakyMembers(FakeStore):
    """A store whose first ``members`` call fails, as a ZooKeeper connection loss does."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 1

    def members(self, node_ids: Iterable[str]) -> list[bytes]:
        if self.failures:
            self.failures -= 1
            raise RendezvousError("ZooKeeper failed an operation (ConnectionLoss).")
        return super().members(node_ids)


def test_a_transient_error_listing_members_is_retried() -> None:
    flaky = FlakyMembers()
    config = RendezvousSettings(run_id="job", nodes=NodeRange(1, 1))
    handler = StoreRendezvous(config, NodeInfo("a", "host-a", 1), flaky)
    assert handler.next_round().number == 1
    assert flaky.failures == 0


def test_a_handler_cut_off_decides_nothing_and_gives_up_after_min_wait() -> None:
    world = Stepped(settings(min_wait=30.0))
    a, b = world.handler("a"), world.handler("b")
    world.rounds([a, b])
    store = a._store
    assert isinstance(store, MemoryStore)
    cut_at = world.clock.now
    store.disconnect()
    assert a.suspended_since() == cut_at
    step = a.round_step()
    assert (step.action, step.round, step.wake_at) == (st.Action.WAIT, None, cut_at + 30.0)
    world.clock.now = cut_at + 30.0
    with pytest.raises(RendezvousError, match="stayed out of reach for 30 s"):
        a.round_step()


def test_a_handler_cut_off_for_the_outage_limit_gives_up_naming_the_store_and_the_bound() -> None:
    world = Stepped(replace(settings(min_wait=30.0), outage_limit=12.0))
    a, b = world.handler("a"), world.handler("b")
    world.rounds([a, b])
    store = a._store
    assert isinstance(store, MemoryStore)
    cut_at = world.clock.now
    store.disconnect()
    step = a.round_step()
    assert (step.action, step.wake_at) == (st.Action.WAIT, cut_at + 12.0), "not min_wait's 30"
    a.check_reach()  # not yet
    world.clock.now = cut_at + 12.0
    sentence = (
        "the in-memory rendezvous stayed out of reach for 12 s (--zk-outage-limit), so this "
        "node leaves job 'job'; check that the ensemble runs and that this node reaches it, "
        "then submit the job again."
    )
    for check in (a.check_reach, a.round_step):
        with pytest.raises(RendezvousUnreachableError) as raised:
            check()
        assert str(raised.value) == sentence
    store.reconnect()
    a.check_reach()  # back: nothing to give up on


def test_a_hot_spare_is_announced_once_per_round_and_joins_when_a_member_is_lost() -> None:
    world = Stepped(RendezvousSettings(run_id="job", nodes=NodeRange(2, 2), session_timeout=2.0))
    a, b, spare = world.handler("a"), world.handler("b"), world.handler("c")
    announced: list[int] = []
    spare.on_spare = announced.append
    world.rounds([a, b])
    spare.begin_round()
    for _ in range(3):
        step = spare.round_step()
        assert step.action is st.Action.WAIT
        assert step.round is None
    assert announced == [1]
    b.leave()  # b's node is gone
    assert a.changed.is_set()
    second = world.rounds([a, spare])
    assert [m.node_id for m in second[0].members] == ["a", "c"]
    assert world.clock.now == 0.0, "no last call, no wait: the spare completes the round"
    assert announced == [1]


def test_a_node_already_waiting_is_woken_once_to_announce_that_it_became_a_spare() -> None:
    """Seen on the cluster: the spare first waited (WAIT) for its own membership to show, and
    the watch found the decision unchanged (WAIT again, now as a spare), so nobody woke it
    and the spare event never came."""
    world = Stepped(RendezvousSettings(run_id="job", nodes=NodeRange(2, 2)))
    a, b, spare = world.handler("a"), world.handler("b"), world.handler("c")
    announced: list[int] = []
    spare.on_spare = announced.append
    world.rounds([a, b])
    spare.begin_round()
    spare._waiting_on = st.Action.WAIT  # as if asleep in _sleep on an earlier WAIT
    generation = spare.generation
    spare._on_change()
    assert spare.generation > generation, "the loop must run to announce the spare"
    assert spare.round_step().action is st.Action.WAIT
    assert announced == [1]
    generation = spare.generation
    spare._on_change()
    assert spare.generation == generation, "announced: nothing new for the sleeping loop"


def test_notes_shared_on_a_topic_are_read_by_node_and_one_answer_is_agreed() -> None:
    """What an agent shares of a hang (agent/hangs.py) reaches every member, keyed by node id,
    and two agents that decided apart on a topic both act on the first answer."""
    server = MemoryServer()
    a, b = (StoreRendezvous(settings(), NodeInfo(name, "h", 1), server.connect()) for name in "ab")
    a.share("hang-2-1.1", b"a saw this")
    assert b.topics("hang-2-") == {"hang-2-1.1"}
    assert b.sharers("hang-2-1.1") == {"a"}
    b.share("hang-2-1.1", b"b saw that")
    assert a.shared("hang-2-1.1") == {"a": b"a saw this", "b": b"b saw that"}
    assert a.agreed("hang-2-1.2") is None
    assert b.agree("hang-2-1.2", b"b's verdict") == b"b's verdict"
    assert a.agreed("hang-2-1.2") == b"b's verdict"
    assert a.agree("hang-2-1.2", b"a's verdict") == b"b's verdict"
    assert a.topics("hang-2-") == {"hang-2-1.1", "hang-2-1.2"}, "agreed counts as a topic"
    assert a.sharers("hang-2-1.2") == frozenset(), "agreed, shared by nobody"
    assert a.shared("hang-2-1.2") == {}
    with pytest.raises(RendezvousError, match="Note topic 'x@y' holds '@'"):
        a.share("x@y", b"")


def test_a_round_never_forms_below_min_from_a_view_that_missed_a_departure() -> None:
    """Found by the simulation (seed 27655): b left during the last call, and a's view, its
    watch still in flight, showed b alive. a completed the round with the members the store
    still had, a alone, for a 2:3 job: a round below MIN. A member missing from the store
    now means a stale view: a waits for its watch and decides again."""
    held: list[Callable[[], None]] = []
    holding: list[MemoryStore] = []

    def deliver(store: MemoryStore, notification: Callable[[], None]) -> None:
        if store in holding:
            held.append(notification)
        else:
            notification()

    clock = ManualClock()
    server = MemoryServer(clock=clock, deliver=deliver)
    config = RendezvousSettings(run_id="job", nodes=NodeRange(2, 3), last_call=2.0)
    a_store = server.connect("job", config.session_timeout)
    a = StoreRendezvous(
        config, NodeInfo("a", "host-a", 1), a_store, clock=clock, pick_port=lambda: 1
    )
    b_store = server.connect("job", config.session_timeout)
    b = StoreRendezvous(
        config, NodeInfo("b", "host-b", 1), b_store, clock=clock, pick_port=lambda: 1
    )
    a.begin_round()
    b.begin_round()
    step = a.round_step()
    while step.again:
        step = a.round_step()
    assert step.action is st.Action.LAST_CALL
    holding.append(a_store)  # a's watches are late from here on
    b.leave()
    clock.now = 2.0
    step = a.round_step()
    while step.again:
        step = a.round_step()
    assert step.round is None
    assert step.wake_at is not None, "a waits for its view to catch up, then decides again"
    state = server.state[0]
    assert state is not None
    assert st.decode(state).state.round == 0, "no round formed without b's place filled"
    holding.clear()
    for notification in held:
        notification()
    assert a.round_step().action is st.Action.BELOW_MIN


def test_a_member_that_wakes_after_the_barrier_failed_the_job_neither_closes_nor_succeeds() -> None:
    """Found by the simulation (seed 498): b froze as its workers finished; its session
    expired and a's exit barrier failed the job ("left round 1"). Awake, b recorded the last
    success and closed the failed job: b and a exited 0 while the node that failed the job
    exited 1. The job stays failed, for b too."""
    world, a, b = one_member_finished()
    store = b._store
    assert isinstance(store, MemoryStore)
    store.expire_session()
    waiting = a.barrier_step()
    assert waiting.wake_at is not None
    world.clock.now = waiting.wake_at  # b is still frozen a session timeout later
    assert a.barrier_step().again
    with pytest.raises(JobFailedError, match="node 'b' left round 1"):
        a.barrier_step()
    assert not b.begin_barrier()
    with pytest.raises(JobFailedError, match="node 'b' left round 1"):
        b.barrier_step()
    assert not world.server.closed


class StateHook(MemoryStore):
    """A memory store that runs ``after_state`` once, just after it next reads the state:
    what another node does between one decision's read and its write."""

    after_state: Callable[[], object] | None = None

    def get_state(self) -> tuple[bytes | None, int]:
        read = super().get_state()
        hook, self.after_state = self.after_state, None
        if hook is not None:
            hook()
        return read


def barrier_with_a_late_peer(names: str) -> tuple[Stepped, StoreRendezvous, StoreRendezvous]:
    """Round 1 of ``names``; a (reading through a ``StateHook``) waits in the exit barrier,
    and b's session has expired while its agent lives on (it still writes the state), a
    session timeout ago: a fails the job at its next step."""
    world = Stepped(RendezvousSettings(run_id="job", nodes=NodeRange(len(names), len(names))))
    store = StateHook(world.server, "job", world.config.session_timeout)
    a = StoreRendezvous(world.config, NodeInfo("a", "host-a", 1), store, clock=world.clock)
    others = [world.handler(name) for name in names[1:]]
    world.rounds([a, *others])
    assert not a.begin_barrier()
    b_store = others[0]._store
    assert isinstance(b_store, MemoryStore)
    b_store.expire_session()
    waiting = a.barrier_step()
    assert waiting.action is st.Barrier.MEMBER_LOST
    assert waiting.wake_at is not None
    world.clock.now = waiting.wake_at  # a waited a session timeout for b
    return world, a, others[0]


def old_fail_barrier(
    self: StoreRendezvous, decision: st.Barrier, state: st.JobState, token: int, summary: str
) -> Step:
    """The exit barrier's failure before the fix: applied to whatever state is newest."""
    self._update(partial(st.fail, summary=summary))
    return Step(decision, again=True)


def test_a_peer_that_closes_the_job_between_the_barriers_read_and_write_is_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """a's barrier read b as gone and unfinished (b's session had expired); before a wrote
    the failure, b recorded the last success and closed the job. Written by compare-and-set
    on the state it read, a's failure is dropped and a decides again: done. Applied to the
    newest state, as before, it found none and raised: "closed; nothing to update", and the
    agent exited 1 after every worker had finished (CI run ci6)."""
    _, a, b = barrier_with_a_late_peer("ab")
    store = a._store
    assert isinstance(store, StateHook)
    store.after_state = b.report_success
    step = a.barrier_step()
    assert step.action is st.Barrier.MEMBER_LOST
    assert store.after_state is None, "b finished between a's read and its write"
    assert a.barrier_step().done is True

    _, a, b = barrier_with_a_late_peer("ab")
    monkeypatch.setattr(StoreRendezvous, "_fail_barrier", old_fail_barrier)
    store = a._store
    assert isinstance(store, StateHook)
    store.after_state = b.report_success
    with pytest.raises(RendezvousClosedError, match=r"closed .*nothing to update"):
        a.barrier_step()


def test_the_exit_barrier_fails_the_job_only_on_the_state_it_decided_from() -> None:
    """The same race with a third member still running: b's success lands between a's read
    and its write, and the job must not fail naming b, which finished."""
    world, a, b = barrier_with_a_late_peer("abc")
    store = a._store
    assert isinstance(store, StateHook)
    store.after_state = b.begin_barrier
    assert a.barrier_step().action is st.Barrier.MEMBER_LOST
    assert a.barrier_step().action is st.Barrier.WAIT, "b finished; c is alive and running"
    state = world.server.state[0]
    assert state is not None
    assert not st.decode(state).state.failed
    assert set(st.decode(state).state.succeeded) == {"a", "b"}


def test_a_job_below_min_beside_a_stuck_member_counts_only_the_nodes_that_can_train() -> None:
    """Found by the simulation's check that a job failed below MIN names fewer than MIN
    nodes (seed 393): b is stuck for good (alive, never back), a waits for it, leaves it out
    once overdue and is then one of the 2 needed. The job failed with "only 2 of the 2 nodes
    needed joined", counting the stuck b that the decision had rightly left out."""
    config = RendezvousSettings(run_id="job", nodes=NodeRange(2, 2), min_wait=30.0)
    world = Stepped(config)
    a, b = world.handler("a"), world.handler("b")
    world.rounds([a, b])
    a.report_failure(Failure("a", "host-a", 0, 1, None, "boom", 0.0))
    with pytest.raises(JobFailedError, match="only 1 of the 2 nodes needed joined within 30 s"):
        world.rounds([a], limit=st.straggler_timeout(config) + config.min_wait + 10)
    assert "b" in world.server.member_ids, "b is alive all along, only stuck"


def test_a_late_report_of_a_round_that_is_over_spends_nothing() -> None:
    """b's failure report comes after a formed round 2 without it (b was stuck past the
    straggler deadline): only the first report of the current round spends a restart, so
    b's report of round 1 changes nothing, round 2's budget included."""
    config = RendezvousSettings(run_id="job", nodes=NodeRange(1, 2), last_call=1.0)
    world = Stepped(config)
    a, b = world.handler("a"), world.handler("b")
    world.rounds([a, b])
    a.report_failure(Failure("a", "host-a", 0, 1, None, "boom", 0.0))
    (second,) = world.rounds([a], limit=st.straggler_timeout(config) + 10)
    assert (second.number, second.restarts_used) == (2, 1)
    before = world.server.state
    b.report_failure(Failure("b", "host-b", 0, 1, None, "late", 0.0))
    assert world.server.state == before


def test_a_member_reported_departed_is_left_out_at_once_while_its_session_lives() -> None:
    """c's agent was killed: its link closed, its session lives on. a reports it; the next
    round forms of a and b without waiting for c as a straggler nor for the last call, and c
    is still a member of the store when it does."""
    config = RendezvousSettings(run_id="job", nodes=NodeRange(1, 3), last_call=1.0)
    world = Stepped(config)
    a, b, c = world.handler("a"), world.handler("b"), world.handler("c")
    world.rounds([a, b, c])
    assert a.report_departed("c", 1)
    assert a.changed.is_set()
    assert b.changed.is_set()
    assert b.peer_lost(), "the survivors' ranks are blocked on c's: no grace for them"
    before = world.clock.now
    second = world.rounds([a, b])
    assert [m.node_id for m in second[0].members] == ["a", "b"]
    # On the simulated clock: only the proposers' stagger (0.1 s a node id) passed, neither
    # the straggler deadline nor the last call.
    assert world.clock.now - before < config.last_call
    assert "c" in world.server.member_ids


def test_a_departed_member_slurm_still_counts_is_not_waited_for_in_the_last_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under Slurm: c's node was killed, its link closed, and Slurm still shows its slot
    running (3 expected). a and b form the next round at once, not after the last call,
    and say that they took c off Slurm's count."""
    config = RendezvousSettings(run_id="job", nodes=NodeRange(2, 3), last_call=30.0)
    world = Stepped(config)
    a, b, c = (world.handler(name, expected_nodes=lambda: 3) for name in "abc")
    world.rounds([a, b, c])
    assert a.report_departed("c", 1)
    caplog.set_level(logging.DEBUG, logger="hpc_elastic.rendezvous.handler")
    before = world.clock.now
    second = world.rounds([a, b])
    assert [m.node_id for m in second[0].members] == ["a", "b"]
    assert world.clock.now - before < config.last_call, "the simulated clock"
    assert "c" in world.server.member_ids
    said = caplog.messages
    assert "a: nodes expected: 3, 2 without the departed ['c']" in said
    assert any(line.endswith("completed round 2 at once") for line in said), said


def test_a_link_of_a_round_that_moved_on_marks_nobody_departed() -> None:
    """b closes its link of round 1 once it holds round 2: that end proves nothing."""
    config = RendezvousSettings(run_id="job", nodes=NodeRange(1, 2), last_call=1.0)
    world = Stepped(config)
    a, b = world.handler("a"), world.handler("b")
    world.rounds([a, b])
    a.report_failure(Failure("a", "host-a", 0, 1, None, "boom", 0.0))
    world.rounds([a, b])
    before = world.server.state
    assert not a.report_departed("b", 1)
    assert world.server.state == before, "not even a write"


def test_after_a_failure_only_the_proposer_reads_the_marks_the_others_await_its_commit() -> None:
    """A restart costs a member that is not the proposer no listing of the others' marks: it
    knows only its own, and waits as for stragglers until the proposer commits."""
    world = Stepped(RendezvousSettings(run_id="job", nodes=NodeRange(3, 3), max_restarts=3))
    handlers = {name: world.handler(name) for name in "abc"}
    first = world.rounds(list(handlers.values()))[0]
    rank0, *others = [handlers[member.node_id] for member in first.members]
    rank0.report_failure(
        Failure(node_id="a", host="h", rank=0, exit_code=1, signal=None, message="boom", time=1.0)
    )
    rank0.begin_round()
    assert rank0.round_step().action is st.Action.MARK_READY
    assert rank0.round_step().action is st.Action.STRAGGLERS, "the others are not back yet"
    for handler in others:
        handler.begin_round()
        assert handler.round_step().action is st.Action.MARK_READY
        # Even the last one back, with every mark written: it reads none but its own.
        assert handler.round_step().action is st.Action.STRAGGLERS
    assert rank0.round_step().action is st.Action.COMPLETE, "the proposer sees every mark"
    second = world.rounds(list(handlers.values()))[0]
    assert second.number == 2
    assert second.members == first.members, "survivors keep their ranks"


def test_a_member_back_on_its_own_ends_the_round_for_those_still_training() -> None:
    """Nothing the others can see ended the round (no failure, nobody gone or arriving): the
    member's mark alone would tell nobody, so it first ends the round in the state."""
    world = Stepped(settings())
    a, b = world.handler("a"), world.handler("b")
    world.rounds([a, b])
    assert not a.changed.is_set()
    b.begin_round()
    assert b.round_step().action is st.Action.MARK_READY
    assert a.changed.is_set(), "a learns from the state that its round is over"


def test_turns_to_complete_a_round_never_bunch_up_past_the_first_fifty_node_ids() -> None:
    """With thousands of nodes, every node beyond the fiftieth once proposed at the capped
    turn together: a stampede of proposals, each fetching every candidate's record."""
    turns = [turn(position, 40) for position in range(4096)]
    assert turns[0] == 0.0
    assert turns[1] == PROPOSER_STAGGER
    assert turns[STAGGERED] == pytest.approx(STAGGERED * PROPOSER_STAGGER)
    assert all(later > earlier for earlier, later in itertools.pairwise(turns))
    assert turns[4095] - turns[4094] == pytest.approx(PROPOSER_STAGGER * SPREAD)


def test_turns_of_a_large_round_are_a_whole_proposal_apart() -> None:
    """At 4,096 candidates, turns 0.1 s apart had dozens of proposers fetch every record at
    once: the next turn waits for as long as one proposal of that many candidates takes."""
    for candidates in (512, 4096, 16384):
        proposal = candidates * PROPOSAL_WORK
        assert turn(1, candidates) == pytest.approx(max(PROPOSER_STAGGER, proposal))
        assert turn(STAGGERED + 10, candidates) - turn(STAGGERED, candidates) >= proposal - 1e-9


def test_past_the_first_fifty_ranks_a_member_back_waits_its_turn_to_end_the_round() -> None:
    """When a member of thousands was lost, every member wrote the round's end at the same
    moment: thousands of compare-and-sets through the quorum, all but one refused. The first
    ranks end it at once; one past them waits its turn, and marks as soon as it is ended."""
    count = STAGGERED + 2
    world = Stepped(RendezvousSettings(run_id="job", nodes=NodeRange(count, count)))
    handlers = {name: world.handler(name) for name in (f"n{index:03d}" for index in range(count))}
    members = world.rounds(list(handlers.values()))[0].members
    rank0, training, last = (handlers[members[rank].node_id] for rank in (0, 1, count - 1))
    last.begin_round()
    waiting = last.round_step()
    assert waiting.action is st.Action.MARK_READY
    assert waiting.wake_at == pytest.approx(world.clock.now + turn(count - STAGGERED, count))
    assert not training.changed.is_set(), "nobody ended the round yet"
    rank0.begin_round()
    assert rank0.round_step().action is st.Action.MARK_READY
    assert training.changed.is_set(), "rank 0 ended the round at once"
    assert last.round_step().action is st.Action.MARK_READY
    assert last.round_step().action is st.Action.STRAGGLERS, "marked back, without a turn"


def round_of_marks() -> tuple[Stepped, list[StoreRendezvous]]:
    """A round of ``SUCCESSES_IN_STATE + 2`` members, which records its successes but the
    first as ``Mark.DONE`` marks, and its handlers in rank order (rank 0 is its proposer)."""
    count = SUCCESSES_IN_STATE + 2
    world = Stepped(RendezvousSettings(run_id="job", nodes=NodeRange(count, count)))
    handlers = {name: world.handler(name) for name in (f"n{index:03d}" for index in range(count))}
    members = world.rounds(list(handlers.values()))[0].members
    return world, [handlers[member.node_id] for member in members]


def stored_state(world: Stepped) -> st.JobState | None:
    """The job's state on the server; None once the job is closed."""
    return world.handler("reader").snapshot()


def test_past_fifty_members_one_success_is_in_the_state_and_the_proposer_closes_on_the_marks() -> (
    None
):
    """At a job's end every member finishes at about the same step: in a round this large only
    the first success is a compare-and-set of the state, which every member would race; the
    others are marks, and the proposer closes the job once every member's mark is there. The
    others wait for the close: leaving first, they could look lost to the closer."""
    world, ranked = round_of_marks()
    proposer, others = ranked[0], ranked[1:]
    assert not any(handler.begin_barrier() for handler in others)
    state = stored_state(world)
    assert state is not None
    assert state.succeeded == (others[0].node.node_id,)
    assert all(handler.barrier_step().action is st.Barrier.WAIT for handler in others)
    assert not proposer.begin_barrier()
    assert proposer.barrier_step().done is True
    assert world.server.closed
    assert all(handler.barrier_step().done is True for handler in others)


def test_past_fifty_members_a_closer_gone_before_closing_is_replaced_by_the_next_ranked() -> None:
    """The proposer finished and its node died before it closed: the others, who follow only
    their own marks, see a member gone, read every mark from the server before failing the
    job, and the next member present closes it."""
    world, ranked = round_of_marks()
    proposer, successor, others = ranked[0], ranked[1], ranked[2:]
    assert not any(handler.begin_barrier() for handler in [*ranked[1:], proposer])
    proposer.leave()  # its success a mark, not the one in the state
    assert all(handler.barrier_step().action is st.Barrier.WAIT for handler in others)
    assert successor.barrier_step().done is True
    assert world.server.closed, "the job failed or nobody closed it"
    assert stored_state(world) is None
    assert all(handler.barrier_step().done is True for handler in others)


def test_past_fifty_members_a_member_lost_before_finishing_fails_the_job() -> None:
    """Marks count only the members that finished: one that left before is lost."""
    world, ranked = round_of_marks()
    proposer, lost = ranked[0], ranked[-1]
    assert not any(handler.begin_barrier() for handler in ranked[:-1])
    lost.leave()
    waiting = proposer.barrier_step()
    assert waiting.action is st.Barrier.MEMBER_LOST
    assert waiting.wake_at is not None
    world.clock.now = waiting.wake_at
    assert proposer.barrier_step().again
    with pytest.raises(JobFailedError, match=f"node '{lost.node.node_id}' left round 1"):
        proposer.barrier_step()
    assert not world.server.closed


class CountedWrites(StateHook):
    """A ``StateHook`` that counts the writes of the state made through it."""

    writes = 0

    def set_state(self, data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        self.writes += 1
        return super().set_state(data, token)


def test_past_the_first_fifty_ranks_a_finished_member_waits_for_the_first_success_not_racing() -> (
    None
):
    """At a job's end every member finishes at about the same step and finds no success in
    the state yet. Each once wrote it by compare-and-set, and all but one were refused: the
    first ranks race for it, and one past them waits its turn and marks once it is there."""
    count = SUCCESSES_IN_STATE + 2
    world = Stepped(RendezvousSettings(run_id="job", nodes=NodeRange(count, count)))
    store = CountedWrites(world.server, "job", world.config.session_timeout)
    names = [f"n{index:03d}" for index in range(count)]
    late = StoreRendezvous(
        world.config, NodeInfo(names[-1], "host", 1), store, clock=world.clock, pick_port=lambda: 1
    )
    handlers = [*(world.handler(name) for name in names[:-1]), late]
    members = world.rounds(handlers)[0].members
    assert [member.node_id for member in members].index(late.node.node_id) >= STAGGERED
    first = next(handler for handler in handlers if handler.node.node_id == members[0].node_id)
    before = store.writes
    store.after_state = first.begin_barrier  # its success lands after late read the state
    assert not late.begin_barrier()
    assert store.writes == before, "a member past the first fifty ranks raced for the success"
    state = stored_state(world)
    assert state is not None
    assert state.succeeded == (first.node.node_id,)
    marks = world.server.connect("job").marks(Mark.DONE, state.round)
    assert late.node.node_id in marks


def test_a_restart_is_committed_with_its_rank_zeros_port_in_one_write() -> None:
    """After a worker failure the proposer of the next round is its rank 0 (survivors keep
    their order), and it commits the round with its master port: the failure and the commit
    are the state's only writes, and nobody waits for a port."""
    world = Stepped(RendezvousSettings(run_id="job", nodes=NodeRange(3, 3)))
    handlers = [world.handler(name) for name in "abc"]
    first = world.rounds(handlers)[0]
    reader = world.server.connect("job")
    before = reader.get_state()[1]
    handlers[-1].report_failure(Failure("c", "host-c", 2, 1, None, "boom", 0.0))
    again = world.rounds(handlers)
    assert {got.number for got in again} == {2}
    assert all(got.members == first.members for got in again), "the ranks moved"
    assert {got.master_port for got in again} == {1}
    writes = reader.get_state()[1] - before
    assert writes == 2, f"{writes} writes of the state for one restart (the port apart?)"
