"""One contract for every Store: the in-memory one, the local-mode one, and ZooKeeper.

In the style of torch's ``RendezvousBackendTestMixin``: each test runs against every store, so
the rendezvous (and the simulator, which uses the in-memory store) may rely on exactly what
is written here and nothing else. ZooKeeper is a real server that ``rendezvous/testing.py``
starts on a free loopback port; every test gets a fresh chroot, so tests never see each other.

Notifications from the local and ZooKeeper stores arrive on threads of their own, so a test
waits for the event it expects, with a generous deadline, and never sleeps.
"""

from __future__ import annotations

import hashlib
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Protocol

import pytest

from hpc_elastic.ensemble import fourletter
from hpc_elastic.errors import RendezvousClosedError, RendezvousError
from hpc_elastic.rendezvous import testing
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.backend import ABSENT, ConnectionState, Mark, Store
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.local_store import LocalStore, LocalStoreServer
from hpc_elastic.rendezvous.memory import ManualClock, MemoryServer, MemoryStore
from hpc_elastic.rendezvous.zookeeper import (
    SENTINELS,
    ZooKeeperAddress,
    ZooKeeperStore,
    answer_wait,
    open_client,
)
from hpc_elastic.spec import NodeRange

DEADLINE = 20.0
"""Seconds to wait for a notification; only a broken store ever takes that long."""
SECRET = "contract-secret"
SESSION = 2.0


class Harness(Protocol):
    """What the contract needs from one kind of store besides the Store protocol itself."""

    def connect(self) -> Store:
        """A new connection, with a session of its own."""

    def expire(self, store: Store) -> None:
        """End ``store``'s session on the server side, as a session timeout does."""

    def close(self) -> None:
        """Release every connection made and whatever serves them."""


class MemoryHarness:
    def __init__(self) -> None:
        self.server = MemoryServer()
        self.made: list[MemoryStore] = []

    def connect(self) -> Store:
        store = self.server.connect(session_timeout=SESSION)
        self.made.append(store)
        return store

    def expire(self, store: Store) -> None:
        assert isinstance(store, MemoryStore)
        store.expire_session()

    def close(self) -> None:
        for store in self.made:
            store.release()


class LocalHarness:
    """The local store's session is its socket: it ends when the serving process stops."""

    def __init__(self, directory: Path) -> None:
        self.server = LocalStoreServer(directory / "contract.sock")
        self.server.start()
        self.made: list[LocalStore] = []

    def connect(self) -> Store:
        store = LocalStore(self.server.path, "job")
        self.made.append(store)
        return store

    def expire(self, store: Store) -> None:
        del store
        self.server.stop()

    def close(self) -> None:
        for store in self.made:
            store.release()
        self.server.stop()


class ZooKeeperHarness:
    """``followers``: every store the test makes follows the roster that a store of the
    harness's own writes (the job's one sentinel); otherwise the test's first stores are the
    job's sentinels, as the first agents of a job are."""

    def __init__(self, hosts: str, followers: bool = False) -> None:
        self.address = ZooKeeperAddress.parse(f"{hosts}/contract-{uuid.uuid4().hex}")
        self.made: list[ZooKeeperStore] = []
        self.sentinels = SENTINELS
        if followers:
            self.sentinels = 1
            assert self._open().sentinel

    def connect(self) -> Store:
        store = self._open()
        assert not store.sentinel or self.sentinels == SENTINELS
        return store

    def _open(self) -> ZooKeeperStore:
        client = open_client(self.address, SECRET, SESSION)
        store = ZooKeeperStore(client, self.address, "job", SECRET, sentinels=self.sentinels)
        self.made.append(store)
        return store

    def expire(self, store: Store) -> None:
        """A second client on the same session id, closed at once: the server ends the
        session for real (kazoo's own tests expire sessions this way)."""
        assert isinstance(store, ZooKeeperStore)
        session_id, password = store.session_id
        thief = open_client(
            ZooKeeperAddress(self.address.hosts), None, SESSION, client_id=(session_id, password)
        )
        thief.stop()
        thief.close()

    def close(self) -> None:
        """Release the connections; the znodes stay on this module's private server, which
        goes with them (the prefix's ACL lets nobody delete a job node)."""
        for store in self.made:
            store.release()


@pytest.fixture(params=["memory", "local", "zookeeper", "zookeeper-followers"])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    made: Harness
    if request.param == "memory":
        made = MemoryHarness()
    elif request.param == "local":
        made = LocalHarness(tmp_path)
    else:
        followers = request.param == "zookeeper-followers"
        made = ZooKeeperHarness(request.getfixturevalue("private_zookeeper"), followers)
    yield made
    made.close()


def eventually(condition: Callable[[], bool], what: str) -> None:
    """Wait until ``condition`` holds; the stores push, so this only waits for delivery."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what} within {DEADLINE:g} s"
        time.sleep(0.01)


View = tuple[tuple[bytes | None, int], frozenset[str]]


class Recorder:
    """A subscriber that records the store's view each time it is called."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.heard = threading.Condition()
        self.views: list[View] = []
        self.lost = threading.Event()
        self.states: list[ConnectionState] = []
        store.subscribe(self.on_change, self.lost.set)
        store.subscribe_connection(self.states.append)

    def on_change(self) -> None:
        with self.heard:
            self.views.append((self.store.get_state(), self.store.alive()))
            self.heard.notify_all()

    def was_told(self, condition: Callable[[View], bool]) -> bool:
        """Whether a call came (or comes, within the deadline) whose view meets ``condition``:
        the callback is how a subscriber learns of the change, the view proves which one."""
        with self.heard:
            return self.heard.wait_for(lambda: any(map(condition, self.views)), DEADLINE)


