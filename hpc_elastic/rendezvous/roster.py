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
batch's ``since`` applies that batch and every one after it. One that holds them at any other
point (it listed them itself between two batches, or the log moved past it) cannot: a batch
is a difference, and a member deleted and made again in between would be missed. It lists the
members itself, as every connection did at every change before.

The roster keeps its newest batch whatever its size (a join storm's burst, half the job
lost: read once by each connection, as a list would be, but decoded as one JSON document), and
older ones within ``KEEP_BYTES``. A batch larger than ``LARGEST_BATCH`` is written as a
restart of the chain (``since`` of ``RESTART``, no names): every connection lists then, once,
as before. Pure rules; ``zookeeper.py`` reads and writes the znode.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

KEEP_BATCHES = 16
"""Batches the roster keeps: a connection more than this many versions behind lists."""
KEEP_BYTES = 4 * 1024
"""Bytes of names the batches before the newest keep at most: what every connection reads
at every version, beside the newest change."""
LARGEST_BATCH = 512 * 1024
"""Bytes of names one batch may carry: half of ``jute.maxbuffer`` (1 MB by default), which
bounds every znode. A larger change restarts the chain."""
RESTART = -1
"""The ``since`` of a batch that restarts the chain: it names nobody, and only a connection
that listed the members exactly at its ``upto`` can follow on from it."""
UNLISTED = -1
"""The ``upto`` of a connection that never listed the members."""


@dataclass(frozen=True)
class Batch:
    """The members that joined and left between two lists of ``members/``."""

    since: int
    upto: int
    joined: frozenset[str] = frozenset()
    left: frozenset[str] = frozenset()

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
        """``members`` carried on to the roster's ``upto``; ``None`` when the batches do not
        start where ``members`` are (list them instead). Members newer than the roster are
        left as they are."""
        if members.upto >= self.upto:
            return members
        starts = [i for i, batch in enumerate(self.batches) if batch.since == members.upto]
        if members.upto == UNLISTED or not starts:
            return None
        ids = set(members.ids)
        for batch in self.batches[starts[0] :]:
            if batch.since == RESTART:
                return None
            ids -= batch.left
            ids |= batch.joined
        return Members(frozenset(ids), self.upto)

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
            batch = Batch(self.upto, listed.upto, listed.ids - chain.ids, chain.ids - listed.ids)
            if batch.size > LARGEST_BATCH:
                batch = Batch(RESTART, listed.upto)
        return Roster(_kept((*self.batches, batch)))

    def encode(self) -> bytes:
        batches = [
            [batch.since, batch.upto, sorted(batch.joined), sorted(batch.left)]
            for batch in self.batches
        ]
        return json.dumps(batches, separators=(",", ":")).encode()


def decode(data: bytes) -> Roster:
    """The roster in ``data``; an empty or unreadable one is an empty roster, from which every
    connection lists the members itself (only the job's own agents can write it)."""
    try:
        batches = tuple(_batch(item) for item in json.loads(data))
    except (ValueError, TypeError):
        return Roster()
    return Roster(batches)


def _batch(item: list[object]) -> Batch:
    since, upto, joined, left = item
    if not isinstance(since, int) or not isinstance(upto, int):
        raise TypeError(f"a batch's bounds are not numbers: {item!r}")
    return Batch(since, upto, _names(joined), _names(left))


def _names(names: object) -> frozenset[str]:
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"not a list of member ids: {names!r}")
    return frozenset(names)


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
