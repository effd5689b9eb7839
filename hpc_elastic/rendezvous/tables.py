"""The job's state as the agents decide on it: the document, and its round's table of members.

The document (``state.encode``) is a few hundred bytes whatever the job's size; the members of
its round are a table beside it (``Store.put_table``), named by its digest. A round's table
never changes (one commit per round, and a digest per content), so a connection reads it once
and keeps it here: every state of the round (its port, a failure, its end) is filled from
memory, and every agent sharing the connection shares the one copy.

- ``read``: the state of a document, its table fetched if this connection does not hold it
  (or, for a round that only lost members, made from the last one: ``_derived``);
- ``current``: the store's latest state, read again if its table is gone (a view two rounds
  behind, whose table ``forget_rounds`` removed);
- ``write``: a compare-and-set that writes a new round's table first, so that whoever reads
  the commit finds the table it names.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Generic, TypeVar
from weakref import WeakKeyDictionary

from hpc_elastic.errors import RendezvousClosedError, RendezvousError
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import NodeInfo, member_ranks
from hpc_elastic.rendezvous.backend import Store, table_digest
from hpc_elastic.rendezvous.once import Memo

KEPT = 16
"""Tables (and filled states) a connection keeps: a job needs the latest round's, and a few
more spare a lagging agent a second read."""

log = logging.getLogger(__name__)


class MissingTable(RendezvousError):
    """The job's current state names a table the store does not have: it is damaged."""


class UnreadTable(RendezvousError):
    """The store failed to give a round's table (a connection lost meanwhile): try again."""


Key = TypeVar("Key")
Value = TypeVar("Value")


class _Recent(Generic[Key, Value]):
    """The ``KEPT`` values used last, safe to share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: OrderedDict[Key, Value] = OrderedDict()

    def get(self, key: Key) -> Value | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: Key, value: Value) -> None:
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > KEPT:
                self._values.popitem(last=False)


class _Held:
    """What one connection holds of its job's tables."""

    def __init__(self) -> None:
        self.tables: _Recent[str, tuple[NodeInfo, ...]] = _Recent()
        """Digest -> the table's members, decoded once (or made from the last round's): the
        store returns a table only under its own digest."""
        self.states: _Recent[bytes, st.JobState] = _Recent()
        """Document -> the state filled from its table: every agent sharing the connection
        decides on one object, whose ``member_ids`` is computed once."""
        self.reading = threading.Lock()
        """One reader at a time fetches a table and fills a state; the others wait, then find
        its work here. Without it, every agent sharing a connection that met a new round at
        once fetched and decoded the table itself: at 4,096 members, a connection of 64
        agents decoded it dozens of times (0.14 s each)."""
        self.latest: st.JobState | None = None
        """The state of the newest round filled here (``_derived`` starts from it)."""


@dataclass(frozen=True)
class _Made:
    """A table made from the last round's (``_derived``): ``members`` are ``source`` less
    ``gone``, in their order, and their encoding was checked against the digest it is kept
    under."""

    source: tuple[NodeInfo, ...]
    gone: frozenset[str]
    members: tuple[NodeInfo, ...]


_made: _Recent[str, _Made] = _Recent()
"""Digest -> a table made from the last round's, once a process: every connection of a
process makes the same, and their agents then share one tuple, whose ranks and ids are
computed once (found by identity)."""
_GONE: Memo[frozenset[str]] = Memo()
"""The last round's members that do not count now, once for each list of who is alive."""
_made_lock = threading.Lock()
"""Held while a table is made: the connections of a process that meet a loss round at once
wait for the first one's table instead of each making and encoding it."""

_held: WeakKeyDictionary[Store, _Held] = WeakKeyDictionary()
"""Per connection, not per process: each agent of a simulation (or of a benchmark's
driver) reads through its own connection what its own node would read."""
_held_lock = threading.Lock()


def _of(store: Store) -> _Held:
    with _held_lock:
        held = _held.get(store)
        if held is None:
            held = _held[store] = _Held()
        return held


def read(store: Store, data: bytes, *, fetch: bool = True) -> st.JobState | None:
    """The state ``data`` holds, with its members; None if its table is not to be had: gone
    from the store (``current`` reads the state again), or, with ``fetch`` False, not held
    by this process (a watch callback makes no request)."""
    document = st.decode(data)
    if not document.table:
        return document.state
    held = _of(store)
    state = held.states.get(data)
    if state is not None:
        return state
    # A watch callback (``fetch`` False) never waits on a reader's request: it leaves the
    # state to the loop, as it does a table it does not hold.
    if not held.reading.acquire(blocking=fetch):
        return None
    try:
        return held.states.get(data) or _filled(store, held, document, data, fetch)
    finally:
        held.reading.release()


