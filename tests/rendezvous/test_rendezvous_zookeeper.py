"""The rendezvous on the real ZooKeeper: rounds, ACLs, closing and faults.

Each test runs under a fresh chroot (``zk_root``), so tests never see each other's jobs.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from cluster import REPO, Cluster, wait_until
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NoAuthError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.security import ACL, OPEN_ACL_UNSAFE, make_digest_acl
from lifeline import while_parent_lives

from hpc_elastic.agent.badnodes import Cleared, clear, listing, remembered
from hpc_elastic.errors import (
    RendezvousAccessError,
    RendezvousClosedError,
    RendezvousError,
    UsageError,
)
from hpc_elastic.rendezvous import testing
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings, Round
from hpc_elastic.rendezvous.backend import ABSENT
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.state import JobState as State
from hpc_elastic.rendezvous.state import encode, encode_node
from hpc_elastic.rendezvous.zookeeper import (
    ZooKeeperAddress,
    ZooKeeperStore,
    bad_node_book,
    close_job,
    connect,
    describe_job,
    open_client,
    poll_select,
    probe,
    remember_bad_node,
)
from hpc_elastic.spec import NodeRange

integration = pytest.mark.integration
"""The tests on the shared Slurm + ZooKeeper cluster; the attacks run on a private server."""

SECRET = "s3cret"
SESSION = 2.0
DEADLINE = 30.0
"""Seconds to wait for an event that a working rendezvous delivers in about SESSION."""


def settings(nodes: str = "2:3", run_id: str = "job") -> RendezvousSettings:
    return RendezvousSettings(
        run_id=run_id, nodes=NodeRange.parse(nodes), last_call=0.3, session_timeout=SESSION
    )


@pytest.fixture
def zk(cluster: Cluster, zk_root: str) -> Iterator[str]:
    """The test's chroot; emptied with the secret, since ``zk_root``'s cleanup has none."""
    yield cluster.zk_hosts + zk_root
    client = open_client(ZooKeeperAddress.parse(cluster.zk_hosts), SECRET, session_timeout=5)
    try:
        client.delete(zk_root, recursive=True)
    finally:
        client.stop()
        client.close()


@pytest.fixture(autouse=True)
def rendezvous_story(caplog: pytest.LogCaptureFixture) -> None:
    """Every transition of the handlers and stores, shown with a failure: a round that does
    not form is then told step by step (they log each one at DEBUG)."""
    caplog.set_level(logging.DEBUG, logger="hpc_elastic.rendezvous")


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as executor:
        yield executor


@pytest.fixture
def agents(zk: str, pool: ThreadPoolExecutor) -> Iterator[list[StoreRendezvous]]:
    """Three agents with their own connections; they leave after the test, before ``pool``
    waits for what they still run (a round that never formed waits for them to go)."""
    made = [
        connect(zk, settings(), NodeInfo(name, "127.0.0.1", 1), secret=SECRET) for name in "abc"
    ]
    yield made
    for agent in made:
        agent.leave()


def wait_for_member(zk: str, node_id: str) -> None:
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, SECRET, session_timeout=5)
    try:
        member = f"{address.job_path('job')}/members/{node_id}"
        deadline = time.monotonic() + DEADLINE
        while client.exists(member) is None:
            assert time.monotonic() < deadline, f"{node_id} never joined"
            time.sleep(0.05)
    finally:
        client.stop()
        client.close()


def rounds(pool: ThreadPoolExecutor, agents: list[StoreRendezvous]) -> list[Round]:
    futures: list[Future[Round]] = [pool.submit(agent.next_round) for agent in agents]
    return [future.result(timeout=30) for future in futures]


@integration
def test_agents_agree_on_a_round_and_see_a_clean_exit(
    agents: list[StoreRendezvous], pool: ThreadPoolExecutor
) -> None:
    """How fast a clean exit is seen is measured in bench/ (docs/benchmarks.md)."""
    first = rounds(pool, agents)
    assert len({(r.number, r.members, r.master_port) for r in first}) == 1
    leaver = next(a for a in agents if a.node.node_id == first[0].members[1].node_id)
    survivors = [a for a in agents if a is not leaver]
    leaver.leave()
    assert all(a.changed.wait(DEADLINE) for a in survivors)
    agents.remove(leaver)
    second = rounds(pool, survivors)[0]
    assert second.number == 2
    assert second.members[0] == first[0].members[0], "rank 0 stays on its node"


@integration
def test_a_client_without_the_secret_is_refused(
    zk: str, agents: list[StoreRendezvous], pool: ThreadPoolExecutor
) -> None:
    rounds(pool, agents)
    with pytest.raises(RendezvousError, match="refused access to job 'job'"):
        connect(zk, settings(), NodeInfo("intruder", "127.0.0.1", 1), secret="wrong")
    address = ZooKeeperAddress.parse(zk)
    anonymous = KazooClient(hosts=address.hosts)
    anonymous.start(timeout=10)
    try:
        with pytest.raises(NoAuthError):
            anonymous.get(address.job_path("job") + "/state")
        with pytest.raises(NoAuthError):
            anonymous.create(address.job_path("job") + "/members/intruder", ephemeral=True)
    finally:
        anonymous.stop()
        anonymous.close()


@integration
def test_closing_leaves_only_a_tombstone_and_late_agents_exit_cleanly(
    zk: str, agents: list[StoreRendezvous], pool: ThreadPoolExecutor
) -> None:
    rounds(pool, agents)
    snapshot = describe_job(zk, "job", SECRET)
    assert snapshot is not None
    assert snapshot.round == 1
    close_job(zk, "job", SECRET)
    assert all(agent.changed.wait(2.0) for agent in agents)
    with pytest.raises(RendezvousClosedError):
        agents[0].next_round()
    late = connect(zk, settings(), NodeInfo("late", "127.0.0.1", 1), secret=SECRET)
    try:
        with pytest.raises(RendezvousClosedError):
            late.next_round()
    finally:
        late.leave()
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, SECRET, session_timeout=5)
    try:
        assert client.get_children(address.job_path("job")) == ["closed"]
    finally:
        client.stop()
        client.close()


AGENT = """
import sys, time
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.zookeeper import connect
from hpc_elastic.spec import NodeRange
settings = RendezvousSettings(run_id="job", nodes=NodeRange(2, 3), last_call=0.3,
                              session_timeout=float(sys.argv[2]))
