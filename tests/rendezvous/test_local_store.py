"""The embedded store: the Store contract over a real unix socket, and the state machine on it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hpc_elastic.errors import RendezvousClosedError, RendezvousError
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.backend import ABSENT
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.local_store import LocalStore, LocalStoreServer, connect
from hpc_elastic.spec import NodeRange

DEADLINE = 60.0
"""How long a pushed change may take to arrive: generous, since the machine may be loaded; a
wait ends as soon as the change arrives, so a passing run never waits this long."""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalStoreServer]:
    running = LocalStoreServer(tmp_path / "s.sock")
    running.start()
    yield running
    running.stop()


def client(server: LocalStoreServer) -> LocalStore:
    return LocalStore(server.path, "job")


def test_compare_and_set_on_an_integer_version(server: LocalStoreServer) -> None:
    store = client(server)
    assert store.get_state() == (None, ABSENT)
    assert store.set_state(b"a", ABSENT) == (b"a", 0, True)
    assert store.set_state(b"b", ABSENT) == (b"a", 0, False)
    assert store.set_state(b"b", 0) == (b"b", 1, True)
    assert store.set_state(b"c", 0) == (b"b", 1, False)
    store.release()


def test_membership_vanishes_with_its_connection_and_others_are_told(
    server: LocalStoreServer,
) -> None:
    watcher, member = client(server), client(server)
    changed = threading.Event()
    watcher.subscribe(changed.set, lambda: None)
    member.join("n1", b"{}")
    member.join("n1", b"{}")
    assert changed.wait(DEADLINE)
    assert watcher.members(["n1", "nobody"]) == [b"{}"]
    changed.clear()
    member.release()
    assert changed.wait(DEADLINE)
    assert watcher.alive() == frozenset()
    watcher.release()


def test_a_closed_job_refuses_joins(server: LocalStoreServer) -> None:
    store = client(server)
    store.set_state(b"x", ABSENT)
    store.close_job()
    assert store.is_closed()
    with pytest.raises(RendezvousClosedError):
        store.join("late", b"{}")
    store.release()


def test_a_missing_server_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(RendezvousError, match="does not answer"):
        LocalStore(tmp_path / "none.sock", "job")


def test_a_stopped_server_tells_subscribers_their_session_is_lost(
    server: LocalStoreServer,
) -> None:
    store = client(server)
    lost = threading.Event()
    store.subscribe(lambda: None, lost.set)
    server.stop()
    assert lost.wait(DEADLINE)
    with pytest.raises(RendezvousError, match="went away"):
        store.is_closed()


def test_three_agents_form_a_round_and_a_killed_one_supersedes_it(
    server: LocalStoreServer,
) -> None:
    settings = RendezvousSettings(run_id="job", nodes=NodeRange.parse("2:3"), last_call=0.2)
    agents: list[StoreRendezvous] = [
        connect(f"local:{server.path}", settings, NodeInfo(f"n{i}", "127.0.0.1", 1, f"n{i}"))
        for i in range(3)
    ]
    with ThreadPoolExecutor(3) as pool:
        rounds = list(pool.map(lambda agent: agent.next_round(), agents))
    assert {r.number for r in rounds} == {1}
    assert rounds[0].world_size == 3
    agents[2].leave()
    assert agents[0].changed.wait(DEADLINE)
    with ThreadPoolExecutor(2) as pool:
        again = list(pool.map(lambda agent: agent.next_round(), agents[:2]))
    assert {r.number for r in again} == {2}
    survivors = [m.node_id for m in rounds[0].members if m.node_id != "n2"]
    assert [m.node_id for m in again[0].members] == survivors
    for agent in agents[:2]:
        agent.leave()
