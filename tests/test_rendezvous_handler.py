"""The rendezvous state machine on an in-memory Store (unit tests; the real one is ZooKeeper)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from hpc_elastic.errors import RendezvousClosedError
from hpc_elastic.rendezvous.api import Failure, JobFailedError, NodeInfo, RendezvousSettings, Round
from hpc_elastic.rendezvous.backend import ABSENT, Store
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.spec import NodeRange


class FakeStore(Store):
    """Everything a ZooKeeper store does, in one process, notifying synchronously."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._state: tuple[bytes | None, int] = (None, ABSENT)
        self._members: dict[str, bytes] = {}
        self._closed = False
        self._subscribers: dict[Callable[[], None], Callable[[], None]] = {}

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

    def is_closed(self) -> bool:
        return self._closed

    def close_job(self) -> None:
        with self._lock:
            self._closed = True
            self._state = (None, ABSENT)
            self._members.clear()
        self._notify()

    def release(self) -> None:
        """Nothing to release in memory."""

    def expire(self, node_id: str) -> None:
        """What a ZooKeeper session expiry does: the membership vanishes, the owner is told."""
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
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as executor:
        yield executor


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


def test_max_nodes_complete_at_once(store: FakeStore, pool: ThreadPoolExecutor) -> None:
    agents = [agent(store, n) for n in "abc"]
    started = time.monotonic()
    results = rounds(pool, agents)
    assert time.monotonic() - started < 0.2, "no last call when MAX are present"
    assert len({(r.number, r.master_port, r.members) for r in results}) == 1
    assert results[0].master_addr == f"host-{results[0].members[0].node_id}"


def test_min_nodes_complete_after_the_last_call(store: FakeStore, pool: ThreadPoolExecutor) -> None:
    started = time.monotonic()
    results = rounds(pool, [agent(store, n) for n in "ab"])
    assert time.monotonic() - started >= 0.2
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
    second = rounds(pool, agents.values())[0]
    assert second.number == first.number + 1
    assert second.members == first.members[1:], "rank 0 moves to the next survivor"
    assert not any(survivor.changed.is_set() for survivor in agents.values()), (
        "changes seen while waiting for a round must not restart the round just returned"
    )


def test_a_late_node_waits_and_the_running_ones_start_the_next_round(
    store: FakeStore, pool: ThreadPoolExecutor
) -> None:
    a, b = agent(store, "a"), agent(store, "b")
    rounds(pool, [a, b])
    late = pool.submit(agent(store, "c").next_round)
    time.sleep(0.05)
    assert a.changed.is_set()
    assert b.changed.is_set()
    results = [*rounds(pool, [a, b]), late.result(timeout=10)]
    assert {r.number for r in results} == {2}
    assert results[0].members[2].node_id == "c"


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
    assert rounds(pool, [a, b])[0].restarts_used == 1
    a.report_failure(boom)
    with pytest.raises(JobFailedError, match=r"all 1 restarts are spent.*boom"):
        b.next_round()


def test_below_min_fails_after_min_wait(store: FakeStore) -> None:
    lonely = agent(store, "a", settings(min_wait=0.2))
    with pytest.raises(JobFailedError, match=r"only 1 of the 2 nodes needed joined within 0\.2 s"):
        lonely.next_round()


def one_member_finished(
    store: FakeStore, pool: ThreadPoolExecutor
) -> tuple[StoreRendezvous, Future[None]]:
    """Agents a and b in round 1, a's workers done and a waiting at the exit barrier; returns b."""
    a, b = agent(store, "a"), agent(store, "b")
    rounds(pool, [a, b])
    waiting = pool.submit(a.report_success)
    time.sleep(0.05)
    return b, waiting


def test_success_barrier_closes_the_job_for_late_agents(
    store: FakeStore, pool: ThreadPoolExecutor
) -> None:
    b, waiting = one_member_finished(store, pool)
    assert not waiting.done()
    b.report_success()
    waiting.result(timeout=5)
    assert store.is_closed()
    with pytest.raises(RendezvousClosedError):
        agent(store, "late").next_round()


def test_a_node_arriving_once_a_member_succeeded_waits_and_exits_at_the_close(
    store: FakeStore, pool: ThreadPoolExecutor
) -> None:
    b, waiting = one_member_finished(store, pool)
    late = pool.submit(agent(store, "c").next_round)
    time.sleep(0.05)
    assert not b.changed.is_set(), "the last steps of b must not restart for a newcomer"
    assert not late.done()
    b.report_success()
    waiting.result(timeout=5)
    with pytest.raises(RendezvousClosedError):
        late.result(timeout=5)


def test_a_member_lost_during_the_exit_barrier_fails_the_job(
    store: FakeStore, pool: ThreadPoolExecutor
) -> None:
    b, waiting = one_member_finished(store, pool)
    b.leave()
    with pytest.raises(JobFailedError, match="node 'b' left round 1"):
        waiting.result(timeout=5)


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
