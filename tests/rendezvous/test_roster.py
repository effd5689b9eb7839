"""The roster's rules (``rendezvous/roster.py``): a chain of batches that carries a
connection's members from one list of ``members/`` to the next, and that refuses to carry
whatever it cannot carry exactly."""

from __future__ import annotations

import pytest

from hpc_elastic.rendezvous import roster
from hpc_elastic.rendezvous.roster import Batch, Members, Roster


def members(upto: int, *ids: str) -> Members:
    return Members(frozenset(ids), upto)


def counted(upto: int, cversion: int, *ids: str) -> Members:
    """A list with the ``cversion`` of ``members/`` it was read with: members made and deleted."""
    return Members(frozenset(ids), upto, cversion)


def written(*lists: Members) -> Roster:
    """The roster a sentinel writes that listed ``lists`` in turn, each carried from the last."""
    result = Roster()
    chain: Members | None = None
    for listed in lists:
        advanced = result.advanced(chain, listed)
        assert advanced is not None
        result, chain = advanced, listed
    return result


def test_a_connection_at_a_batchs_start_is_carried_to_the_rosters_end() -> None:
    log = written(members(10, "a", "b", "c"), members(12, "a", "c"), members(15, "a", "c", "d"))
    assert log.carried(members(12, "a", "c")) == members(15, "a", "c", "d")
    assert log.carried(members(10, "a", "b", "c")) == members(15, "a", "c", "d")


def test_a_connection_between_two_batches_is_not_carried_but_lists() -> None:
    """Listed at 11, between the lists at 10 and 12: a member deleted and made again in
    between is in no batch, so no batch can be applied to it."""
    log = written(members(10, "a", "b"), members(12, "a", "b", "c"))
    assert log.carried(members(11, "a")) is None


def test_a_connection_between_the_lists_of_a_batch_of_single_changes_is_carried_exactly() -> None:
    """In a join storm the members change faster than the sentinels list them, and a list a
    connection reads itself falls between two batches: carried when each name in the batch
    changed once, it need not list again at the next batch, and the next."""
    log_lists = (counted(10, 3, "a", "b", "c"), counted(14, 6, "a", "c", "d", "e"))
    log = written(*log_lists)
    after = counted(14, 6, "a", "c", "d", "e")
    assert log.carried(counted(12, 4, "a", "b", "c", "d")) == after, "d made at 12"
    assert log.carried(counted(13, 5, "a", "c", "d")) == after, "then b deleted at 13"
    on = written(*log_lists, counted(20, 8, "a", "c"))
    assert on.carried(counted(12, 4, "a", "b", "c", "d")) == counted(20, 8, "a", "c"), "and on"


def test_a_member_deleted_and_made_again_between_two_lists_keeps_a_list_between_from_carrying() -> (
    None
):
    """b was deleted at 11 and made again at 13: in neither of the batch's sets, and missing
    from the list read at 12. Counted, the batch shows two changes for none of its names."""
    log = written(counted(10, 2, "a", "b"), counted(14, 4, "a", "b"))
    assert log.carried(counted(12, 3, "a")) is None
    assert log.carried(counted(10, 2, "a", "b")) == counted(14, 4, "a", "b"), "from its start"


def test_a_member_made_and_deleted_between_two_lists_keeps_a_list_between_from_carrying() -> None:
    log = written(counted(10, 1, "a"), counted(14, 3, "a"))
    assert log.carried(counted(12, 2, "a", "x")) is None


def test_a_batch_written_from_uncounted_members_carries_only_from_its_start() -> None:
    log = written(members(10, "a", "b"), counted(14, 5, "a", "b", "c"))
    assert log.batches[-1].counted is None
    assert log.carried(counted(12, 4, "a", "b")) is None
    assert log.carried(members(10, "a", "b")) == members(14, "a", "b", "c")


def test_members_carried_keep_the_count_so_a_new_sentinel_writes_counted_batches() -> None:
    log = written(counted(10, 3, "a", "b", "c"), counted(12, 4, "a", "b", "c", "d"))
    carried = log.carried(counted(10, 3, "a", "b", "c"))
    assert carried == counted(12, 4, "a", "b", "c", "d")
    advanced = log.advanced(carried, counted(15, 5, "a", "b", "c", "d", "e"))
    assert advanced is not None
    assert advanced.batches[-1].counted == (4, 5)
    assert advanced.batches[-1].net


def test_a_counted_roster_reads_back_what_was_written_and_an_older_one_still_reads() -> None:
    log = written(counted(10, 2, "a", "b"), counted(12, 3, "a", "b", "c"))
    assert roster.decode(log.encode()) == log
    old = roster.decode(b'[[10, 12, ["c"], []]]')
    assert old == Roster((Batch(10, 12, frozenset({"c"})),))


