"""A round of 512 agents on a real ZooKeeper, and a restart of them: their invariants, never
their time.

The agents are the real ``StoreRendezvous`` handlers, 16 to a ZooKeeper connection, in this
process: the layout, the watches and the compare-and-set of a large round are exercised end to
end. How long a round takes is measured by ``bench/rendezvous_scale.py``, never asserted here.

No Slurm is needed, so this is not a cluster test: like the store contract's ZooKeeper tests it
runs on the module's own server (``private_zookeeper``), fails in CI and skips elsewhere when
ZooKeeper is not installed.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from functools import partial

import pytest
from cluster import wait_until
from kazoo.client import KazooClient
from test_rendezvous_zookeeper import expire

from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import Failure, NodeInfo, RendezvousSettings, Round
from hpc_elastic.rendezvous.backend import Mark
from hpc_elastic.rendezvous.deadlines import Deadlines
from hpc_elastic.rendezvous.handler import STAGGERED, StoreRendezvous
from hpc_elastic.rendezvous.zookeeper import ZooKeeperAddress, ZooKeeperStore, open_client
from hpc_elastic.spec import NodeRange

AGENTS = 512
SHARE = 16
"""Agents a ZooKeeper connection, as the bench shares sessions where they do not fit."""
SESSION = 20.0
"""Long, so that a loaded machine never expires a session: the test is about the round."""
DEADLINE = 240.0
"""Seconds the round may take before the test says so; a quiet machine needs a few."""
RUN = "scale"


@pytest.fixture
def address(private_zookeeper: str) -> ZooKeeperAddress:
    """The module's server under a fresh chroot."""
    return ZooKeeperAddress.parse(f"{private_zookeeper}/scale-{uuid.uuid4().hex}")


@dataclass
class Crowd:
    agents: list[StoreRendezvous]
    stores: list[ZooKeeperStore]
    clients: list[KazooClient]