# --- compare-and-set -----------------------------------------------------------------------


def test_a_missing_state_is_created_only_with_the_absent_token(harness: Harness) -> None:
    store = harness.connect()
    assert store.get_state() == (None, ABSENT)
    assert store.set_state(b"x", 0) == (None, ABSENT, False)
    data, token, won = store.set_state(b"first", ABSENT)
    assert (data, won) == (b"first", True)
    assert token != ABSENT
    assert store.set_state(b"second", ABSENT) == (b"first", token, False)


def test_a_write_with_the_current_token_wins_and_moves_the_token_on(harness: Harness) -> None:
    store = harness.connect()
    _, token, _ = store.set_state(b"one", ABSENT)
    data, newer, won = store.set_state(b"two", token)
    assert (data, won) == (b"two", True)
    assert newer != token
    assert store.get_state() == (b"two", newer)


def test_a_write_with_a_stale_token_loses_and_returns_the_current_state(harness: Harness) -> None:
    writer, stale = harness.connect(), harness.connect()
    _, first, _ = writer.set_state(b"one", ABSENT)
    _, second, _ = writer.set_state(b"two", first)
    assert stale.set_state(b"late", first) == (b"two", second, False)
    eventually(lambda: writer.get_state() == (b"two", second), "the writer keep its own write")


def test_a_refresh_returns_the_servers_state_and_a_token_that_wins(harness: Harness) -> None:
    """After an outage a connection's view may trail the server by more than one notification;
    a refresh reads past it at once, whatever the view held."""
    writer, reader = harness.connect(), harness.connect()
    _, first, _ = writer.set_state(b"one", ABSENT)
    _, second, _ = writer.set_state(b"two", first)
    assert reader.refresh_state(b"one", first) == (b"two", second)
    assert reader.set_state(b"three", second)[2]


def test_a_refresh_of_a_current_view_keeps_the_state(harness: Harness) -> None:
    store = harness.connect()
    _, token, _ = store.set_state(b"one", ABSENT)
    data, token = store.refresh_state(b"one", token)
    assert data == b"one"
    assert store.set_state(b"two", token)[2], "the token of a refresh is not the current one"


def test_another_connection_sees_the_write(harness: Harness) -> None:
    writer, reader = harness.connect(), harness.connect()
    _, token, _ = writer.set_state(b"news", ABSENT)
    eventually(lambda: reader.get_state() == (b"news", token), "the write reach the reader")


# --- ephemeral membership ------------------------------------------------------------------


def test_a_member_is_alive_for_everyone_until_it_leaves(harness: Harness) -> None:
    member, other = harness.connect(), harness.connect()
    member.join("n1", b"record-1")
    member.join("n1", b"record-1")
    eventually(lambda: other.alive() == {"n1"}, "n1 join")
    assert other.members(["n1"]) == [b"record-1"]
    member.leave("n1")
    member.leave("n1")
    eventually(lambda: other.alive() == frozenset(), "n1 leave")
    assert other.members(["n1"]) == []


def test_members_come_in_join_order_and_the_departed_are_skipped(harness: Harness) -> None:
    store, other = harness.connect(), harness.connect()
    for node in ("c", "a", "b"):
        store.join(node, node.encode())
    other.join("d", b"d")
    assert store.members(["d", "b", "a", "c", "nobody"]) == [b"c", b"a", b"b", b"d"]
    store.leave("a")
    eventually(lambda: other.alive() == {"b", "c", "d"}, "a leave")
    assert other.members(["a", "b", "c", "d"]) == [b"c", b"b", b"d"]


def test_a_membership_dies_with_its_connection(harness: Harness) -> None:
    mortal, other = harness.connect(), harness.connect()
    mortal.join("mortal", b"{}")
    other.join("survivor", b"{}")
    eventually(lambda: other.alive() == {"mortal", "survivor"}, "both members")
    mortal.release()
    eventually(lambda: other.alive() == {"survivor"}, "the released connection's member go")


def test_an_expired_session_loses_its_memberships_and_its_owner_is_told(
    harness: Harness,
) -> None:
    mortal = harness.connect()
    recorder = Recorder(mortal)
    mortal.join("mortal", b"{}")
    harness.expire(mortal)
    assert recorder.lost.wait(DEADLINE), "the owner was never told its session was lost"
    eventually(lambda: ConnectionState.LOST in recorder.states, "LOST on the connection")


# --- watches -------------------------------------------------------------------------------


