"""The roster: a short log of membership changes, so that a change costs a connection its size.

Every connection of a job must know who is alive. A children watch on ``members/`` on every
connection made each of them list all N members after every change: O(N) bytes a connection,
O(N²) from the ensemble, for a loss of a few. Instead a few connections, the sentinels, list
``members/`` and write what changed into one small znode, the roster; every other connection
reads the roster at each version and applies it to the members it holds.

A list is named by the ``pzxid`` of ``members/`` it was read at: the zxid of the last member
created or deleted, which ZooKeeper returns with the list and with ``exists``. The roster is a
chain of batches, each the difference between the members at ``since`` and at ``upto``; the
next batch starts where the last one ended. A connection that holds the members at one
batch's ``since`` applies that batch and every one after it. One that holds them at another
point between a batch's ``since`` and ``upto`` (it listed them itself, as in a join storm,
where the members change faster than the sentinels write) may apply it only if every change
in it is in it: a batch is a difference, and a member deleted and made again in between, or
made and deleted again, is in neither of its sets, but the list between may show it wrongly.
So a batch counts its changes: the ``cversion`` of ``members/`` (every child made or deleted
adds one) at both of its lists. When the count is the batch's joined and left together, each
name in it changed once, and any list between is carried exactly. Otherwise, or where the log
moved past it, the connection lists the members itself, as every connection did at every
change before.

The roster keeps its newest batch whatever its size (a join storm's burst, half the job
lost: read once by each connection, as a list would be, but decoded as one JSON document), and
older ones within ``KEEP_BYTES``. A batch larger than ``LARGEST_BATCH`` is written as a
restart of the chain (``since`` of ``RESTART``, no names): every connection lists then, once,
as before. Every batch also goes into a log beside the roster, one znode a batch named by its
``upto``, which keeps the last ``LOG_KEPT``: a follower that fell behind the batches the roster
keeps (its watch reads only the newest version, and in a join storm the sentinels write faster
than a loaded follower reads) reads the ones it missed there (``logged``), and lists only
where the log has a gap. Keeping more batches in the roster itself would have every follower
read them at every version. Pure rules; ``zookeeper.py`` reads and writes the znodes.
``Shared`` keeps one copy of each list for all the connections of a process.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TypeVar, cast

Key = TypeVar("Key")
Value = TypeVar("Value")

KEEP_BATCHES = 16
"""Batches the roster keeps: a connection more than this many versions behind lists."""
KEEP_BYTES = 4 * 1024
"""Bytes of names the batches before the newest keep at most: what every connection reads
at every version, beside the newest change."""
LOG_KEPT = 64
"""Batches the log beside the roster keeps: a follower that missed more lists the members."""
LARGEST_BATCH = 512 * 1024
"""Bytes of names one batch may carry: half of ``jute.maxbuffer`` (1 MB by default), which
bounds every znode. A larger change restarts the chain."""
LARGEST_LOGGED = LARGEST_BATCH // 2
"""Bytes of names of the largest batch that also goes into the log: the roster and the
log's entry are one transaction, which ``jute.maxbuffer`` bounds too. A follower that missed
a larger batch (a quarter of a million bytes of names or more) lists the members."""
RESTART = -1
"""The ``since`` of a batch that restarts the chain: it names nobody, and only a connection
that listed the members exactly at its ``upto`` can follow on from it."""
UNLISTED = -1
"""The ``upto`` of a connection that never listed the members."""
UNCOUNTED = -1
"""The ``cversion`` of members not known to be counted (carried by batches without counts)."""


@dataclass(frozen=True)
class Batch:
    """The members that joined and left between two lists of ``members/``."""

    since: int
    upto: int
    joined: frozenset[str] = frozenset()
    left: frozenset[str] = frozenset()
    counted: tuple[int, int] | None = None
    """The ``cversion`` of ``members/`` at ``since`` and at ``upto``, where the writer knew both."""

    @property
    def net(self) -> bool:
        """Whether every member made or deleted in it is in ``joined`` or ``left``, once: then
        a list read anywhere between its two lists is carried by it exactly."""
        if self.counted is None:
            return False
        since, upto = self.counted
        return upto - since == len(self.joined) + len(self.left)

    def applies_at(self, upto: int) -> bool:
        """Whether it carries a list read at ``upto``: at its start, or between its lists."""
        return self.since == upto or (self.since < upto < self.upto and self.net)

    @property
    def size(self) -> int:
        """Bytes of its names as encoded: each quoted, and a comma."""
        return sum(len(name) + 3 for name in self.joined | self.left)


@dataclass(frozen=True)
class Members:
    """The members as one list of ``members/`` showed them, or as batches carried them on."""

    ids: frozenset[str]
    upto: int
    """The ``pzxid`` of ``members/`` that ``ids`` shows."""
    cversion: int = UNCOUNTED
    """The ``cversion`` of ``members/`` there: how many members were made and deleted."""


NOBODY = Members(frozenset(), UNLISTED)
"""A connection's members before it listed them."""
CLOSED = Members(frozenset(), 2**63 - 1)
"""The members of a closed job: nobody, newer than any list (``close_job`` removes the
members' node, and nothing makes it again)."""