def test_a_connection_never_listed_is_not_carried() -> None:
    assert written(members(10, "a")).carried(roster.NOBODY) is None


def test_a_connection_as_new_as_the_roster_or_newer_is_left_as_it_is() -> None:
    log = written(members(10, "a"), members(12, "a", "b"))
    assert log.carried(members(12, "a", "b")) == members(12, "a", "b")
    assert log.carried(members(20, "z")) == members(20, "z")


def test_a_writer_that_does_not_know_the_rosters_end_restarts_the_chain() -> None:
    log = written(members(10, "a"))
    advanced = log.advanced(None, members(12, "a", "b"))
    assert advanced is not None
    assert advanced.batches[-1] == Batch(roster.RESTART, 12)
    assert advanced.carried(members(10, "a")) is None, "a restart carries nobody past it"
    assert advanced.carried(members(12, "a", "b")) == members(12, "a", "b")


def test_a_sentinel_that_listed_between_the_others_batches_knows_the_end_from_its_last_read() -> (
    None
):
    """Two sentinels list the same changes at different points. One listed at 11, between
    the other's batches (10 to 12, 12 to 14); what it read last, the members at 12, still
    carries it to the roster's end, so its next batch does not restart the chain."""
    log = written(members(10, "a"), members(12, "a", "b"), members(14, "b"))
    last_read, listed_before, listed_now = members(12, "a", "b"), members(11, "a"), members(15)
    assert log.end([listed_before]) is None
    assert log.end([last_read, listed_before, listed_now]) == members(14, "b")
    advanced = log.advanced(log.end([last_read, listed_before]), listed_now)
    assert advanced is not None
    assert advanced.batches[-1] == Batch(14, 15, left=frozenset({"b"}))


def test_a_list_no_newer_than_the_roster_adds_nothing() -> None:
    log = written(members(10, "a"), members(12, "a", "b"))
    assert log.advanced(members(12, "a", "b"), members(12, "a", "b")) is None
    assert log.advanced(members(12, "a", "b"), members(11, "a")) is None


def test_a_change_too_large_for_one_znode_restarts_the_chain_and_every_connection_lists() -> None:
    everyone = [f"node-{i:0200}" for i in range(roster.LARGEST_BATCH // 200)]
    log = written(members(10))
    advanced = log.advanced(members(10), members(11, *everyone))
    assert advanced is not None
    assert advanced.batches[-1] == Batch(roster.RESTART, 11)
    assert len(advanced.encode()) < 1024 * 1024 / 2


def test_a_large_change_is_carried_once_and_dropped_by_the_next_batch() -> None:
    """Half of a job of 4,096 lost: 2,048 names, carried to every connection in one read, as
    a list would be; the roster does not make every later version carry them again."""
    half = [f"node-{i:04}" for i in range(2048)]
    log = written(members(10, *half, "a"), members(11, "a"), members(12, "a", "b"))
    assert log.carried(members(11, "a")) == members(12, "a", "b")
    assert log.carried(members(10, *half, "a")) is None, "the large batch was dropped"
    assert len(log.encode()) < 100


def test_the_roster_keeps_its_latest_batches_and_a_connection_behind_them_lists() -> None:
    lists = [members(10 + i, *(f"n{j}" for j in range(i))) for i in range(40)]
    log = written(*lists)
    assert len(log.batches) == roster.KEEP_BATCHES
    assert log.carried(lists[-roster.KEEP_BATCHES - 1]) == lists[-1]
    assert log.carried(lists[-roster.KEEP_BATCHES - 2]) is None


def storm(bursts: int, size: int = 400) -> list[Members]:
    """The lists a sentinel reads in a join storm: ``size`` more names at each."""
    joined = [f"node-{i:05}" for i in range(bursts * size)]
    return [members(10 + burst, *joined[: size * burst]) for burst in range(bursts + 1)]


def logs(lists: list[Members]) -> list[Batch]:
    """The log beside the roster that a sentinel wrote ``lists`` into: each batch it added."""
    result, chain, entries = Roster(), None, []
    for listed in lists:
        advanced = result.advanced(chain, listed)
        assert advanced is not None
        result, chain = advanced, listed
        entries.append(result.batches[-1])
    return entries


def test_a_follower_behind_the_batches_the_roster_keeps_is_carried_by_the_log() -> None:
    """In a join storm the sentinels write faster than a loaded follower reads, and its watch
    reads only the newest version: the batches from its point are gone from the roster (it
    keeps 4 KB of older ones), and it listed all N names again. The log has them."""
    lists = storm(5)
    head = written(*lists)
    assert head.carried(lists[1]) is None, "a burst of 400 names is past what the roster keeps"
    assert roster.logged(logs(lists), head).carried(lists[1]) == lists[-1]
    assert roster.logged(logs(lists), head).carried(lists[4]) == lists[-1]


def test_a_gap_in_the_log_leaves_a_follower_before_it_to_list() -> None:
    lists = storm(5)
    entries = logs(lists)
    del entries[2]  # the batch from lists[1] to lists[2] (entries[0] starts the chain)
    rebuilt = roster.logged(entries, written(*lists))
    assert rebuilt.carried(lists[1]) is None
    assert rebuilt.carried(lists[2]) == lists[-1]


def test_the_log_does_not_carry_a_follower_across_a_restart_of_the_chain() -> None:
    lists = storm(3)
    head = Roster((Batch(roster.RESTART, 13),))
    assert roster.logged(logs(lists), head).batches == head.batches
    assert roster.logged(logs(lists), head).carried(lists[1]) is None


def test_a_malformed_log_cannot_loop() -> None:
    head = Roster((Batch(12, 13, joined=frozenset({"b"})),))
    looped = Batch(12, 12, joined=frozenset({"a"}))  # it ends where it starts
    assert roster.logged([looped], head).batches == (looped, *head.batches)


def test_the_roster_reads_back_what_was_written() -> None:
    log = written(members(10, "a", "b"), members(12, "a", "c"))
    assert roster.decode(log.encode()) == log


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"{}",
        b'{"abcd": 1}',
        b"[[1, 2, 3]]",
        b'[["1", 2, [], []]]',
        b"[[1, 2, [3], []]]",
        b"[[1, 2, [], [], 3]]",
        b'[[1, 2, [], [], "3", 4]]',
    ],
)
def test_an_unreadable_roster_is_an_empty_one_and_every_connection_lists(data: bytes) -> None:
    log = roster.decode(data)
    assert log == Roster()
    assert log.carried(members(10, "a")) == members(10, "a")