def test_every_subscriber_of_every_connection_hears_each_kind_of_change(
    harness: Harness,
) -> None:
    stores = [harness.connect(), harness.connect()]
    recorders = [Recorder(store) for store in stores for _ in range(2)]
    _, token, _ = stores[0].set_state(b"one", ABSENT)
    assert all(r.was_told(lambda view: view[0][0] == b"one") for r in recorders)
    stores[1].set_state(b"two", token)
    assert all(r.was_told(lambda view: view[0][0] == b"two") for r in recorders)
    stores[1].join("n1", b"{}")
    assert all(r.was_told(lambda view: view[1] == {"n1"}) for r in recorders)
    stores[1].leave("n1")
    assert all(
        r.was_told(lambda view: view[1] == frozenset() and view[0][0] == b"two") for r in recorders
    )


def test_a_connection_lists_every_member_that_joined_before_its_state_or_says_it_does_not_yet(
    harness: Harness,
) -> None:
    """A state may count a member that joined just before it was written: a connection that
    holds that state and says its list is current must list that member (or the rendezvous
    would count it gone and end a round nobody left); one whose list trails must say so, and
    tell its subscribers once it catches up."""
    writer, reader = harness.connect(), harness.connect()
    recorder = Recorder(reader)
    _, token, _ = writer.set_state(b"one", ABSENT)
    eventually(lambda: reader.get_state()[0] == b"one", "the first state reach the reader")
    writer.join("newcomer", b"{}")
    writer.set_state(b"two", token)

    def listed_once_current() -> bool:
        holds_two = reader.get_state()[0] == b"two"  # read first: a state never goes back
        current = reader.alive_is_current()
        listed = "newcomer" in reader.alive()
        assert listed or not (holds_two and current), "a current list misses the newcomer"
        return holds_two and current

    eventually(listed_once_current, "the reader's list catch up with its state")
    assert recorder.was_told(lambda view: view[0][0] == b"two" and "newcomer" in view[1])


def test_an_unsubscribed_callback_hears_nothing_more(harness: Harness) -> None:
    store = harness.connect()
    dropped, kept = Recorder(store), Recorder(store)
    store.unsubscribe(dropped.on_change)
    store.set_state(b"one", ABSENT)
    assert kept.was_told(lambda view: view[0][0] == b"one")
    # Subscribers are called in the order they subscribed, from one delivery: had the
    # dropped one still been subscribed, it would have been told before the kept one.
    assert not any(view[0][0] == b"one" for view in dropped.views)


# --- closing -------------------------------------------------------------------------------


def test_closing_leaves_a_tombstone_and_a_late_join_is_refused(harness: Harness) -> None:
    closer, other = harness.connect(), harness.connect()
    other.join("n1", b"{}")
    closer.set_state(b"state", ABSENT)
    eventually(lambda: other.alive() == {"n1"}, "n1 join")
    closer.close_job()
    closer.close_job()
    assert other.is_closed()
    eventually(lambda: other.get_state() == (None, ABSENT), "the state go")
    eventually(lambda: other.alive() == frozenset(), "the members go")
    late = harness.connect()
    assert late.is_closed()
    with pytest.raises(RendezvousClosedError, match="'job' is closed"):
        late.join("late", b"{}")


def test_a_closed_job_is_never_reopened_by_a_write(harness: Harness) -> None:
    store = harness.connect()
    _, token, _ = store.set_state(b"state", ABSENT)
    store.close_job()
    assert store.set_state(b"again", token) == (None, ABSENT, False)
    assert store.set_state(b"fresh", ABSENT) == (None, ABSENT, False)
    assert harness.connect().get_state() == (None, ABSENT)


# --- notes ---------------------------------------------------------------------------------


def test_a_note_reaches_every_connection_and_outlives_the_one_that_wrote_it(
    harness: Harness,
) -> None:
    writer, reader = harness.connect(), harness.connect()
    recorder = Recorder(reader)
    writer.put_note("hang-3-1.1@n1", b"evidence of n1")
    assert recorder.was_told(lambda _: "hang-3-1.1" in reader.note_topics())
    assert reader.note_keys("hang-3-1.1") == {"hang-3-1.1@n1"}, "asked for as it is followed"
    writer.put_note("hang-3-1.1@n2", b"evidence of n2")
    assert recorder.was_told(
        lambda _: reader.note_keys("hang-3-1.1") == {"hang-3-1.1@n1", "hang-3-1.1@n2"}
    ), "the follower of a topic is told of its new keys"
    writer.release()
    assert reader.notes("hang-3-1.1") == {
        "hang-3-1.1@n1": b"evidence of n1",
        "hang-3-1.1@n2": b"evidence of n2",
    }
    late = harness.connect()
    assert late.note_topics() == {"hang-3-1.1"}, "a new connection knows the topics at once"
    assert late.note_keys("hang-3-1.1") == {"hang-3-1.1@n1", "hang-3-1.1@n2"}


def test_a_topic_followed_before_its_first_note_is_told_of_it(harness: Harness) -> None:
    writer, reader = harness.connect(), harness.connect()
    recorder = Recorder(reader)
    assert reader.note_keys("hang-5-1.1") == frozenset()
    writer.put_note("hang-5-1.1@n1", b"first")
    assert recorder.was_told(lambda _: reader.note_keys("hang-5-1.1") == {"hang-5-1.1@n1"})