@dataclass(frozen=True)
class Roster:
    batches: tuple[Batch, ...] = ()

    @property
    def upto(self) -> int:
        return self.batches[-1].upto if self.batches else UNLISTED

    def carried(self, members: Members) -> Members | None:
        """``members`` carried on to the roster's ``upto``; ``None`` when no batch carries
        them (``after``: list them instead). Members newer than the roster are left as they
        are."""
        if members.upto >= self.upto:
            return members
        batches = self.after(members)
        return None if batches is None else applied(members, batches)

    def after(self, members: Members) -> tuple[Batch, ...] | None:
        """The batches that carry ``members``, older than the roster, to its end: from the
        one that starts where they are, or that holds them between its lists and is ``net``;
        ``None`` when there is none, or the chain restarts on the way."""
        if members.upto == UNLISTED:
            return None
        starts = [i for i, batch in enumerate(self.batches) if batch.applies_at(members.upto)]
        if not starts:
            return None
        batches = self.batches[starts[0] :]
        return None if any(batch.since == RESTART for batch in batches) else batches

    def end(self, known: Iterable[Members]) -> Members | None:
        """The members at the roster's end, from the first of ``known`` that it carries
        there exactly; ``None`` if none."""
        for members in known:
            carried = self.carried(members)
            if carried is not None and carried.upto == self.upto:
                return carried
        return None

    def advanced(self, chain: Members | None, listed: Members) -> Roster | None:
        """The roster with what ``listed`` adds to it, or ``None`` when it adds nothing.
        ``chain``: the members at the roster's ``upto``, if the writer knows them; without,
        the batch restarts the chain."""
        if listed.upto <= self.upto:
            return None
        if chain is None or chain.upto != self.upto:
            batch = Batch(RESTART, listed.upto)
        else:
            counted = (chain.cversion, listed.cversion)
            batch = Batch(
                self.upto,
                listed.upto,
                listed.ids - chain.ids,
                chain.ids - listed.ids,
                None if UNCOUNTED in counted else counted,
            )
            if batch.size > LARGEST_BATCH:
                batch = Batch(RESTART, listed.upto)
        return Roster(_kept((*self.batches, batch)))

    def encode(self) -> bytes:
        batches = [
            [batch.since, batch.upto, sorted(batch.joined), sorted(batch.left)]
            + ([] if batch.counted is None else list(batch.counted))
            for batch in self.batches
        ]
        return json.dumps(batches, separators=(",", ":")).encode()


def applied(members: Members, batches: tuple[Batch, ...]) -> Members:
    """``members`` carried by ``batches`` (``Roster.after``) to the last one's ``upto``."""
    ids = set(members.ids)
    for batch in batches:
        ids -= batch.left
        ids |= batch.joined
    last = batches[-1]
    return Members(
        frozenset(ids), last.upto, UNCOUNTED if last.counted is None else last.counted[1]
    )


def decode(data: bytes) -> Roster:
    """The roster in ``data``; an empty or unreadable one is an empty roster, from which every
    connection lists the members itself (only the job's own agents can write it)."""
    try:
        batches = tuple(_batch(item) for item in json.loads(data))
    except (ValueError, TypeError):
        return Roster()
    return Roster(batches)


