"""``computed_once``: the cache that every agent of a process asks at the same moment."""

from __future__ import annotations

import threading
from functools import partial

import pytest
from cluster import wait_until

from hpc_elastic.rendezvous.once import ComputedOnce, Memo, computed_once

DEADLINE = 30.0


class Blocking:
    """A cached function whose calls wait until ``threads - 1`` askers wait on the cache,
    then return their key in a list, or raise ``error``."""

    def __init__(self, threads: int, error: Exception | None = None) -> None:
        self.threads = threads
        self.error = error
        self.calls: list[bytes] = []
        self.cache: ComputedOnce[bytes, object] = computed_once(size=4)(self.function)

    def function(self, key: bytes) -> object:
        self.calls.append(key)
        if len(self.calls) == 1:
            waiters = self.threads - 1
            assert wait_until(lambda: self.cache.waiting == waiters, DEADLINE, interval=0.01)
        if self.error is not None:
            raise self.error
        return [key]

    def ask_at_once(self, key: bytes) -> list[object]:
        """What each of ``threads`` threads got from the cache: a value or an exception."""
        got: list[object] = [None] * self.threads

        def ask(index: int) -> None:
            try:
                got[index] = self.cache(bytes(bytearray(key)))  # equal, not the same object
            except ValueError as error:
                got[index] = error

        askers = [threading.Thread(target=ask, args=(index,)) for index in range(self.threads)]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(DEADLINE)
            assert not asker.is_alive()
        return got


def test_a_value_many_threads_ask_for_at_once_is_computed_by_one_of_them() -> None:
    blocking = Blocking(threads=8)
    got = blocking.ask_at_once(b"table")
    assert blocking.calls == [b"table"]
    assert blocking.cache.computed == 1
    assert got[0] == [b"table"]
    assert all(value is got[0] for value in got)
    assert blocking.cache.waiting == 0


def test_an_error_is_kept_by_nobody_and_met_by_every_thread_that_asked() -> None:
    blocking = Blocking(threads=4, error=ValueError("not a table"))
    got = blocking.ask_at_once(b"garbage")
    assert all(isinstance(value, ValueError) for value in got)
    assert len(blocking.calls) == 4
    assert blocking.cache.computed == 0


def upper_case(size: int) -> tuple[ComputedOnce[str, str], list[str]]:
    """``str.upper`` kept ``size`` results at a time, and the keys it was computed for."""
    calls: list[str] = []

    @computed_once(size=size)
    def upper(key: str) -> str:
        calls.append(key)
        return key.upper()

    return upper, calls


def test_the_oldest_result_goes_first_once_size_are_kept() -> None:
    upper, calls = upper_case(size=2)
    assert [upper("a"), upper("b"), upper("a"), upper("c"), upper("b")] == list("ABACB")
    assert calls == ["a", "b", "c"]  # "a" was asked again, yet it is the oldest
    assert upper("a") == "A"
    assert calls == ["a", "b", "c", "a"]
    upper.forget()
    assert upper("c") == "C"
    assert calls[-1] == "c"


def test_a_remembered_result_is_answered_without_computing_and_ages_like_the_others() -> None:
    upper, calls = upper_case(size=2)
    upper.remember("a", "known")
    assert upper("a") == "known"
    assert (calls, upper.computed) == ([], 0)
    upper("b")
    upper("c")
    assert upper("a") == "A", "the remembered result outlived two newer ones"
    assert calls == ["b", "c", "a"]


@pytest.mark.parametrize("size", [1, 8])
def test_equal_keys_share_a_result(size: int) -> None:
    @computed_once(size=size)
    def length(key: bytes) -> int:
        return len(key)

    assert length(b"x" * 1000) == length(bytes(bytearray(b"x" * 1000))) == 1000
    assert length.computed == 1


class Counted:
    """A key that counts how often it is hashed and compared (equal to any other one)."""

    def __init__(self) -> None:
        self.hashes = 0
        self.compares = 0

    def __hash__(self) -> int:
        self.hashes += 1
        return 7

    def __eq__(self, other: object) -> bool:
        self.compares += 1
        return isinstance(other, Counted)


def test_a_key_remembered_again_as_the_same_object_is_neither_hashed_nor_compared() -> None:
    """Every connection of a process remembers the table of the members it decoded once:
    4,096 of them, which hash and compare in O(N)."""

    @computed_once(size=2)
    def named(key: Counted) -> str:
        return "computed"

    key, equal = Counted(), Counted()
    named.remember(key, "known")
    named(equal)  # a lookup by value: compared with the kept key
    named.remember(object(), "another")  # type: ignore[arg-type]
    before = (key.hashes, key.compares)
    named.remember(key, "known")
    assert (key.hashes, key.compares) == before
    named.remember(object(), "a third")  # type: ignore[arg-type]
    assert named(key) == "known", "remembered again, it did not become the newest"
    assert named.computed == 0


def test_a_key_remembered_in_place_of_an_equal_one_is_then_found_as_the_same_object() -> None:
    """A table read is remembered under its decoded members where an equal tuple (the one it
    was made from) is kept already: the decoded one is kept from then on."""

    @computed_once(size=2)
    def named(key: Counted) -> str:
        return "computed"

    made, decoded = Counted(), Counted()
    named.remember(made, "known")
    named.remember(decoded, "known")
    before = (decoded.hashes, decoded.compares)
    named.remember(decoded, "known")
    assert (decoded.hashes, decoded.compares) == before


def test_a_key_asked_for_again_as_the_same_object_is_neither_hashed_nor_compared() -> None:
    """Every write of a round's state names its table by the digest of the round's members:
    the same tuple of 4,096 of them, asked for again at each write."""

    @computed_once(size=2)
    def named(key: Counted) -> str:
        return "computed"

    key = Counted()
    assert named(key) == "computed"
    named(Counted())  # another key, equal: found by value, and kept no more than once
    before = (key.hashes, key.compares)
    assert named(key) == "computed"
    assert (key.hashes, key.compares) == before
    assert named.computed == 1
    named.forget()
    assert named(key) == "computed"
    assert named.computed == 2, "a forgotten result was still found by identity"


def test_a_memo_keeps_the_entries_used_last_and_lets_the_least_used_go() -> None:
    """Each connection of a process brings a new ``alive`` at each change: an entry its
    agents keep using must not be pushed out by the entries the others make meanwhile."""
    memo: Memo[int] = Memo()
    objects = [frozenset({index}) for index in range(Memo.SIZE + 1)]
    computed: list[int] = []

    def value(index: int) -> int:
        computed.append(index)
        return index

    memo.get((objects[0],), lambda: value(0))
    for index, made in enumerate(objects[1:], start=1):
        assert memo.get((made,), partial(value, index)) == index
        assert memo.get((objects[0],), lambda: value(0)) == 0
    assert computed.count(0) == 1, "the entry used at every step was pushed out"
    memo.get((objects[1],), lambda: value(1))
    assert computed.count(1) == 2, "the entry used least was kept"