def test_a_topic_followed_again_is_asked_for_again(harness: Harness) -> None:
    """A connection follows one topic at a time: back on a topic it left, it asks again."""
    writer, reader = harness.connect(), harness.connect()
    writer.put_note("hang-6-1.1@n1", b"1")
    assert reader.note_keys("hang-6-1.1") == {"hang-6-1.1@n1"}
    assert reader.note_keys("hang-6-1.2") == frozenset()
    writer.put_note("hang-6-1.1@n2", b"2")
    assert reader.note_keys("hang-6-1.1") == {"hang-6-1.1@n1", "hang-6-1.1@n2"}


def test_notes_are_read_by_topic_and_a_put_replaces_a_note(harness: Harness) -> None:
    store = harness.connect()
    store.put_note("hang-1-1.1@a", b"a")
    store.put_note("hang-1-1.1@b", b"b")
    store.put_note("hang-1-10.1@a", b"other")
    store.put_note("hang-1-1.1@a", b"a again")
    assert store.claim_note("hang-1-1.1@", b"answer") == b"answer"
    assert store.notes("hang-1-1.1") == {
        "hang-1-1.1@a": b"a again",
        "hang-1-1.1@b": b"b",
        "hang-1-1.1@": b"answer",
    }
    assert store.notes("hang-1-1") == {}, "a topic's prefix is no topic"
    assert store.notes("nothing") == {}
    eventually(lambda: store.note_topics() == {"hang-1-1.1", "hang-1-10.1"}, "the topics")
    assert store.note_keys("hang-1-1.1") == {"hang-1-1.1@a", "hang-1-1.1@b"}, "not the answer"


def test_a_forgotten_topic_goes_with_its_notes_and_its_answer(harness: Harness) -> None:
    store, other = harness.connect(), harness.connect()
    store.put_note("hang-1-1.look@a", b"a")
    store.put_note("hang-1-1.look@b", b"b")
    store.claim_note("hang-1-1.look@", b"answer")
    store.put_note("hang-2-1.look@a", b"kept")
    assert other.note_keys("hang-1-1.look") == {"hang-1-1.look@a", "hang-1-1.look@b"}
    store.forget_notes("hang-1-1.look")
    store.forget_notes("hang-1-1.look")
    store.forget_notes("never-written")
    assert other.notes("hang-1-1.look") == {}
    eventually(lambda: other.note_topics() == {"hang-2-1.look"}, "the topic goes")
    eventually(lambda: other.note_keys("hang-1-1.look") == frozenset(), "its follower's keys go")
    assert other.notes("hang-2-1.look") == {"hang-2-1.look@a": b"kept"}
    store.put_note("hang-1-1.look@c", b"again")
    assert other.notes("hang-1-1.look") == {"hang-1-1.look@c": b"again"}
    eventually(
        lambda: other.note_keys("hang-1-1.look") == {"hang-1-1.look@c"}, "written again, told"
    )


def test_the_first_claim_of_a_note_wins_and_every_claimer_learns_it(harness: Harness) -> None:
    stores = [harness.connect() for _ in range(4)]
    with ThreadPoolExecutor(len(stores)) as pool:
        answers = list(
            pool.map(
                lambda pair: pair[1].claim_note("verdict@", f"from {pair[0]}".encode()),
                enumerate(stores),
            )
        )
    assert len(set(answers)) == 1, answers
    assert answers[0] in {f"from {index}".encode() for index in range(len(stores))}
    assert stores[0].claim_note("verdict@", b"too late") == answers[0]
    assert stores[1].notes("verdict") == {"verdict@": answers[0]}
    eventually(lambda: stores[2].note_topics() == {"verdict"}, "an answer's topic is a topic")


def test_notes_go_with_the_closed_job_and_none_is_written_after(harness: Harness) -> None:
    store, other = harness.connect(), harness.connect()
    store.put_note("hang-1-1.1@a", b"a")
    store.claim_note("hang-1-1.2@", b"answer")
    assert other.note_keys("hang-1-1.1") == {"hang-1-1.1@a"}
    store.close_job()
    assert other.notes("hang-1-1.1") == {}
    assert other.notes("hang-1-1.2") == {}
    eventually(lambda: other.note_topics() == frozenset(), "the topics go")
    eventually(lambda: other.note_keys("hang-1-1.1") == frozenset(), "the keys go")
    with pytest.raises(RendezvousClosedError, match="'job' is closed"):
        other.put_note("hang-1-1.1@b", b"b")
    with pytest.raises(RendezvousClosedError, match="'job' is closed"):
        other.put_note("hang-1-1.3@b", b"b")
    with pytest.raises(RendezvousClosedError, match="'job' is closed"):
        other.claim_note("hang-1-1.1@", b"verdict")
    assert other.notes("hang-1-1.1") == {}


@pytest.mark.parametrize(
    "key",
    ["", "a/b", ".", "..", "@x", "x" * 201, "é", "verdict", "a@.", "a@@", "a@" + "x" * 199],
)
def test_a_note_key_no_store_can_hold_is_refused_with_the_key(harness: Harness, key: str) -> None:
    store = harness.connect()
    sentence = re.escape(f"Note key {key[:80]!r} is not usable")
    with pytest.raises(RendezvousError, match=sentence):
        store.put_note(key, b"x")
    with pytest.raises(RendezvousError, match=sentence):
        store.claim_note(key, b"x")


