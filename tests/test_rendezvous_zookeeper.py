"""The rendezvous on the real ZooKeeper: rounds, ACLs, closing and faults.

Each test runs under a fresh chroot (``zk_root``), so tests never see each other's jobs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from cluster import REPO, Cluster
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from hpc_elastic.errors import RendezvousClosedError, RendezvousError
from hpc_elastic.rendezvous import testing
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings, Round
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.zookeeper import (
    ZooKeeperAddress,
    ZooKeeperStore,
    close_job,
    connect,
    describe_job,
    open_client,
)
from hpc_elastic.spec import NodeRange

pytestmark = pytest.mark.integration

SECRET = "s3cret"
SESSION = 2.0


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


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as executor:
        yield executor


@pytest.fixture
def agents(zk: str) -> Iterator[list[StoreRendezvous]]:
    """Three agents with their own connections; they leave after the test."""
    made = [
        connect(zk, settings(), NodeInfo(name, "127.0.0.1", 1), secret=SECRET) for name in "abc"
    ]
    yield made
    for agent in made:
        agent.leave()


def rounds(pool: ThreadPoolExecutor, agents: list[StoreRendezvous]) -> list[Round]:
    futures: list[Future[Round]] = [pool.submit(agent.next_round) for agent in agents]
    return [future.result(timeout=30) for future in futures]


def test_agents_agree_on_a_round_and_see_a_clean_exit_at_once(
    agents: list[StoreRendezvous], pool: ThreadPoolExecutor
) -> None:
    first = rounds(pool, agents)
    assert len({(r.number, r.members, r.master_port) for r in first}) == 1
    leaver = next(a for a in agents if a.node.node_id == first[0].members[1].node_id)
    survivors = [a for a in agents if a is not leaver]
    started = time.monotonic()
    leaver.leave()
    assert all(a.changed.wait(1.0) for a in survivors)
    assert time.monotonic() - started < 1.0
    agents.remove(leaver)
    second = rounds(pool, survivors)[0]
    assert second.number == 2
    assert second.members[0] == first[0].members[0], "rank 0 stays on its node"


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
time.sleep(600)
"""


def test_a_sigkilled_agent_is_noticed_within_the_session_timeout(
    zk: str, agents: list[StoreRendezvous], pool: ThreadPoolExecutor
) -> None:
    survivors = agents[:2]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    victim = subprocess.Popen(
        [sys.executable, "-c", AGENT, zk, str(SESSION)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rounds(pool, survivors)[0].world_size == 3
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "1"
        started = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        assert all(agent.changed.wait(SESSION + 1) for agent in survivors)
        noticed = time.monotonic() - started
    finally:
        victim.kill()
        victim.wait()
    assert noticed <= SESSION + 1
    assert rounds(pool, survivors)[0].world_size == 2


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
        thief = KazooClient(hosts=address.hosts, client_id=client.client_id)
        thief.start(timeout=10)
        thief.stop()
        thief.close()
        assert expiring.changed.wait(SESSION + 1)
        assert agents[0].changed.wait(SESSION + 1)
        again = rounds(pool, both)
        assert again[0].number == 2
        assert {m.node_id for m in again[0].members} == {"a", "expiring"}
    finally:
        expiring.leave()


def test_a_zookeeper_restart_does_not_disturb_the_job(
    cluster: Cluster, agents: list[StoreRendezvous], pool: ThreadPoolExecutor
) -> None:
    first = rounds(pool, agents)[0]
    cluster.zk_stop()
    time.sleep(0.5)
    cluster.zk_start()
    time.sleep(SESSION)
    assert not any(agent.changed.is_set() for agent in agents), "training goes on"
    snapshot = agents[0].snapshot()
    assert snapshot is not None
    assert snapshot.round == first.number
    agents.pop().leave()
    assert rounds(pool, agents)[0].number == 2


def test_an_unreachable_ensemble_fails_fast_with_the_hosts_quoted() -> None:
    (port,) = testing.free_ports(1)
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=f"127.0.0.1:{port}' did not answer within 1 s"):
        connect(
            f"127.0.0.1:{port}",
            settings(),
            NodeInfo("a", "127.0.0.1", 1),
            connect_timeout=1.0,
        )
    assert time.monotonic() - started < 5


def test_a_three_server_ensemble_survives_losing_one_server(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    servers = testing.ensemble(tmp_path)
    try:
        for server in servers:
            server.start(wait=0)
        for server in servers:
            server.wait_ready(60)
        hosts = ",".join(server.hosts for server in servers)
        made = [
            connect(hosts, settings(), NodeInfo(name, "127.0.0.1", 1), secret=SECRET)
            for name in "ab"
        ]
        assert rounds(pool, made)[0].world_size == 2
        servers[0].stop()
        assert not any(agent.changed.wait(SESSION) for agent in made)
        made.pop().leave()
        assert made[0].changed.wait(SESSION)
        made[0].leave()
    finally:
        for server in servers:
            server.stop()