# --- one copy of each list a process ---------------------------------------------------------
# Every agent of a connection decides on its list, and what is found on a list once is found
# by the list's identity (``once.Memo``): connections of one process that held equal copies
# each paid for their own.

PATH = "/job/members"


def test_equal_lists_of_a_process_share_one_set_of_ids() -> None:
    shared = roster.Shared()
    first, again = members(10, "a", "b"), members(10, "b", "a")
    assert shared.one(PATH, first) is first
    assert shared.one(PATH, again).ids is first.ids


def test_a_list_unlike_the_one_kept_under_its_zxid_is_kept_as_it_is() -> None:
    """An ensemble made again from nothing counts its zxids from the start again."""
    shared = roster.Shared()
    shared.one(PATH, members(10, "a"))
    other = members(10, "b")
    assert shared.one(PATH, other) is other
    assert shared.one(PATH, members(10, "b")).ids is other.ids
    elsewhere = members(10, "b")
    assert shared.one("/other/members", elsewhere) is elsewhere


def test_a_carry_of_the_same_list_by_the_same_batches_is_made_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = roster.Shared()
    log = written(members(10, "a", "b", "c"), members(12, "a", "c"), members(15, "a", "c", "d"))
    start = shared.one(PATH, members(10, "a", "b", "c"))
    made: list[Members] = []
    applied = roster.applied

    def counted(source: Members, batches: tuple[Batch, ...]) -> Members:
        made.append(source)
        return applied(source, batches)

    monkeypatch.setattr(roster, "applied", counted)
    carried = shared.carried(PATH, log, start)
    assert carried == members(15, "a", "c", "d")
    assert shared.carried(PATH, roster.decode(log.encode()), start) is carried, "read again"
    assert made == [start]
    assert carried is not None
    again = shared.carried(PATH, log, members(10, "a", "b", "c"))
    assert again is not None
    assert again.ids is carried.ids, "another copy"


def test_a_carry_of_the_same_list_by_other_batches_is_made_anew() -> None:
    shared = roster.Shared()
    start = shared.one(PATH, members(10, "a", "b"))
    log = written(members(10, "a", "b"), members(12, "a"))
    other = written(members(10, "a", "b"), members(12, "b"))
    assert shared.carried(PATH, log, start) == members(12, "a")
    assert shared.carried(PATH, other, start) == members(12, "b")


def test_a_shared_carry_refuses_what_the_roster_refuses() -> None:
    shared = roster.Shared()
    log = written(members(10, "a", "b"), members(12, "a", "b", "c"))
    assert shared.carried(PATH, log, members(11, "a")) is None
    assert shared.carried(PATH, log, roster.NOBODY) is None
    newer = members(20, "z")
    assert shared.carried(PATH, log, newer) is newer