def test_on_zookeeper_a_topics_notes_are_listed_by_its_follower_alone(
    private_zookeeper: str,
) -> None:
    """Every connection lists the topics (one name a topic); only a topic's follower watches
    its notes. When every connection listed every note after each burst, a hang's evidence
    from 4,096 nodes was O(N²) bytes from the ensemble at once. The server itself counts the
    watches (``mntr``)."""
    harness = ZooKeeperHarness(private_zookeeper)
    client = open_client(harness.address, SECRET, SESSION)
    try:
        writers = [harness.connect() for _ in range(3)]
        follower = harness.connect()
        for index, writer in enumerate(writers):
            writer.put_note(f"hang-1-1.look@n{index}", b"evidence")
        stores = [*writers, follower]
        eventually(lambda: all(s.note_topics() == {"hang-1-1.look"} for s in stores), "topics")
        notes = f"{harness.address.job_path('job')}/notes"
        assert client.get_children(notes) == ["hang-1-1.look"], "what every connection lists"
        before = _watches(private_zookeeper)
        keys = {f"hang-1-1.look@n{index}" for index in range(3)}
        assert follower.note_keys("hang-1-1.look") == keys
        assert _watches(private_zookeeper) == before + 1, "the follower's watch on the topic"
    finally:
        client.stop()
        client.close()
        harness.close()


def _watches(hosts: str) -> int:
    host, port = hosts.rsplit(":", 1)
    return int(fourletter.parse_mntr(fourletter.ask(host, int(port), "mntr"))["zk_watch_count"])


# --- marks ---------------------------------------------------------------------------------


def test_a_mark_fenced_by_the_current_token_is_kept_and_leaves_the_token_as_it_was(
    harness: Harness,
) -> None:
    store, other = harness.connect(), harness.connect()
    _, token, _ = store.set_state(b"round 1", ABSENT)
    assert store.mark(Mark.BACK, 1, "n1", token)
    assert other.mark(Mark.BACK, 1, "n2", token), "marks of one round never race each other"
    assert store.mark(Mark.BACK, 1, "n1", token), "marking again changes nothing"
    assert other.marks(Mark.BACK, 1) == {"n1", "n2"}
    assert other.marks(Mark.DONE, 1) == frozenset()
    assert other.marks(Mark.BACK, 2) == frozenset()
    assert store.set_state(b"round 2", token)[2], "the marks left the token as it was"


def test_a_mark_fenced_by_a_token_the_state_has_moved_past_is_refused(harness: Harness) -> None:
    store, other = harness.connect(), harness.connect()
    _, stale, _ = store.set_state(b"round 1", ABSENT)
    _, token, _ = other.set_state(b"round 2", stale)
    assert not store.mark(Mark.BACK, 1, "n1", stale)
    assert not store.mark(Mark.DONE, 1, "n1", stale)
    assert not store.mark(Mark.BACK, 1, "n1", ABSENT), "ABSENT fences nothing"
    assert other.marks(Mark.BACK, 1) == frozenset()
    assert other.marks(Mark.DONE, 1) == frozenset()
    assert store.mark(Mark.DONE, 2, "n1", token)


def test_no_mark_is_written_before_the_state_exists(harness: Harness) -> None:
    store = harness.connect()
    assert not store.mark(Mark.BACK, 0, "n1", ABSENT)
    assert not store.mark(Mark.BACK, 0, "n1", 0)
    assert store.marks(Mark.BACK, 0) == frozenset()


def test_a_back_mark_dies_with_its_connection_and_a_done_mark_stays(harness: Harness) -> None:
    mortal, other = harness.connect(), harness.connect()
    _, token, _ = other.set_state(b"round 1", ABSENT)
    assert mortal.mark(Mark.BACK, 1, "mortal", token)
    assert mortal.mark(Mark.DONE, 1, "mortal", token)
    assert other.mark(Mark.BACK, 1, "survivor", token)
    mortal.release()
    eventually(lambda: other.marks(Mark.BACK, 1) == {"survivor"}, "the released back mark go")
    assert other.marks(Mark.DONE, 1) == {"mortal"}


def test_a_back_mark_of_an_older_connection_is_taken_over_under_the_fence(
    harness: Harness,
) -> None:
    old, new = harness.connect(), harness.connect()
    _, stale, _ = old.set_state(b"round 1", ABSENT)
    assert old.mark(Mark.BACK, 1, "n1", stale)
    _, token, _ = new.set_state(b"round 2", stale)
    assert not new.mark(Mark.BACK, 1, "n1", stale), "taken over only under the fence"
    assert new.mark(Mark.BACK, 1, "n1", token)
    old.release()
    # The mark is the new connection's now: it outlives the old one.
    assert new.marks(Mark.BACK, 1) == {"n1"}


class MarksRecorder:
    """A subscriber that reads the marks it follows each time it is called: seeing a set of
    marks proves a call that came after the change that made it."""

    def __init__(self, store: Store, kind: Mark, round_number: int) -> None:
        self.store, self.kind, self.round_number = store, kind, round_number
        self.heard = threading.Condition()
        self.seen: list[frozenset[str]] = []
        store.subscribe(self.on_change, lambda: None)
        store.follow_marks(kind, round_number)

    def on_change(self) -> None:
        try:
            marks = self.store.marks(self.kind, self.round_number)
        except RendezvousError:
            # The store went away as the test ended (a local one's server stops first), and
            # a last change was still being delivered: nothing is waiting for it. A read that
            # failed during the test leaves ``was_told`` waiting, and the test fails there.
            return
        with self.heard:
            self.seen.append(marks)
            self.heard.notify_all()

    def was_told(self, marks: set[str]) -> bool:
        with self.heard:
            return self.heard.wait_for(lambda: marks in self.seen, DEADLINE)