agent = connect(sys.argv[1], settings, NodeInfo("victim", "127.0.0.1", 1), secret="s3cret")
print(agent.next_round().number, flush=True)
""" + while_parent_lives("time.sleep(0.1)")
"""Stays a member until the test SIGKILLs it (or the test's own process is gone)."""


@integration
def test_a_sigkilled_agent_is_noticed_within_the_session_timeout(
    zk: str, agents: list[StoreRendezvous], pool: ThreadPoolExecutor
) -> None:
    """How fast is measured in bench/ (docs/benchmarks.md); this shows that it is noticed."""
    survivors = agents[:2]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    victim = subprocess.Popen(
        [sys.executable, "-c", AGENT, zk, str(SESSION)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        # The survivors' last call is 0.3 s: start them only once the victim is a member
        # (a new Python process can take longer than that to get there).
        wait_for_member(zk, "victim")
        first = rounds(pool, survivors)[0]
        assert first.world_size == 3
        assert victim.stdout is not None
        # The victim is in the survivors' round. Its number is not always 1: a round of two
        # may form (and be superseded) before the second survivor's thread gets to join.
        assert victim.stdout.readline().strip() == str(first.number)
        victim.send_signal(signal.SIGKILL)
        assert all(agent.changed.wait(DEADLINE) for agent in survivors)
    finally:
        victim.kill()
        victim.wait()
    assert rounds(pool, survivors)[0].world_size == 2


def expire(client: KazooClient, address: ZooKeeperAddress) -> None:
    """End ``client``'s session on the server, as an expiry does: a thief connects with the
    session's id and password and closes it, and ``client`` learns at its next connect that the
    session is gone (LOST). Each connect takes the session from the other client, so when
    ``client`` reconnects first (a loaded machine), the thief's connect fails; it tries again
    until ``client`` has heard of the loss."""
    lost = threading.Event()
    client.add_listener(lambda state: lost.set() if state == KazooState.LOST else None)
    deadline = time.monotonic() + DEADLINE * 4
    while not lost.is_set() and time.monotonic() < deadline:
        thief = KazooClient(hosts=address.hosts, client_id=client.client_id)
        try:
            thief.start(timeout=10)
            thief.stop()
        except KazooTimeoutError:
            pass  # the session went back to ``client`` first: steal it again
        finally:
            thief.close()
        lost.wait(1)
    assert lost.is_set(), f"{client.client_id[0]:#x}: the session outlived every close"


@integration
def test_a_session_expiry_counts_as_losing_the_node(
    zk: str, agents: list[StoreRendezvous], pool: ThreadPoolExecutor
) -> None:
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, SECRET, SESSION)
    node = NodeInfo("expiring", "127.0.0.1", 1)
    expiring = StoreRendezvous(settings(), node, ZooKeeperStore(client, address, "job", SECRET))
    try:
        both = [agents[0], expiring]
        rounds(pool, both)
        expire(client, address)
        assert expiring.changed.wait(DEADLINE)
        assert agents[0].changed.wait(DEADLINE)
        again = rounds(pool, both)
        assert again[0].number == 2
        assert {m.node_id for m in again[0].members} == {"a", "expiring"}
    finally:
        expiring.leave()


@integration
@pytest.mark.parametrize("sentinel", [True, False], ids=["sentinel", "follower"])
def test_a_member_whose_list_trails_the_round_waits_for_it_instead_of_ending_the_round(
    zk: str, pool: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture, sentinel: bool
) -> None:
    """A round that grows counts its newcomer, and a member whose connection has not listed
    the newcomer yet reads that round: it must wait for its list, not count the newcomer gone
    and end the round (every member would restart once more, for nothing). The observer's
    news of ``members/`` is held back by the test until the observer has read the round: its
    listings, and, where it follows the roster (the job's sentinels being the other two's
    connections), its reads of the roster."""
    address = ZooKeeperAddress.parse(zk)
    first = connect(zk, settings(), NodeInfo("first", "127.0.0.1", 1), secret=SECRET)
    newcomer_node = NodeInfo("newcomer", "127.0.0.1", 1)
    if not sentinel:
        newcomer = connect(zk, settings(), newcomer_node, secret=SECRET)
    client = open_client(address, SECRET, SESSION)
    store = ZooKeeperStore(client, address, "job", SECRET)
    assert store.sentinel == sentinel
    observer = StoreRendezvous(settings(), NodeInfo("observer", "127.0.0.1", 1), store)
    if sentinel:
        newcomer = connect(zk, settings(), newcomer_node, secret=SECRET)
    held = threading.Event()
    reads = {"get_children": client.get_children, "get": client.get}

    def held_back(name: str, path: str, *args: Any, **kwargs: Any) -> Any:
        if path.endswith(("/members", "/roster")) and held.is_set():
            assert wait_until(lambda: not held.is_set(), DEADLINE * 2), "never let go"
        return reads[name](path, *args, **kwargs)

    try:
        # ``first`` joins first, so it is rank 0 and completes the next round, not the observer.
        leading = pool.submit(first.next_round)
        wait_for_member(zk, "first")
        formed = [leading, pool.submit(observer.next_round)]
        assert {future.result(DEADLINE).number for future in formed} == {1}
        monkeypatch = pytest.MonkeyPatch()
        for name in reads:
            monkeypatch.setattr(client, name, partial(held_back, name))
        held.set()
        futures = [pool.submit(newcomer.next_round)]
        wait_for_member(zk, "newcomer")
        assert first.changed.wait(DEADLINE), "the newcomer's arrival never ended round 1"
        futures += [pool.submit(agent.next_round) for agent in (first, observer)]
        waited = "observer: round 2 has a member not listed yet"
        assert wait_until(lambda: waited in caplog.text, DEADLINE), "it never waited for its list"
        assert not store.alive_is_current()
        held.clear()
        numbers = {future.result(DEADLINE).number for future in futures}
        monkeypatch.undo()
        assert numbers == {2}, "a round was ended for a member that was there"
    finally:
        held.clear()
        close_job(zk, "job", SECRET)  # ends every round still waited for, had one gone wrong
        for agent in (first, observer, newcomer):
            agent.leave()


@integration
def test_a_join_this_session_made_asks_nothing_until_the_member_is_gone(
    zk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every round begins with a join: with thousands of agents restarting, three requests
    each were a third of the ensemble's work. A member deleted behind the session's back
    (by an agent of the same id, or by hand) is made again once the listing shows it gone."""
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, SECRET, SESSION)
    store = ZooKeeperStore(client, address, "job", SECRET)
    member = f"{address.job_path('job')}/members/a"
    record = encode_node(NodeInfo("a", "127.0.0.1", 1))
    try:
        store.join("a", record)
        assert wait_until(lambda: "a" in store.alive(), DEADLINE), "the member was never listed"
        asked: list[str] = []
        for name in ("exists", "create", "delete"):
            request = getattr(client, name)
            monkeypatch.setattr(client, name, partial(_noted, asked, name, request))
        store.join("a", record)
        assert asked == []
        monkeypatch.undo()
        client.delete(member)
        assert wait_until(lambda: "a" not in store.alive(), DEADLINE), "its deletion went unheard"
        store.join("a", record)
        assert client.exists(member) is not None
    finally:
        store.release()


@integration
def test_after_a_reconnection_the_agents_of_a_connection_read_the_state_once(
    zk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a leader change every connection is suspended and reconnects, and each of its
    agents refreshes its view: with a compare-and-set each, N agents wrote the state at once.
    Now one ``sync`` and read a connection serves them all, until the connection changes again.
    kazoo's part, telling the store's listeners of the outage, is played by the test."""
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, SECRET, SESSION)
    store = ZooKeeperStore(client, address, "job", SECRET)
    writer = ZooKeeperStore(open_client(address, SECRET, SESSION), address, "job", SECRET)
    try:
        _, first, _ = writer.set_state(b"one", ABSENT)
        asked: list[str] = []
        for name in ("sync", "set"):
            request = getattr(client, name)
            monkeypatch.setattr(client, name, partial(_noted, asked, name, request))

        def outage() -> None:
            for listener in list(client.state_listeners):
                for state in (KazooState.SUSPENDED, KazooState.CONNECTED):
                    listener(state)

        outage()
        with ThreadPoolExecutor(8) as agents:
            views = list(agents.map(lambda _: store.refresh_state(b"one", first), range(8)))
        assert views == [(b"one", first)] * 8
        assert asked == ["sync"], "the agents of one connection did not share one read"
        _, second, _ = writer.set_state(b"two", first)
        outage()
        assert store.refresh_state(b"one", first) == (b"two", second)
        assert asked == ["sync", "sync"], "a reconnection was not followed by a read"
    finally:
        writer.release()
        store.release()


def _noted(asked: list[str], name: str, request: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    asked.append(name)
    return request(*args, **kw)


@integration
def test_an_unreachable_ensemble_fails_fast_with_the_hosts_quoted() -> None:
    (port,) = testing.free_ports(1)
    with pytest.raises(RendezvousError, match=f"127.0.0.1:{port}' did not answer within 1 s"):
        connect(
            f"127.0.0.1:{port}",
            settings(),
            NodeInfo("a", "127.0.0.1", 1),
            open_acl=True,
            connect_timeout=1.0,
        )


@integration
def test_a_three_server_ensemble_survives_losing_one_server(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    servers = testing.ensemble(tmp_path)
    try:
        for server in servers:
            server.start(wait=0)
        for server in servers:
            server.wait_ready(60)
        address = ZooKeeperAddress.parse(",".join(server.hosts for server in servers))
        stores = [
            ZooKeeperStore(open_client(address, SECRET, SESSION), address, "job", SECRET)
            for _ in "ab"
        ]
        made = [
            StoreRendezvous(settings(), NodeInfo(name, "127.0.0.1", 1), store)
            for name, store in zip("ab", stores, strict=True)
        ]
        assert rounds(pool, made)[0].world_size == 2
        sessions = [store.session_id for store in stores]
        servers[0].stop()
        # Instead of waiting a fixed time for nothing to happen: a request through each
        # store returns once it is connected again, and the session it holds then is the
        # one it had, so its membership was never lost and no round was disturbed.
        for store in stores:
            assert not store.is_closed()
        assert [store.session_id for store in stores] == sessions
        assert not any(agent.changed.is_set() for agent in made)
        made.pop().leave()
        assert made[0].changed.wait(DEADLINE)
        made[0].leave()
    finally:
        for server in servers:
            server.stop()


# --- another user of the ensemble squats the job's path (issue 12) ------------------------
#
# These run on a private ZooKeeper server (no Slurm needed): the attacker is a client without
# the job's secret, as any other user of a shared ensemble is.


@pytest.fixture
def chroot(private_zookeeper: str) -> str:
    """A fresh chroot on the private server; nothing is cleaned up (the server goes)."""
    return f"{private_zookeeper}/acl-{uuid.uuid4().hex}"


@pytest.fixture
def attacker(private_zookeeper: str) -> Iterator[KazooClient]:
    """Another user: a client with an identity of its own and no job secret."""
    client = KazooClient(hosts=private_zookeeper, auth_data=[("digest", "mallory:pw")])
    client.start(timeout=10)
    yield client
    client.stop()
    client.close()


MALLORY_ONLY = [make_digest_acl("mallory", "pw", all=True)]
SQUATTER_ACLS = {"open to everyone": OPEN_ACL_UNSAFE, "the attacker's own": MALLORY_ONLY}


@pytest.mark.parametrize("acl", SQUATTER_ACLS.values(), ids=SQUATTER_ACLS.keys())
def test_an_agent_refuses_a_job_node_that_another_user_created_first(
    chroot: str, attacker: KazooClient, acl: list[ACL]
) -> None:
    job = ZooKeeperAddress.parse(chroot).job_path("job")
    attacker.ensure_path(job.rsplit("/", 1)[0])
    attacker.create(job, acl=acl)
    with pytest.raises(RendezvousAccessError, match="another user"):
        connect(chroot, settings(), NodeInfo("a", "127.0.0.1", 1), secret=SECRET)
    assert attacker.get_children(job) == [], "the agent wrote nothing into the squatted node"
    with pytest.raises(RendezvousAccessError, match="another user"):
        describe_job(chroot, "job", SECRET)


def test_an_agent_refuses_a_prefix_that_another_user_made_theirs(
    chroot: str, attacker: KazooClient
) -> None:
    prefix = ZooKeeperAddress.parse(chroot).job_path("job").rsplit("/", 1)[0]
    attacker.ensure_path(ZooKeeperAddress.parse(chroot).chroot)
    attacker.create(prefix, acl=MALLORY_ONLY)
    with pytest.raises(RendezvousAccessError, match=r"another user made '.*/hpc-elastic' theirs"):
        connect(chroot, settings(), NodeInfo("a", "127.0.0.1", 1), secret=SECRET)


def test_a_forged_state_and_member_planted_before_the_job_never_reach_a_round(
    chroot: str, attacker: KazooClient
) -> None:
    job = ZooKeeperAddress.parse(chroot).job_path("job")
    forged = State(3, round=1, members=(NodeInfo("forged", "203.0.113.9", 1),), master_port=1)
    attacker.create(f"{job}/state", encode(forged), makepath=True)
    attacker.create(f"{job}/members/forged", encode_node(forged.members[0]), makepath=True)
    with pytest.raises(RendezvousAccessError, match="not guarded"):
        connect(chroot, settings("1"), NodeInfo("a", "127.0.0.1", 1), secret=SECRET)


def test_a_planted_closed_tombstone_does_not_end_the_job(
    chroot: str, attacker: KazooClient
) -> None:
    job = ZooKeeperAddress.parse(chroot).job_path("job")
    attacker.create(f"{job}/closed", makepath=True)
    with pytest.raises(RendezvousAccessError, match="not guarded"):
        connect(chroot, settings(), NodeInfo("a", "127.0.0.1", 1), secret=SECRET)
    with pytest.raises(RendezvousAccessError, match="not guarded"):
        close_job(chroot, "job", SECRET)


def test_once_the_job_exists_another_user_can_neither_plant_closed_nor_join(
    chroot: str, attacker: KazooClient
) -> None:
    agent = connect(chroot, settings("1"), NodeInfo("a", "127.0.0.1", 1), secret=SECRET)
    job = ZooKeeperAddress.parse(chroot).job_path("job")
    try:
        assert agent.next_round().world_size == 1
        for planted in ("closed", "members/forged", "state2"):
            with pytest.raises(NoAuthError):
                attacker.create(f"{job}/{planted}")
        with pytest.raises(NoAuthError):
            attacker.set_acls(job, OPEN_ACL_UNSAFE)
    finally:
        agent.leave()


def test_the_prefix_we_create_lets_other_users_only_add_jobs(
    chroot: str, attacker: KazooClient
) -> None:
    agent = connect(chroot, settings("1"), NodeInfo("a", "127.0.0.1", 1), secret=SECRET)
    agent.leave()
    prefix = ZooKeeperAddress.parse(chroot).job_path("job").rsplit("/", 1)[0]
    attempts = {
        "list the jobs": partial(attacker.get_children, prefix),
        "read the prefix": partial(attacker.get, prefix),
        "read its ACL": partial(attacker.get_acls, prefix),
        "change its ACL": partial(attacker.set_acls, prefix, OPEN_ACL_UNSAFE),
        "delete a job node": partial(attacker.delete, f"{prefix}/job"),
    }
    for what, attempt in attempts.items():
        try:
            attempt()
        except NoAuthError:
            continue
        pytest.fail(f"another user could {what}")
    attacker.create(f"{prefix}/their-own-job")


def test_status_and_cancel_of_a_job_no_agent_reached_create_no_znode(
    chroot: str, attacker: KazooClient
) -> None:
    assert describe_job(chroot, "job", SECRET) is None
    close_job(chroot, "job", SECRET)
    assert describe_job(chroot, "job", None) is None
    assert attacker.exists(ZooKeeperAddress.parse(chroot).chroot) is None


def test_a_job_without_a_secret_is_refused_unless_an_open_acl_is_asked_for(chroot: str) -> None:
    with pytest.raises(UsageError, match=r"'job' has no ZooKeeper secret.*--zk-open-acl"):
        connect(chroot, settings("1"), NodeInfo("a", "127.0.0.1", 1))
    agent = connect(chroot, settings("1"), NodeInfo("a", "127.0.0.1", 1), open_acl=True)
    try:
        assert agent.next_round().world_size == 1
    finally:
        agent.leave()


# --- the preflight's probe and the user's bad-node memory (issue 16) -----------------------


def test_the_probe_reads_the_servers_clock_and_leaves_nothing_behind(chroot: str) -> None:
    before = time.time()
    found = probe(chroot)
    assert found.server_time is not None
    # Server and test share one clock: the server stamped the znode between our send and
    # its answer (ctime has millisecond resolution), however loaded the machine is.
    assert found.sent - 0.01 <= found.server_time <= found.received + 0.01
    assert found.sent >= before
    address = ZooKeeperAddress.parse(chroot)
    assert found.znode is not None
    assert found.znode.startswith(address.chroot + "/hpc-elastic/.clock-")
    client = open_client(ZooKeeperAddress.parse(address.hosts), None, session_timeout=5)
    try:
        # exists() needs no READ, which the shared prefix grants nobody.
        wait_until = time.monotonic() + DEADLINE
        while client.exists(found.znode) is not None:
            assert time.monotonic() < wait_until, "the probe's ephemeral znode stayed"
            time.sleep(0.1)
    finally:
        client.stop()
        client.close()


def test_bad_nodes_are_remembered_per_user_listed_until_they_expire_and_cleared(
    chroot: str,
) -> None:
    now = time.time()
    remember_bad_node(chroot, "alice", SECRET, remembered("node1", "GPU 0: 3 ECC", now, 60.0))
    remember_bad_node(chroot, "alice", SECRET, remembered("node2", "disk full", now - 90, 60.0))
    remember_bad_node(chroot, "alice", SECRET, remembered("node3", "clock skew", now, 60.0))
    with bad_node_book(chroot, "alice", SECRET) as book:
        listed = listing(book, now)
        assert sorted(record.host for record in book.records()) == ["node1", "node3"]
    assert [(record.host, record.reason) for record in listed] == [
        ("node1", "GPU 0: 3 ECC"),
        ("node3", "clock skew"),
    ]
    with bad_node_book(chroot, "bob", "bobs-secret") as book:
        assert listing(book, now) == []
    with bad_node_book(chroot, "alice", SECRET) as book:
        assert clear(book, ["node3", "node7"]) == Cleared(("node3",), ("node7",))
    with bad_node_book(chroot, "alice", SECRET) as book:
        assert [record.host for record in listing(book, now)] == ["node1"]
        assert clear(book) == Cleared(("node1",), ())
    with bad_node_book(chroot, "alice", SECRET) as book:
        assert listing(book, now) == []


def test_another_users_secret_cannot_read_or_squat_a_users_bad_nodes(
    chroot: str, attacker: KazooClient
) -> None:
    remember_bad_node(chroot, "alice", SECRET, remembered("node1", "x", time.time(), 60.0))
    with (
        pytest.raises(RendezvousAccessError, match="not guarded by user 'alice'"),
        bad_node_book(chroot, "alice", "wrong") as book,
    ):
        book.records()
    path = ZooKeeperAddress.parse(chroot).chroot + "/hpc-elastic/@users/carol"
    attacker.create(path, acl=MALLORY_ONLY, makepath=True)
    with pytest.raises(RendezvousAccessError, match="not guarded by user 'carol'"):
        remember_bad_node(chroot, "carol", SECRET, remembered("node1", "x", time.time(), 60.0))


def test_the_handlers_select_answers_as_select_does_for_sockets_to_read_and_to_write() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        for rlist, wlist in (([ours], []), ([], [ours]), ([ours], [ours])):
            assert poll_select(rlist, wlist, 0) == select.select(rlist, wlist, [], 0)
        theirs.send(b"x")
        assert poll_select([ours], [], None) == ([ours], [], [])
        theirs.close()
        ours.recv(1)
        assert poll_select([ours], [], 0) == select.select([ours], [], [], 0)  # the end: readable
    with pytest.raises(ValueError, match="Invalid file descriptor: -1"):
        poll_select([ours], [], 0)  # closed