def _batch(item: list[object]) -> Batch:
    since, upto, joined, left, *counted = item  # no counts: written before batches had them
    if not all(isinstance(number, int) for number in (since, upto, *counted)):
        raise TypeError(f"a batch's bounds are not numbers: {item!r}")
    if len(counted) not in (0, 2):
        raise TypeError(f"a batch's counts are not two numbers: {item!r}")
    at_since, at_upto = counted or (None, None)
    return Batch(
        cast(int, since),
        cast(int, upto),
        _names(joined),
        _names(left),
        None if at_since is None else (cast(int, at_since), cast(int, at_upto)),
    )


def _names(names: object) -> frozenset[str]:
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"not a list of member ids: {names!r}")
    return frozenset(names)


def logged(entries: Iterable[Batch], head: Roster) -> Roster:
    """``head`` with the batches of the log before its own, as one chain: from its first
    batch back, each logged batch that ends where the next one starts. A gap (a batch pruned
    from the log, or never written to it) or a restart of the chain ends it there, and a
    connection whose list is older lists the members."""
    by_upto = {batch.upto: batch for batch in entries}
    chain = list(head.batches)
    # Each batch taken from the log is popped, so a malformed log cannot loop.
    while chain and chain[0].since != RESTART and chain[0].since in by_upto:
        chain.insert(0, by_upto.pop(chain[0].since))
    return Roster(tuple(chain))


def _kept(batches: Iterable[Batch]) -> tuple[Batch, ...]:
    """The newest batch, and those before it within ``KEEP_BATCHES`` and ``KEEP_BYTES``."""
    newest, *older = reversed(tuple(batches))
    kept = [newest]
    size = 0
    for batch in older:
        size += batch.size
        if len(kept) == KEEP_BATCHES or size > KEEP_BYTES:
            break
        kept.append(batch)
    return tuple(reversed(kept))


class Shared:
    """The lists of members a process holds: one object for each list, however many of its
    connections hold it, and each carry by the roster made once.

    Every agent decides on its connection's members: which of its round's members are alive
    (``state.unlisted``, ``state.stragglers``), who proposes, who was lost. Those are found
    once for all the agents deciding on the very same objects (``once.Memo``), but each
    connection held its own copy of the same list. At 16,384 agents, 64 to a connection and
    16 connections to a benchmark's driver, each driver intersected each round's members with
    16 copies of each list: a quarter of its time in the round after 1 % were lost (py-spy).

    Shared by content, not by name alone: a list is given the object of an equal one kept
    under the same ``members/`` path and ``upto`` (compared once, when a connection first
    meets it; an ensemble made again from nothing reuses zxids), and a carry of the very same
    object by equal batches is equal whatever the ensemble.
    """

    SIZE = 16
    """Lists and carries kept: a few versions of the members of a few jobs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lists: OrderedDict[tuple[str, int], Members] = OrderedDict()
        self._carries: OrderedDict[tuple[int, int], tuple[Members, tuple[Batch, ...], Members]]
        self._carries = OrderedDict()

    def one(self, path: str, members: Members) -> Members:
        """``members``, with the ids of an equal list kept for ``path``; kept from now on."""
        key = (path, members.upto)
        with self._lock:
            kept = self._lists.get(key)
        if kept is not None and kept.ids is members.ids:
            return members
        if kept is not None and kept.ids == members.ids:
            return replace(members, ids=kept.ids)
        with self._lock:
            self._keep(self._lists, key, members)
        return members

    def carried(self, path: str, log: Roster, members: Members) -> Members | None:
        """``log.carried(members)``, made once a process and shared (``one``)."""
        if members.upto >= log.upto:
            return members
        batches = log.after(members)
        if batches is None:
            return None
        key = (id(members.ids), batches[-1].upto)
        with self._lock:
            made = self._carries.get(key)
        # The entry keeps its source, so the id in its key names no other object meanwhile;
        # a carry is a function of the source's ids and the batches alone (``applied``).
        if made is not None and made[0].ids is members.ids and made[1] == batches:
            return made[2]
        result = self.one(path, applied(members, batches))
        with self._lock:
            self._keep(self._carries, key, (members, batches, result))
        return result

    def _keep(self, kept: OrderedDict[Key, Value], key: Key, value: Value) -> None:
        """Under the lock: ``value`` kept under ``key`` as the newest, the oldest dropped."""
        kept[key] = value
        kept.move_to_end(key)
        while len(kept) > self.SIZE:
            kept.popitem(last=False)


SHARED = Shared()
"""The process's lists of members."""