def test_a_follower_of_a_rounds_marks_is_told_as_they_come_and_go(harness: Harness) -> None:
    proposer, mortal, other = harness.connect(), harness.connect(), harness.connect()
    _, token, _ = proposer.set_state(b"round 1", ABSENT)
    recorder = MarksRecorder(proposer, Mark.BACK, 1)
    assert mortal.mark(Mark.BACK, 1, "mortal", token)
    assert recorder.was_told({"mortal"})
    assert other.mark(Mark.BACK, 1, "n2", token)
    assert recorder.was_told({"mortal", "n2"})
    mortal.release()
    assert recorder.was_told({"n2"}), "the mark that died with its connection"


def test_a_follower_of_the_next_round_is_told_of_its_marks(harness: Harness) -> None:
    proposer, other = harness.connect(), harness.connect()
    _, token, _ = proposer.set_state(b"round 1", ABSENT)
    MarksRecorder(proposer, Mark.DONE, 1)
    recorder = MarksRecorder(proposer, Mark.DONE, 2)
    assert other.mark(Mark.DONE, 2, "n1", token)
    assert recorder.was_told({"n1"})
    assert other.mark(Mark.DONE, 2, "n2", token)
    assert recorder.was_told({"n1", "n2"})


def test_a_connection_sees_its_own_mark_at_once_and_the_others_once_told(
    harness: Harness,
) -> None:
    """``seen_marks`` is what a waiting agent decides on at every step: its own mark must be
    in it as soon as it is written (else it would mark again and again), the others' by the
    time the push that tells of them has come."""
    store, other = harness.connect(), harness.connect()
    _, token, _ = store.set_state(b"round 1", ABSENT)
    assert store.seen_marks(Mark.BACK, 1) == frozenset()
    heard = threading.Event()
    store.subscribe(heard.set, lambda: None)
    assert store.mark(Mark.BACK, 1, "n1", token)
    assert store.seen_marks(Mark.BACK, 1) == {"n1"}
    heard.clear()
    assert other.mark(Mark.BACK, 1, "n2", token)
    eventually(lambda: store.seen_marks(Mark.BACK, 1) == {"n1", "n2"}, "the other's mark")
    assert heard.wait(DEADLINE), "and the follower was told"
    assert store.seen_marks(Mark.BACK, 2) == frozenset(), "another round has marks of its own"
    other.release()
    eventually(lambda: store.seen_marks(Mark.BACK, 2) == frozenset(), "round 2 followed")
    eventually(lambda: store.seen_marks(Mark.BACK, 1) == {"n1"}, "the released mark goes")


def test_forgotten_rounds_lose_their_marks_and_tables_and_later_rounds_keep_theirs(
    harness: Harness,
) -> None:
    store = harness.connect()
    _, token, _ = store.set_state(b"state", ABSENT)
    digests = []
    for round_number in (1, 2, 3):
        assert store.mark(Mark.BACK, round_number, "n1", token)
        assert store.mark(Mark.DONE, round_number, "n1", token)
        digests.append(store.put_table(round_number, b"n1"))
    store.forget_rounds(3)
    store.forget_rounds(3)
    for kind in Mark:
        assert [store.marks(kind, r) for r in (1, 2, 3)] == [set(), set(), {"n1"}]
    assert [store.table(r, digest) for r, digest in zip((1, 2, 3), digests, strict=True)] == [
        None,
        None,
        b"n1",
    ]


def test_marks_go_with_the_closed_job_and_none_is_written_after(harness: Harness) -> None:
    store, other = harness.connect(), harness.connect()
    _, token, _ = store.set_state(b"state", ABSENT)
    assert store.mark(Mark.DONE, 1, "n1", token)
    store.close_job()
    assert other.marks(Mark.DONE, 1) == frozenset()
    for kind in Mark:
        with pytest.raises(RendezvousClosedError, match="'job' is closed"):
            other.mark(kind, 1, "n2", token)
    other.forget_rounds(5)


# --- round tables --------------------------------------------------------------------------


def test_a_table_is_named_by_its_digest_and_read_by_every_connection(harness: Harness) -> None:
    writer, reader = harness.connect(), harness.connect()
    table = b"n3,n1,n2"
    digest = writer.put_table(7, table)
    assert digest == hashlib.sha256(table).hexdigest()
    assert reader.table(7, digest) == table
    assert reader.table(8, digest) is None, "a table belongs to its round"
    assert reader.table(7, hashlib.sha256(b"other").hexdigest()) is None
    assert reader.table(7, "../../state") is None, "a digest names nothing else"
    writer.release()
    assert reader.table(7, digest) == table, "a table outlives its writer"


def test_two_proposers_of_one_round_keep_two_tables_and_a_repeat_changes_nothing(
    harness: Harness,
) -> None:
    one, two = harness.connect(), harness.connect()
    first, second = one.put_table(3, b"a,b"), two.put_table(3, b"b,a")
    assert one.put_table(3, b"a,b") == first
    assert (two.table(3, first), one.table(3, second)) == (b"a,b", b"b,a")


