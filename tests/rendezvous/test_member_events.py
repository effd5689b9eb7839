"""The members followed by name (``MemberEvents``: a persistent recursive watch on a session
of its own), on a real ZooKeeper: a loss costs a connection an event naming it, not a list of
every member; a cut-off session lists once more; a server that cannot follow by name has the
members listed, as before."""

from __future__ import annotations

import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.rendezvous import testing
from hpc_elastic.rendezvous.backend import ABSENT
from hpc_elastic.rendezvous.member_events import MemberEvents, Unsupported
from hpc_elastic.rendezvous.zookeeper import (
    Following,
    ZooKeeperAddress,
    ZooKeeperStore,
    open_client,
)

SECRET = "s3cret"
SESSION = 20.0
"""Long, so that a server's restart never expires a session: these tests are about members."""
DEADLINE = 30.0


def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


class Stores:
    """Stores of one job, each on a connection of its own, released afterwards."""

    def __init__(self, hosts: str) -> None:
        self.address = ZooKeeperAddress.parse(f"{hosts}/members-{uuid.uuid4().hex}")
        self.made: list[ZooKeeperStore] = []

    def open(self, members: Following = Following.BY_NAME) -> ZooKeeperStore:
        client = open_client(self.address, SECRET, SESSION)
        store = ZooKeeperStore(client, self.address, "job", SECRET, members=members)
        self.made.append(store)
        return store

    def member(self, node_id: str) -> ZooKeeperStore:
        store = self.open()
        store.join(node_id, b"{}")
        return store

    def release(self) -> None:
        for store in self.made:
            store.release()


@pytest.fixture
def stores(private_zookeeper: str) -> Iterator[Stores]:
    made = Stores(private_zookeeper)
    yield made
    made.release()


def test_a_loss_is_told_by_name_and_the_members_are_listed_once_a_session(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a children watch every connection listed every member after each loss: O(N)
    bytes a connection, O(N²) from the ensemble. Followed by name, the list is read once."""
    client = open_client(stores.address, SECRET, SESSION)
    listed: list[str] = []
    listing = client.get_children

    def noted(path: str, *args: Any, **kwargs: Any) -> Any:
        listed.append(path)
        return listing(path, *args, **kwargs)

    monkeypatch.setattr(client, "get_children", noted)
    watcher = ZooKeeperStore(client, stores.address, "job", SECRET, members=Following.BY_NAME)
    stores.made.append(watcher)
    members = {name: stores.member(name) for name in ("a", "b", "c")}
    eventually(lambda: watcher.alive() == {"a", "b", "c"}, "every member shown")
    listed.clear()  # the store's first listing, before its events took over
    members["b"].release()  # its session ends, and the server deletes its member
    eventually(lambda: watcher.alive() == {"a", "c"}, "the lost member gone")
    assert not [path for path in listed if path.endswith("/members")], "members/ listed again"
    counts = watcher.members_by_name
    assert counts is not None
    assert counts["lists"] == 1
    assert counts["events"] == 4, "three joins and one loss, each an event"


def test_the_members_are_listed_through_the_join_storm_and_followed_by_name_from_its_round(
    stores: Stores,
) -> None:
    """By default: in a join storm, following by name costs each connection an event a
    member (N² from the ensemble), so the members are listed until the state records a
    round (its version 1), and followed by name from then on."""
    watcher = stores.open(Following.BY_NAME_FROM_FIRST_ROUND)
    stores.member("a")
    stores.member("b")
    eventually(lambda: watcher.alive() == {"a", "b"}, "every member listed")
    _, version, _ = watcher.set_state(b"created", ABSENT)
    assert watcher.members_by_name is None, "listed while the state has no round"
    watcher.set_state(b"a round", version)
    eventually(lambda: watcher.members_by_name is not None, "followed by name")
    assert watcher.alive() == {"a", "b"}
    stores.member("c")
    eventually(lambda: watcher.alive() == {"a", "b", "c"}, "the newcomer shown")
    eventually(watcher.alive_is_current, "the list as new as the state")
    counts = watcher.members_by_name
    assert counts is not None
    assert counts["lists"] == 1


def test_a_cut_off_session_lists_the_members_again_and_is_current_only_then(
    tmp_path: Path, private_zookeeper: str
) -> None:
    """While its session is cut off, the list may miss a change: it is not as new as any
    state. Back, it lists the members once more and follows them by name again."""
    del private_zookeeper  # only for its skip-or-fail when ZooKeeper is missing
    server = testing.ZooKeeperServer(tmp_path / "zk")
    server.start()
    stores = Stores(server.hosts)
    try:
        watcher = stores.open()
        stores.member("a")
        eventually(lambda: watcher.alive() == {"a"} and watcher.alive_is_current(), "a shown")
        server.stop()
        eventually(lambda: not watcher.alive_is_current(), "the list no longer current")
        server.start()
        stores.member("b")
        eventually(lambda: watcher.alive() == {"a", "b"}, "the newcomer shown")
        eventually(watcher.alive_is_current, "the list current again")
        counts = watcher.members_by_name
        assert counts is not None
        assert counts["sessions"] >= 2
        assert counts["lists"] == counts["sessions"], "one list a session"
    finally:
        stores.release()
        server.stop()


def test_a_server_that_takes_no_second_connection_has_the_members_listed(
    tmp_path: Path, private_zookeeper: str
) -> None:
    """A server that takes one connection from an address (``maxClientCnxns=1``) refuses
    the members' session: the store lists the members on every change, as before."""
    del private_zookeeper  # only for its skip-or-fail when ZooKeeper is missing
    server = testing.ZooKeeperServer(tmp_path / "zk", options={"maxClientCnxns": "1"})
    server.start()
    stores = Stores(server.hosts)
    try:
        started = time.monotonic()
        store = stores.open()
        assert time.monotonic() - started < 5, "the refusal is taken at once, not waited out"
        assert store.members_by_name is None
        store.join("a", b"{}")
        eventually(lambda: store.alive() == {"a"}, "the member listed")
    finally:
        stores.release()
        server.stop()


def test_a_server_without_persistent_watches_is_told_apart() -> None:
    """ZooKeeper before 3.6 answers ``addWatch`` with UNIMPLEMENTED (-6). A listener that
    speaks as such a server does stands in for one: no such server is installed here."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        served = threading.Thread(target=_serve_as_zookeeper_3_5, args=(listener,), daemon=True)
        served.start()
        events = MemberEvents(
            f"127.0.0.1:{port}", "/job/members", None, lambda _: None, lambda: None
        )
        with pytest.raises(Unsupported):
            events.start(DEADLINE)
        served.join(DEADLINE)


def _serve_as_zookeeper_3_5(listener: socket.socket) -> None:
    connection, _ = listener.accept()
    with connection:
        _frame(connection)  # the connect request
        password = b"\0" * 16
        answer = struct.pack("!iiqi", 0, 10_000, 1, len(password)) + password
        connection.sendall(struct.pack("!i", len(answer)) + answer)
        request = _frame(connection)
        xid, opcode = struct.unpack_from("!ii", request)
        assert opcode == 106, "addWatch first"
        error = struct.pack("!iqi", xid, 1, -6)
        connection.sendall(struct.pack("!i", len(error)) + error)
        connection.recv(1024)  # until the client goes


def _frame(connection: socket.socket) -> bytes:
    (length,) = struct.unpack("!i", _exactly(connection, 4))
    return _exactly(connection, length)


def _exactly(connection: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        assert chunk, "the client went before its request"
        data += chunk
    return data
