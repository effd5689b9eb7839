"""Caches for the work that every agent of a process does at the same moment.

- ``Memo``: results of functions of large immutable objects, found by the objects' identity;
- ``computed_once``: results of pure functions, found by value, each computed once.

``functools.lru_cache`` computes a missing value in every thread that asks for it before the
first one is done: when a round forms, every connection of a process decodes the new table
at once, and each decoding finds the cache empty. A benchmark's driver of 17 connections
decoded a 4,096-member table 17 times (20 ms each on a quiet core, seconds on a busy one).
``computed_once`` computes it in the first thread that asks; the others wait for its value.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import suppress
from functools import update_wrapper
from typing import Generic, TypeVar, cast

Key = TypeVar("Key", bound=Hashable)
Result = TypeVar("Result")

_MISSING = object()


class _Hashed:
    """A key whose hash is computed once: a tuple of 4,096 members hashes in O(N), and the
    cache looks it up more than once."""

    __slots__ = ("hash", "key")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.hash = hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Hashed):
            return False
        return self.key is other.key or (self.hash == other.hash and self.key == other.key)


class ComputedOnce(Generic[Key, Result]):
    """``function`` of one argument, its last ``size`` results kept, each computed once."""

    def __init__(self, function: Callable[[Key], Result], size: int) -> None:
        self._function = function
        self._size = size
        self._lock = threading.Lock()
        self._results: OrderedDict[_Hashed, Result] = OrderedDict()
        self._kept: tuple[tuple[object, Result], ...] = ()
        """``_results`` as (key, result) pairs, replaced whole under the lock at each change:
        read without it, for the lookup by identity."""
        self._running: dict[_Hashed, threading.Event] = {}
        self.computed = 0
        """How many times ``function`` ran."""
        self.waiting = 0
        """Threads waiting for a result another one computes."""
        update_wrapper(self, function)

    def __call__(self, key: Key) -> Result:
        # The trick: a key asked for again as the very same object (the members of the state
        # every write of a round encodes) is found by a scan of the few kept keys, neither
        # hashed nor compared: a tuple of 4,096 members hashed each member in Python at each
        # write, a sixth of a driver's time in a 4,096-agent round after a loss (py-spy).
        for kept, result in self._kept:
            if kept is key:
                return result
        hashed = _Hashed(key)
        while True:
            # A hit takes no lock: one dict read is atomic under the GIL (``Memo``'s
            # reason: a lock taken by every hit queued a driver's threads behind it).
            kept = self._results.get(hashed, _MISSING)
            if kept is not _MISSING:
                return cast(Result, kept)
            with self._lock:
                running = self._running.get(hashed)
                if running is None:
                    if hashed in self._results:
                        continue  # computed between the read and the lock
                    running = self._running[hashed] = threading.Event()
                    break
                self.waiting += 1
            running.wait()
            with self._lock:
                self.waiting -= 1
        return self._computed(key, hashed, running)

    def _computed(self, key: Key, hashed: _Hashed, running: threading.Event) -> Result:
        """``function(key)``, kept; then whoever waited on ``running`` finds it kept."""
        try:
            result = self._function(key)
        except BaseException:
            # Nothing is kept: each waiter computes it again, and meets the error itself.
            with self._lock:
                del self._running[hashed]
            running.set()
            raise
        with self._lock:
            self.computed += 1
            self._results[hashed] = result
            while len(self._results) > self._size:
                self._results.popitem(last=False)  # the oldest first, used or not
            self._changed()
            del self._running[hashed]
        running.set()
        return result

    def _changed(self) -> None:
        """Under ``_lock``, after ``_results`` changed: the pairs read by identity."""
        self._kept = tuple((hashed.key, result) for hashed, result in self._results.items())

    def remember(self, key: Key, result: Result) -> None:
        """Keep ``result`` as ``function(key)``, known without computing it. A key kept
        already as the very same object is only made the newest, neither hashed nor compared
        again: every connection of a process remembers the members it decoded once, and
        hashing 4,096 of them, then comparing them with an equal tuple, took two fifths of a
        driver's time in a 4,096-agent round after a loss."""
        with self._lock:
            # The trick: a scan of a few keys by identity, where a lookup hashes the key.
            same = next((kept for kept in self._results if kept.key is key), None)
            if same is not None:
                self._results[same] = result
                self._results.move_to_end(same)
                self._changed()
                return
        hashed = _Hashed(key)
        with self._lock:
            # Kept under this very key from now on: a dict keeps the first of equal keys.
            self._results.pop(hashed, None)
            self._results[hashed] = result
            while len(self._results) > self._size:
                self._results.popitem(last=False)
            self._changed()

    def forget(self) -> None:
        """Drop every kept result."""
        with self._lock:
            self._results.clear()
            self._changed()


class Memo(Generic[Result]):
    """The last few results of a function of large immutable objects, found by the objects'
    identity. The trick: a tuple of 4,096 members hashes (and compares) in O(N), while the
    agents sharing a connection decide on the very same objects (the state of their round,
    which ``tables`` fills once, and the store's ``alive``). Each entry keeps its objects,
    so an id is never taken by another object while the entry lives.

    A hit takes no lock: one dict read is atomic under the GIL, and a process deciding for
    hundreds of agents at once queued them on a lock here (140 of 341 threads of a 4,096-agent
    driver, seen by py-spy). The entry used last goes last: each connection of a process
    brings new objects at each change (its ``alive``), and while the oldest went first, used
    or not, the entries of a process's 16 connections pushed out the ones still in use (one
    was computed 16 times in a 4,096-agent bench run, counted)."""

    SIZE = 64
    """A few per connection a process holds: each has its own ``alive``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, ...], tuple[tuple[object, ...], Result]]
        self._entries = OrderedDict()

    def get(self, objects: tuple[object, ...], compute: Callable[[], Result]) -> Result:
        key = tuple(map(id, objects))
        entry = self._entries.get(key)
        if entry is not None:
            # Made the newest without the lock: one call, atomic under the GIL (the keys are
            # tuples of ints, hashed in C); an entry pushed out meanwhile is simply gone.
            with suppress(KeyError):
                self._entries.move_to_end(key)
            return entry[1]
        value = compute()
        with self._lock:
            self._entries[key] = (objects, value)
            while len(self._entries) > self.SIZE:
                self._entries.popitem(last=False)
        return value


def computed_once(size: int) -> Callable[[Callable[[Key], Result]], ComputedOnce[Key, Result]]:
    """Decorate a pure function of one hashable argument: its last ``size`` results are kept,
    and a result asked for by many threads at once is computed by the first of them."""

    def decorate(function: Callable[[Key], Result]) -> ComputedOnce[Key, Result]:
        return ComputedOnce(function, size)

    return decorate