def _filled(
    store: Store, held: _Held, document: st.Document, data: bytes, fetch: bool
) -> st.JobState | None:
    """``read``'s work, under ``held.reading``: the table's members held, made from the last
    round's (``_derived``) or fetched; the state filled with them."""
    members = held.tables.get(document.table)
    fetched: bytes | None = None
    if members is None:
        if not fetch:
            return None
        members = _derived(store, held, document)
        if members is None:
            fetched = _fetched(store, document)
            if fetched is None:
                return None
            members = st.decode_table(fetched)
    state = document.with_members(members)
    if fetched is not None:
        # Kept as its members' encoding and name: a state of the round written later names
        # it without encoding thousands of members (a table made here was encoded to be
        # made, under its members: ``_derived``).
        st.remember_table(state.members, fetched, document.table)
    held.tables.put(document.table, members)
    held.states.put(data, state)
    if held.latest is None or state.round > held.latest.round:
        held.latest = state
    return state


def _derived(store: Store, held: _Held, document: st.Document) -> tuple[NodeInfo, ...] | None:
    """The members of a round that only lost members, made here instead of read: survivors
    keep their order and their records (``st.complete_round``), so the last round's members
    that count now, in that order, are the new table when its size and digest say so. A loss
    then costs no connection the table (N·T served otherwise: 1.2 GB at 4,096 agents with a
    session each), and the members are the very objects of the last round: none decoded
    again, and each connection's tuple of them hashes to the one its encoding is kept under.
    None, and the table is read, when they do not match: a newcomer, or a view of the
    members other than the proposer's."""
    last = held.latest
    if last is None or last.round >= document.state.round:
        return None
    here = st.present(document.state, store.alive())
    # Found by identity: every connection of a process holds the one list (``roster.Shared``).
    gone = _GONE.get((last.member_ids, here), lambda: last.member_ids - here)
    if not gone or len(last.members) - len(gone) != document.size:
        return None
    with _made_lock:
        made = _made.get(document.table)
        # The trick: the very members this process made the table from, less the same ids,
        # are the table made then, checked then against this digest. Found so, it is neither
        # made nor encoded again: each connection encoded its own copy of 4,096 members (and
        # hashed it, to find the encoding kept): a third of a driver's samples after a loss.
        if made is not None and made.source is last.members and made.gone == gone:
            return made.members
        survivors = _without(last.members, gone)
        if table_digest(st.encode_table(survivors)) != document.table:
            return None
        log.debug("made the table of round %d (%d members)", document.state.round, document.size)
        if made is None:
            _made.put(document.table, _Made(last.members, gone, survivors))
            return survivors
        return made.members


def _without(members: tuple[NodeInfo, ...], gone: frozenset[str]) -> tuple[NodeInfo, ...]:
    """``members`` in their order, less ``gone`` (some of them): the runs between the gone
    members' ranks, sliced and joined in C. A test of every member's id, in Python, was a
    seventh of a 16,384-agent driver's time in the round after 1 % were lost."""
    ranks = member_ranks(members)  # found by identity: the round's tuple, ranked once
    runs, start = [], 0
    for rank in sorted(ranks[node_id] for node_id in gone):
        runs.append(members[start:rank])
        start = rank + 1
    runs.append(members[start:])
    return tuple(chain.from_iterable(runs))


def _fetched(store: Store, document: st.Document) -> bytes | None:
    """The table ``document`` names, from the store; its errors but closure are ``UnreadTable``."""
    try:
        table = store.table(document.state.round, document.table)
    except RendezvousClosedError:
        raise
    except RendezvousError as error:
        raise UnreadTable(str(error)) from error
    if table is not None:
        log.debug("read the table of round %d (%d bytes)", document.state.round, len(table))
    return table


def current(
    store: Store, view: tuple[bytes | None, int] | None = None
) -> tuple[st.JobState | None, int]:
    """The store's state (``view``: as already read) and its token; (None, token) if there is
    none. A state whose table is gone is two rounds old (``forget_rounds`` keeps the tables
    of the latest two): a compare-and-set of its own bytes on its stale token cannot win,
    and answers with the state as it is now."""
    data, token = store.get_state() if view is None else view
    while data is not None:
        state = read(store, data)
        if state is not None:
            return state, token
        stale = st.decode(data)
        data, token, won = store.set_state(data, token)
        if won:
            raise MissingTable(
                f"The table of round {stale.state.round} ({stale.table[:12]}...) that the "
                f"job's state names is missing from {store.where}; the job's rendezvous "
                "state is damaged: cancel the job and submit it again."
            )
    return None, token


def write(
    store: Store, new: st.JobState, token: int, *, after: st.JobState | None
) -> tuple[bytes | None, int, bool]:
    """``store.set_state`` of ``new``, decided on ``after`` (None: no state yet). A state
    whose members are not ``after``'s (a new round) has its table written first: a reader
    of the commit must find the table it names. Idempotent, like the table itself."""
    if new.members and (after is None or new.members != after.members or new.round != after.round):
        table = st.encode_table(new.members)
        _of(store).tables.put(store.put_table(new.round, table), new.members)
    return store.set_state(st.encode(new), token)


def update(store: Store, step: Callable[[st.JobState], st.JobState]) -> st.JobState | None:
    """Apply ``step`` to the current state by compare-and-set until it sticks or changes
    nothing; the state then, or None if there is none (the job closed)."""
    state, token = current(store)
    while state is not None:
        new = step(state)
        if new == state:
            return state
        data, token, won = write(store, new, token, after=state)
        if won:
            return new
        state, token = current(store, (data, token))
    return None