@pytest.fixture
def crowd(address: ZooKeeperAddress) -> Iterator[Crowd]:
    """``AGENTS`` handlers over connections of their own, each ``SHARE`` agents; every agent
    leaves and every connection is released afterwards."""
    settings = RendezvousSettings(
        run_id=RUN, nodes=NodeRange(AGENTS, AGENTS), session_timeout=SESSION
    )
    clients = [open_client(address, None, SESSION) for _ in range(AGENTS // SHARE)]
    stores = [ZooKeeperStore(client, address, RUN, None) for client in clients]
    agents = [
        StoreRendezvous(
            settings,
            NodeInfo(f"agent-{index:03d}", "127.0.0.1", 1),
            stores[index // SHARE],
            owns_store=False,
        )
        for index in range(AGENTS)
    ]
    yield Crowd(agents, stores, clients)
    for agent in agents:
        agent.leave()
    for store in stores:
        store.release()


def state_version(address: ZooKeeperAddress) -> int:
    """How many times the job's state was written since its creation (its znode version),
    read from the server itself."""
    client = open_client(address, None, SESSION)
    try:
        _, stat = client.get(f"{address.job_path(RUN)}/state")
        return int(stat.version)
    finally:
        client.stop()
        client.close()


def document_and_tables(address: ZooKeeperAddress, round_number: int) -> tuple[bytes, set[str]]:
    """The job's state as the server holds it, and the names of round ``round_number``'s
    tables (``Store.put_table``)."""
    client = open_client(address, None, SESSION)
    try:
        data, _ = client.get(f"{address.job_path(RUN)}/state")
        return data, set(client.get_children(f"{address.job_path(RUN)}/rounds/{round_number}"))
    finally:
        client.stop()
        client.close()


DOCUMENT_BYTES = 1024
"""What the state may weigh whatever the job's size: its members are in their table."""


def marked_back(address: ZooKeeperAddress, round_number: int) -> set[str]:
    """The nodes marked back from ``round_number`` (``Mark.BACK``), listed on the server."""
    client = open_client(address, None, SESSION)
    try:
        path = f"{address.job_path(RUN)}/{Mark.BACK.value}/{round_number}"
        return set(client.get_children(path))
    finally:
        client.stop()
        client.close()


@pytest.mark.timeout(DEADLINE + 60)
def test_a_round_of_512_agents_ranks_every_member_once_in_one_commit(
    address: ZooKeeperAddress, crowd: Crowd, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = crowd.agents
    ports = itertools.count(20_000)  # every port picked is told apart from the others
    for agent in agents:
        agent.pick_master_port = partial(next, ports)
    proposed: set[int] = set()  # the ports a proposer that is rank 0 put into its proposal
    with_own_port = StoreRendezvous._with_own_port

    def noting_proposals(agent: StoreRendezvous, new: st.JobState) -> st.JobState:
        proposal = with_own_port(agent, new)
        if proposal.master_port is not None:
            proposed.add(proposal.master_port)
        return proposal

    monkeypatch.setattr(StoreRendezvous, "_with_own_port", noting_proposals)
    with ThreadPoolExecutor(len(agents)) as pool:
        futures = [pool.submit(agent.next_round) for agent in agents]
        rounds: list[Round] = [future.result(timeout=DEADLINE) for future in futures]

    first = rounds[0]
    assert {got.number for got in rounds} == {1}
    assert all(got == first for got in rounds), "agents hold different rounds"
    ids = [agent.node.node_id for agent in agents]
    assert sorted(member.node_id for member in first.members) == sorted(ids)
    held = list(zip(agents, rounds, strict=True))
    ranks = sorted(got.group_rank(agent.node.node_id) for agent, got in held)
    assert ranks == list(range(AGENTS)), "a rank is missing or held twice"
    global_ranks = sorted(got.first_rank(agent.node.node_id) for agent, got in held)
    assert global_ranks == list(range(first.world_size)), "global ranks are not contiguous"
    assert first.world_size == AGENTS

    # Written once when created, then the round's commit, and rank 0's port, unless rank 0
    # proposed the round and committed it with its port (the port is then one it proposed).
    # Counted on the server: a proposer that lost its compare-and-set to identical bytes logs
    # "completed round" too (its write counts as won, as a retry's would). A connection cut
    # off and back reads the state again (``refresh_state``) and writes nothing.
    stored = agents[0].snapshot()
    assert stored is not None
    expected = 1 if stored.master_port in proposed else 2
    writes = state_version(address)
    assert writes == expected, f"{writes} writes of the state: round 1 committed more than once"
    assert stored.round == 1
    assert stored.to_round() == first, "the stored round is not the one the agents hold"
    assert not st.round_over(stored)
    document, tables = document_and_tables(address, 1)
    assert len(document) < DOCUMENT_BYTES, f"a state of {len(document)} bytes for 512 members"
    assert tables == {st.table_name(first.members)}, "the round has one table, its members'"


@pytest.mark.timeout(2 * DEADLINE + 60)
def test_a_restart_of_512_agents_marks_each_back_once_and_commits_once(
    address: ZooKeeperAddress, crowd: Crowd
) -> None:
    """After a worker failure every member marks itself back (a znode of its own, racing
    nobody) and the proposer, rank 0, commits the next round with the same ranks and its
    master port: two writes of the state in all (the failure, the commit), whatever N."""
    agents = crowd.agents
    with ThreadPoolExecutor(len(agents)) as pool:
        first = [f.result(timeout=DEADLINE) for f in [pool.submit(a.next_round) for a in agents]]
        before = state_version(address)
        agents[-1].report_failure(
            Failure(
                node_id=agents[-1].node.node_id,
                host="127.0.0.1",
                rank=AGENTS - 1,
                exit_code=1,
                signal=None,
                message="planted",
                time=0.0,
            )
        )
        assert all(agent.changed.wait(DEADLINE) for agent in agents), "a member never heard"
        again = [f.result(timeout=DEADLINE) for f in [pool.submit(a.next_round) for a in agents]]

    assert {got.number for got in again} == {2}
    assert all(got.members == first[0].members for got in again), "the ranks moved"
    writes = state_version(address) - before
    assert writes == 2, f"{writes} writes of the state for one restart"
    back = marked_back(address, 1)
    assert back == {agent.node.node_id for agent in agents}, "a member is not marked back"
    stored = agents[0].snapshot()
    assert stored is not None
    assert stored.restarts_used == 1
    document, tables = document_and_tables(address, 2)
    assert len(document) < DOCUMENT_BYTES, f"a state of {len(document)} bytes for 512 members"
    assert tables == {st.table_name(first[0].members)}, "the same ranks, the same table"


@pytest.mark.timeout(2 * DEADLINE + 60)
def test_a_job_end_of_512_agents_lets_each_out_and_closes_without_a_race_of_every_member(
    address: ZooKeeperAddress, crowd: Crowd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a job's end every member's workers succeed at about the same step. In a round this
    large only the first success is a compare-and-set of the state; each other one is a mark
    of its own, not a compare-and-set that every member races (those grew as N an agent: 52
    attempts at 496 agents), and the round's proposer closes the job once every member's mark
    is there."""
    agents = crowd.agents
    attempts: list[int] = []
    with ThreadPoolExecutor(len(agents)) as pool:
        for future in [pool.submit(agent.next_round) for agent in agents]:
            future.result(timeout=DEADLINE)
        for store in crowd.stores:
            monkeypatch.setattr(store, "set_state", counted(store.set_state, attempts))
        outcomes = [
            f.result(timeout=DEADLINE) for f in [pool.submit(a.report_success) for a in agents]
        ]

    assert all(outcomes), "an agent was let out of the exit barrier without the job succeeding"
    assert crowd.stores[0].is_closed(), "nobody closed the job"
    # The first ranks race for the first success (none is there yet when they finish), and
    # a mark refused because that success moved the state reads it with one lost write: two
    # attempts each of them, and the close; the ranks past them mark once it is there. Were
    # every member to race for it, up to 2N + 1; were every success a compare-and-set,
    # N·(N+1)/2.
    assert len(attempts) <= 2 * STAGGERED + 1, f"{len(attempts)} writes of the state"


def counted(
    call: Callable[[bytes, int], tuple[bytes | None, int, bool]], calls: list[int]
) -> Callable[[bytes, int], tuple[bytes | None, int, bool]]:
    """``call``, each call of it appended to ``calls``."""

    def counting(data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        calls.append(token)
        return call(data, token)

    return counting


@pytest.mark.timeout(2 * DEADLINE + 60)
def test_a_member_that_finished_and_then_left_does_not_fail_the_job_of_512_agents(
    address: ZooKeeperAddress, crowd: Crowd
) -> None:
    """Only the round's proposer follows the successes marked in a large round: any other
    agent that sees a member gone reads the marks from the server before failing the job, and
    a member that finished before its node died has its mark there."""
    agents = crowd.agents
    first, leaver = agents[300], agents[100]
    with ThreadPoolExecutor(len(agents)) as pool:
        for future in [pool.submit(agent.next_round) for agent in agents]:
            future.result(timeout=DEADLINE)
        waiting = [pool.submit(first.report_success)]  # the first success goes into the state
        assert wait_until(lambda: first_success(address) == (first.node.node_id,), DEADLINE)
        # A later one is a mark. The leaver's node dies in the barrier: its thread is left
        # behind (a daemon), not waited for, as no process of a dead node is.
        threading.Thread(target=partial(dies_waiting, leaver), daemon=True).start()
        done = f"{address.job_path(RUN)}/{Mark.DONE.value}/1/{leaver.node.node_id}"
        assert wait_until(lambda: exists(address, done), DEADLINE), (
            "the leaver's success was not marked"
        )
        leaver.leave()
        rest = [a for a in agents if a not in (first, leaver)]
        outcomes = [
            f.result(timeout=DEADLINE) for f in [pool.submit(a.report_success) for a in rest]
        ]
        assert all(future.result(timeout=DEADLINE) for future in waiting)

    assert all(outcomes), "the job failed for a member that had finished"
    assert crowd.stores[0].is_closed(), "nobody closed the job"


def first_success(address: ZooKeeperAddress) -> tuple[str, ...]:
    """The successes the job's state holds, read on the server."""
    data, _ = document_and_tables(address, 1)
    return tuple(st.decode(data).state.succeeded)


def exists(address: ZooKeeperAddress, path: str) -> bool:
    client = open_client(address, None, SESSION)
    try:
        return client.exists(path) is not None
    finally:
        client.stop()
        client.close()


def dies_waiting(agent: StoreRendezvous) -> None:
    """``agent`` reports its success and waits in the exit barrier until its node is gone."""
    with suppress(Exception):
        agent.report_success()


class NodeDied(Exception):
    """What a closer's thread raises in the test below, once its node is gone."""


@pytest.mark.timeout(2 * DEADLINE + 60)
def test_a_closer_that_dies_before_closing_a_job_of_512_agents_is_replaced_by_the_next(
    address: ZooKeeperAddress, crowd: Crowd
) -> None:
    """In a round whose successes are marks, the round's proposer closes the job and every
    other agent waits for the close. If the proposer's node dies in that moment, after every
    mark is there and before the close, the next lowest-ranked member present closes it, and
    every other agent is let out with the job succeeded, not failed for a member lost."""
    agents = crowd.agents
    closers: list[str] = []
    lock = threading.Lock()

    def closing(agent: StoreRendezvous, close: Callable[[], None]) -> None:
        with lock:
            closers.append(agent.node.node_id)
            dies = len(closers) == 1
        if not dies:
            close()
            return
        agent.leave()
        raise NodeDied(agent.node.node_id)

    for agent in agents:
        agent.close = partial(closing, agent, agent.close)  # type: ignore[method-assign]
    with ThreadPoolExecutor(len(agents)) as pool:
        for future in [pool.submit(agent.next_round) for agent in agents]:
            future.result(timeout=DEADLINE)
        finishing = {pool.submit(agent.report_success): agent for agent in agents}
        outcomes: dict[str, bool] = {}
        died: list[str] = []
        for finished, agent in finishing.items():
            try:
                outcomes[agent.node.node_id] = finished.result(timeout=DEADLINE)
            except NodeDied:
                died.append(agent.node.node_id)

    assert died == closers[:1], f"closers {closers}, died {died}"
    assert len(closers) == 2, f"the job was closed by {closers[1:]} after {closers[0]} died"
    assert all(outcomes.values()), "an agent was let out without the job succeeding"
    assert len(outcomes) == AGENTS - 1
    assert crowd.stores[0].is_closed(), "nobody closed the job"


@pytest.mark.timeout(2 * DEADLINE + 60)
def test_a_session_that_expired_as_its_agents_finished_does_not_fail_the_job_of_512_agents(
    address: ZooKeeperAddress, crowd: Crowd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a job's end on a saturated machine, a connection missed its heartbeats and its
    session expired as its agents' workers finished: every other agent's exit barrier saw
    those members gone before their successes were recorded and failed a job whose every
    worker had succeeded. The barrier waits a session timeout for them, and, back with a new
    session, they record their successes and the job closes."""
    agents = crowd.agents
    theirs = agents[5 * SHARE : 6 * SHARE]
    seen_gone = threading.Event()
    member_gone = Deadlines.member_gone

    def gone(self: Deadlines, round_: int, now: float) -> float | None:
        seen_gone.set()
        return member_gone(self, round_, now)

    monkeypatch.setattr(Deadlines, "member_gone", gone)
    with ThreadPoolExecutor(len(agents)) as pool:
        for future in [pool.submit(agent.next_round) for agent in agents]:
            future.result(timeout=DEADLINE)
        waiting = [pool.submit(agent.report_success) for agent in agents if agent not in theirs]
        expire(crowd.clients[5], address)
        assert seen_gone.wait(DEADLINE), "no agent saw the members of the expired session gone"
        back = [pool.submit(agent.report_success) for agent in theirs]
        outcomes = [future.result(timeout=DEADLINE) for future in waiting + back]

    assert all(outcomes), "an agent was let out without the job succeeding"
    assert crowd.stores[0].is_closed(), "nobody closed the job"