LARGE_TABLES = {
    "records": b",".join(f"node-{index:05d}-{'x' * 140}".encode() for index in range(16_384)),
    "noise": random.Random(7).randbytes(2**21 + 12_345),
}
"""Past the 1 MB that one ZooKeeper request may carry: 16,384 members of ~150 bytes each, and
bytes that no compression makes smaller."""


@pytest.mark.parametrize("kind", sorted(LARGE_TABLES))
def test_a_table_larger_than_one_zookeeper_request_reads_back_whole(
    harness: Harness, kind: str
) -> None:
    table = LARGE_TABLES[kind]
    assert len(table) > 2**21
    digest = harness.connect().put_table(1, table)
    assert harness.connect().table(1, digest) == table


def test_tables_go_with_the_closed_job_and_none_is_written_after(harness: Harness) -> None:
    store, other = harness.connect(), harness.connect()
    digest = store.put_table(1, b"n1")
    store.close_job()
    assert other.table(1, digest) is None
    with pytest.raises(RendezvousClosedError, match="'job' is closed"):
        other.put_table(2, b"n1")


@pytest.mark.parametrize("node_id", ["", "a/b", ".", "..", "x" * 201])
def test_a_node_id_no_store_can_mark_is_refused_with_the_id(harness: Harness, node_id: str) -> None:
    store = harness.connect()
    _, token, _ = store.set_state(b"state", ABSENT)
    with pytest.raises(RendezvousError, match=re.escape(f"Node id {node_id[:80]!r} cannot")):
        store.mark(Mark.BACK, 1, node_id, token)


# --- the in-memory store's controls, which the simulator drives ----------------------------


def test_a_memory_session_not_touched_within_its_timeout_expires_on_tick() -> None:
    clock = ManualClock()
    server = MemoryServer(clock)
    quiet, busy = server.connect(session_timeout=2.0), server.connect(session_timeout=2.0)
    quiet_recorder = Recorder(quiet)
    quiet.join("quiet", b"{}")
    busy.join("busy", b"{}")
    clock.advance(1.5)
    busy.touch()
    clock.advance(1.0)
    assert server.tick() == [quiet]
    assert server.member_ids == {"busy"}
    assert busy.alive() == {"busy"}
    assert quiet_recorder.lost.is_set()
    assert quiet_recorder.states == [ConnectionState.LOST, ConnectionState.CONNECTED]
    quiet.join("quiet", b"{}")
    assert server.member_ids == {"busy", "quiet"}, "a new session may join again"


def cut_off_member() -> tuple[ManualClock, MemoryServer, MemoryStore, MemoryStore, Recorder]:
    """Two connections with 2 s sessions; member ``n1`` joined on the first, which is then
    cut off (``disconnect``), as a network partition would; the clock has not moved."""
    clock = ManualClock()
    server = MemoryServer(clock)
    store, other = server.connect(session_timeout=2.0), server.connect(session_timeout=2.0)
    recorder = Recorder(store)
    store.join("n1", b"{}")
    store.disconnect()
    return clock, server, store, other, recorder


def test_a_cut_off_memory_connection_is_suspended_and_resumes_its_session_in_time() -> None:
    clock, server, store, other, recorder = cut_off_member()
    assert recorder.states == [ConnectionState.SUSPENDED]
    with pytest.raises(RendezvousError, match="out of reach"):
        store.is_closed()
    other.set_state(b"while away", ABSENT)
    assert store.get_state() == (None, ABSENT), "a cut-off connection hears nothing"
    clock.advance(1.9)
    other.touch()
    assert server.tick() == []
    store.reconnect()
    assert recorder.states == [ConnectionState.SUSPENDED, ConnectionState.CONNECTED]
    assert store.get_state() == (b"while away", 0), "watches fire again on reconnect"
    assert server.member_ids == {"n1"}
    assert not recorder.lost.is_set()


def test_a_memory_connection_cut_off_past_its_timeout_is_lost_on_reconnect() -> None:
    clock, server, store, other, recorder = cut_off_member()
    clock.advance(2.5)
    other.touch()
    assert server.tick() == [store]
    assert other.alive() == frozenset(), "the others see the member go at expiry"
    assert recorder.states == [ConnectionState.SUSPENDED], "the owner learns only on reconnect"
    store.reconnect()
    assert recorder.states == [
        ConnectionState.SUSPENDED,
        ConnectionState.LOST,
        ConnectionState.CONNECTED,
    ]
    assert recorder.lost.is_set()


def test_late_and_repeated_memory_deliveries_never_turn_a_view_back() -> None:
    held: list[tuple[MemoryStore, Callable[[], None]]] = []
    server = MemoryServer(deliver=lambda store, notification: held.append((store, notification)))
    writer, reader = server.connect(), server.connect()
    recorder = Recorder(reader)
    _, token, _ = writer.set_state(b"one", ABSENT)
    writer.set_state(b"two", token)
    to_reader = [notification for store, notification in held if store is reader]
    assert len(to_reader) == 2
    assert reader.get_state() == (None, ABSENT), "nothing delivered yet"
    to_reader[1]()
    to_reader[0]()
    to_reader[0]()
    assert reader.get_state() == (b"two", 1)
    assert len(recorder.views) == 3, "every delivery calls the subscribers"
    assert {view[0] for view in recorder.views} == {(b"two", 1)}


