"""The roster on a real ZooKeeper: a job's sentinels list ``members/`` and write each change
into the roster; every other connection learns a loss from it without listing every member,
and a lost sentinel's slot is taken by a connection that follows."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hpc_elastic.rendezvous import roster, zookeeper
from hpc_elastic.rendezvous.zookeeper import ZooKeeperAddress, ZooKeeperStore, open_client

SECRET = "s3cret"
SESSION = 20.0
"""Long: a session here ends only when the test ends it."""
DEADLINE = 30.0


def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


class Job:
    """Stores of one job with one sentinel slot, each on a connection of its own."""

    def __init__(self, hosts: str) -> None:
        self.address = ZooKeeperAddress.parse(f"{hosts}/roster-{uuid.uuid4().hex}")
        self.made: list[ZooKeeperStore] = []

    def open(self, *, listings: list[str] | None = None, sentinels: int = 1) -> ZooKeeperStore:
        """A store; ``listings`` collects the paths its connection lists."""
        client = open_client(self.address, SECRET, SESSION)
        if listings is not None:
            listing = client.get_children

            def noted(path: str, *args: Any, **kwargs: Any) -> Any:
                listings.append(path)
                return listing(path, *args, **kwargs)

            client.get_children = noted
        store = ZooKeeperStore(client, self.address, "job", SECRET, sentinels=sentinels)
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
def job(private_zookeeper: str) -> Iterator[Job]:
    made = Job(private_zookeeper)
    yield made
    made.release()


def test_a_follower_learns_of_a_loss_from_the_roster_without_listing_the_members(
    job: Job,
) -> None:
    """Every connection listed all N members after each loss: O(N²) bytes from the ensemble
    for the loss of one. A follower reads the few names the roster carries instead."""
    sentinel = job.open()
    assert sentinel.sentinel
    listings: list[str] = []
    follower = job.open(listings=listings)
    assert not follower.sentinel
    members = {name: job.member(name) for name in ("a", "b", "c")}
    eventually(lambda: follower.alive() == {"a", "b", "c"}, "every member shown")
    eventually(follower.alive_is_current, "the list as new as the state")
    listed_before = len(listings)
    members["b"].release()  # its session ends, and the server deletes its member
    eventually(lambda: follower.alive() == {"a", "c"}, "the lost member gone")
    members["d"] = job.member("d")
    eventually(lambda: follower.alive() == {"a", "c", "d"}, "the newcomer shown")
    assert [path for path in listings[listed_before:] if path.endswith("/members")] == []


def test_the_connections_of_a_process_hold_one_list_of_the_members_between_them(
    job: Job,
) -> None:
    """What is found on a list (the round's members alive in it, the proposer, the lost) is
    found once for every agent deciding on the very same list: connections holding copies
    of it each paid for their own."""
    stores = [job.open(), job.open(), job.open()]
    members = {name: job.member(name) for name in ("a", "b", "c")}
    members.pop("b").release()
    for store in stores:
        eventually(lambda store=store: store.alive() == {"a", "c"}, "the lost member gone")  # type: ignore[misc]
    assert stores[0].sentinel
    assert stores[1].alive() is stores[0].alive()
    assert stores[2].alive() is stores[0].alive()


def test_two_sentinels_writing_the_same_changes_keep_the_chain_and_nobody_lists_again(
    job: Job,
) -> None:
    """Both sentinels list every change and race to write it: the loser carries on over what
    the winner wrote, and does not restart the chain (which would have every follower list)."""
    sentinels = [job.open(sentinels=2), job.open(sentinels=2)]
    assert all(store.sentinel for store in sentinels)
    listings: list[str] = []
    follower = job.open(listings=listings, sentinels=2)
    eventually(follower.alive_is_current, "the follower's first list")
    listed_before = len(listings)
    present: dict[str, ZooKeeperStore] = {}
    for step in range(30):  # unawaited, so that the two list at different points
        if step % 3 == 2:
            present.pop(sorted(present)[0]).release()
        else:
            present[f"m{step}"] = job.member(f"m{step}")
    eventually(lambda: follower.alive() == set(present), "every change shown")
    assert [path for path in listings[listed_before:] if path.endswith("/members")] == []


def test_a_lost_sentinels_slot_is_taken_by_a_follower_and_the_members_stay_right(
    job: Job,
) -> None:
    sentinel = job.open()
    followers = [job.open(), job.open(), job.member("a")]
    eventually(lambda: followers[0].alive() == {"a"}, "the member shown")
    sentinel.release()

    def sentinels() -> int:
        return sum(store.sentinel for store in followers)

    eventually(lambda: sentinels() > 0, "the free slot taken")
    assert sentinels() == 1, "one slot, one sentinel"
    job.member("b")
    for store in followers:
        eventually(lambda store=store: store.alive() == {"a", "b"}, "the newcomer shown")  # type: ignore[misc]
        eventually(store.alive_is_current, "the list as new as the state")


def test_a_follower_whose_roster_stays_behind_lists_the_members_itself(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sentinel alive but slow (or cut off) must not keep a follower's list behind its
    state for longer than ``ROSTER_PATIENCE``: it lists the members itself."""
    sentinel = job.open()
    follower = job.open()
    monkeypatch.setattr(sentinel._members, "_write_roster", lambda *_: None)
    job.member("a")
    eventually(lambda: sentinel.alive() == {"a"}, "the sentinel lists the member")
    follower.set_state(b"a state written after the member", -1)
    eventually(lambda: follower.alive() == {"a"}, "the follower lists it itself")
    eventually(follower.alive_is_current, "the list as new as the state")


def test_a_follower_behind_its_state_waits_while_the_roster_moves_on(
    job: Job, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A busy sentinel may write the roster more than ``ROSTER_PATIENCE`` behind a state
    while it still writes (16,384 agents on two cores): every follower listing then would
    read all N names for a loss of a few. A follower lists only when the roster has not
    carried it any further for that long."""
    monkeypatch.setattr(zookeeper, "ROSTER_PATIENCE", 5.0)
    caplog.set_level(logging.DEBUG, logger=zookeeper.__name__)
    sentinel = job.open()
    listings: list[str] = []
    follower = job.open(listings=listings)
    job.member("a")
    eventually(lambda: follower.alive() == {"a"}, "the member shown")
    listed_before = len(listings)
    gates = {"b": threading.Event(), "c": threading.Event()}
    write = sentinel._members._write_roster

    def held(before: Any, listed: Any) -> None:
        gates["c" if "c" in listed.ids else "b"].wait(DEADLINE)
        write(before, listed)

    def logged(what: str) -> Callable[[], bool]:
        """Whether the follower's connection logged ``what`` (each member's connection
        follows the roster too)."""
        return lambda: f"session {follower.session_id[0]:#x}: {what}" in caplog.text

    monkeypatch.setattr(sentinel._members, "_write_roster", held)
    try:
        job.member("b")
        eventually(lambda: sentinel.alive() == {"a", "b"}, "the sentinel lists b; its write waits")
        job.member("c")
        follower.set_state(b"a state written after c joined", -1)
        eventually(logged("the list of"), "the follower waits for the roster")
        gates["b"].set()
        eventually(lambda: follower.alive() == {"a", "b"}, "b carried on")
        eventually(logged("the roster of"), "a patience passed, the roster moved")
        gates["c"].set()
        eventually(lambda: follower.alive() == {"a", "b", "c"}, "c carried on")
        eventually(follower.alive_is_current, "the list as new as the state")
    finally:
        for gate in gates.values():
            gate.set()
    assert [path for path in listings[listed_before:] if path.endswith("/members")] == []


def test_a_follower_that_listed_between_two_batches_is_carried_by_the_next_one(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a join storm the members change faster than the sentinels write, and a follower
    that lists them itself holds a list between two of the roster's lists: each batch after
    that made it list all N names again (17 to 24 times a connection at 16,384 agents). A
    batch whose changes are each in it once carries it instead."""
    monkeypatch.setattr(zookeeper, "ROSTER_PATIENCE", 0.2)
    sentinel = job.open()
    listings: list[str] = []
    follower = job.open(listings=listings)
    job.member("a")
    eventually(lambda: follower.alive() == {"a"}, "the member shown")
    gate = threading.Event()
    write = sentinel._members._write_roster

    def held(before: Any, listed: Any) -> None:
        """The list of a and b is never written; that of a, b and c once the gate opens."""
        if "c" in listed.ids:
            gate.wait(DEADLINE)
            write(before, listed)

    monkeypatch.setattr(sentinel._members, "_write_roster", held)
    try:
        job.member("b")
        eventually(lambda: sentinel.alive() == {"a", "b"}, "the sentinel lists b, unwritten")
        follower.set_state(b"a state written after b joined", -1)
        eventually(lambda: follower.alive() == {"a", "b"}, "the follower lists b itself")
        listed_before = len(listings)
        job.member("c")
        eventually(lambda: sentinel.alive() == {"a", "b", "c"}, "the sentinel lists c")
        gate.set()
        eventually(lambda: follower.alive() == {"a", "b", "c"}, "c carried on")
    finally:
        gate.set()
    assert [path for path in listings[listed_before:] if path.endswith("/members")] == []


def newest_batch(job: Job) -> roster.Batch | None:
    """The newest batch of the job's roster, read by a client of its own."""
    client = open_client(job.address, SECRET, SESSION)
    try:
        data, _ = client.get(f"{job.address.job_path('job')}/roster")
    finally:
        client.stop()
        client.close()
    batches = roster.decode(data).batches
    return batches[-1] if batches else None


def logged_names(job: Job) -> list[str]:
    client = open_client(job.address, SECRET, SESSION)
    try:
        return sorted(client.get_children(f"{job.address.job_path('job')}/roster-log"))
    finally:
        client.stop()
        client.close()


def test_a_follower_that_missed_batches_the_roster_no_longer_keeps_reads_them_from_the_log(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a join storm the sentinels write faster than a loaded follower reads (its watch
    reads only the newest version), and the roster keeps few older batches: a follower that
    fell behind them listed all N names again (5.9 times a connection at 16,384 agents). It
    reads the batches it missed from the log beside the roster instead."""
    monkeypatch.setattr(roster, "KEEP_BYTES", 0)  # the roster keeps its newest batch alone
    job.open()
    listings: list[str] = []
    follower = job.open(listings=listings)
    job.member("a")
    eventually(lambda: follower.alive() == {"a"}, "the member shown")
    listed_before = len(listings)
    watch = follower._members._following
    assert watch is not None
    heard, deaf = watch._on_data, threading.Event()
    deaf.set()

    def loaded(data: bytes | None, asked: int) -> None:
        """The follower reads nothing while it is busy elsewhere."""
        if not deaf.is_set():
            heard(data, asked)

    monkeypatch.setattr(watch, "_on_data", loaded)
    for name in ("b", "c"):
        job.member(name)
        eventually(
            lambda name=name: getattr(newest_batch(job), "joined", None) == {name},  # type: ignore[misc]
            f"{name} written into the roster in a batch of its own",
        )
    deaf.clear()
    job.member("d")
    eventually(lambda: follower.alive() == {"a", "b", "c", "d"}, "the follower carried on")
    assert [path for path in listings[listed_before:] if path.endswith("/members")] == []


def test_the_log_keeps_the_newest_batches_and_a_follower_behind_them_lists(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(roster, "KEEP_BYTES", 0)
    monkeypatch.setattr(roster, "LOG_KEPT", 2)
    job.open()
    follower = job.open()
    job.member("a")
    eventually(lambda: follower.alive() == {"a"}, "the member shown")
    watch = follower._members._following
    assert watch is not None
    monkeypatch.setattr(watch, "_on_data", lambda data, asked: None)  # deaf from here on
    written: dict[str, roster.Batch] = {}
    for name in ("b", "c", "d", "e", "f"):
        job.member(name)
        eventually(
            lambda name=name: getattr(newest_batch(job), "joined", None) == {name},  # type: ignore[misc]
            f"{name} written into the roster in a batch of its own",
        )
        batch = newest_batch(job)
        assert batch is not None
        written[name] = batch
    kept = logged_names(job)
    assert len(kept) < 2 * roster.LOG_KEPT, "pruned every LOG_KEPT batches to the newest"
    assert f"{written['f'].upto:020d}" in kept
    assert f"{written['b'].upto:020d}" not in kept
    head = roster.Roster((written["f"],)).encode()
    assert follower._members._carry_by_log(head) is False, "its point is pruned: it lists"


def test_a_job_made_before_rosters_has_its_members_listed_by_a_read_only_store(job: Job) -> None:
    """A job whose agents predate the roster has no ``roster`` node: ``status`` (a read-only
    store, which creates nothing) lists the members instead of taking the job for empty."""
    job.member("a")
    client = open_client(job.address, SECRET, SESSION)
    try:
        client.delete(f"{job.address.job_path('job')}/roster")
        reader = ZooKeeperStore(client, job.address, "job", SECRET, create=False)
        eventually(lambda: reader.alive() == {"a"}, "the member listed")
    finally:
        client.stop()
        client.close()