# --- ZooKeeper's connection states ---------------------------------------------------------


def told_states(recorder: Recorder, count: int) -> bool:
    return len(recorder.states) >= count


def test_a_zookeeper_restart_suspends_and_reconnects_every_agent_without_disturbing_the_round(
    tmp_path: Path, private_zookeeper: str
) -> None:
    """Replaces a test that slept a fixed 2 s after the restart and then asserted that nothing
    had happened: it passed whether or not the clients were back. Here each agent's store
    reports SUSPENDED and then CONNECTED (the same session: LOST would come instead), and only
    once every one has reconnected is the round checked."""
    del private_zookeeper  # Only for its skip-or-fail when ZooKeeper is missing.
    # A session long enough to outlive the restart even on a loaded machine: with 2 s, a server
    # that took longer than that to start again (load average 37) expired the sessions and the
    # clients rightly saw LOST. Expiry is another test's subject; this one is about reconnecting.
    session = 20.0
    server = testing.ZooKeeperServer(tmp_path / "zk")
    server.start()
    address = ZooKeeperAddress.parse(f"{server.hosts}/restart")
    settings = RendezvousSettings(
        run_id="job", nodes=NodeRange(2, 2), last_call=0.3, session_timeout=session
    )
    recorders: list[Recorder] = []
    agents: list[StoreRendezvous] = []
    try:  # From the server's start: a client that failed to connect once left it running (CI).
        for name in "ab":
            store = ZooKeeperStore(open_client(address, SECRET, session), address, "job", SECRET)
            recorders.append(Recorder(store))
            agents.append(StoreRendezvous(settings, NodeInfo(name, "127.0.0.1", 1), store))
        with ThreadPoolExecutor(2) as pool:
            first = list(pool.map(lambda agent: agent.next_round(), agents))
        server.stop()
        for recorder in recorders:
            eventually(partial(told_states, recorder, 1), "SUSPENDED")
            assert recorder.states == [ConnectionState.SUSPENDED]
        server.start()
        for recorder in recorders:
            # ci13 (2026-12-02) once saw no reconnection within 20 s of a serving server, and
            # left nothing to tell why: the states and the server's log go with the failure.
            try:
                eventually(partial(told_states, recorder, 2), "the connection come back")
            except AssertionError as error:
                log = (tmp_path / "zk" / "zk.out").read_text(errors="replace")[-3000:]
                states = [r.states for r in recorders]
                raise AssertionError(f"{error}; states {states}; server log ends:\n{log}") from None
            assert recorder.states == [ConnectionState.SUSPENDED, ConnectionState.CONNECTED]
            assert not recorder.lost.is_set()
        assert not any(agent.changed.is_set() for agent in agents), "training goes on"
        snapshot = agents[0].snapshot()
        assert snapshot is not None
        assert snapshot.round == first[0].number
    finally:
        for agent in agents:
            agent.leave()
        server.stop()


def test_a_connect_attempt_waits_briefly_for_its_answer_and_longer_after_each_miss() -> None:
    waits = [answer_wait(missed, session_timeout=60.0, hosts=1) for missed in range(6)]
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0], "doubled, up to kazoo's own wait"
    assert answer_wait(0, session_timeout=3.0, hosts=3) == 1.0, "never longer than kazoo's"


def test_a_connect_attempt_the_server_never_answers_is_tried_again_long_before_the_session_ends(
    tmp_path: Path, private_zookeeper: str
) -> None:
    """ZooKeeper 3.8.0 leaves a connect request that it reads while starting, before its
    database is loaded, without a reply and its connection open (closing it fails on a null
    database), and kazoo waits the session timeout for that reply: the restart test above saw
    a client come back 20 s after the server (ci13). Here a listener takes the client's next
    attempt once the server is down and never answers it, then the real server starts on the
    port. With a 60 s session, the client is back within the contract's deadline only if it
    gave the silent attempt up by itself."""
    del private_zookeeper  # Only for its skip-or-fail when ZooKeeper is missing.
    server = testing.ZooKeeperServer(tmp_path / "zk")
    server.start()
    address = ZooKeeperAddress.parse(f"{server.hosts}/silent")
    stores: list[ZooKeeperStore] = []
    silent: socket.socket | None = None
    try:
        stores.append(ZooKeeperStore(open_client(address, SECRET, 60.0), address, "job", SECRET))
        recorder = Recorder(stores[0])
        server.stop()
        eventually(partial(told_states, recorder, 1), "SUSPENDED")
        with socket.create_server(("127.0.0.1", server.port)) as hole:
            hole.settimeout(DEADLINE)
            silent, _ = hole.accept()
        assert silent.recv(1024), "the client sent its connect request to the silent listener"
        server.start()
        eventually(partial(told_states, recorder, 2), "the connection come back")
        assert recorder.states == [ConnectionState.SUSPENDED, ConnectionState.CONNECTED]
        assert not recorder.lost.is_set()
    finally:
        for store in stores:
            store.release()
        if silent is not None:
            silent.close()
        server.stop()
