"""The small interface a rendezvous needs from where its state lives (ZooKeeper, or a fake).

Modelled on torch's ``RendezvousBackend``: one opaque state blob written by compare-and-set,
plus what torch lacks: ephemeral membership and change notifications pushed by the store,
so nobody polls. A store serves one job and may be shared by several node handlers (the
benchmark multiplexes hundreds of simulated nodes over a few connections).
"""

from __future__ import annotations

import enum
import hashlib
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TypeVar

from hpc_elastic.errors import RendezvousError

ABSENT = -1
"""The token of a state that does not exist yet: ``set_state`` with it creates the state."""

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@=+:-]{0,199}")
"""A node id, or one znode name on ZooKeeper (no '/', never '.' or '..'), short and printable."""

NOTE_SEPARATOR = "@"
"""Between a note's topic and the id of the node that wrote it: ``<topic>@<node_id>``. A
topic's answer (``claim_note``) is keyed by the topic and the separator alone."""

_NOTE_KEY = re.compile(
    r"(?=.{2,200}$)[A-Za-z0-9_][A-Za-z0-9_.=+:-]*@([A-Za-z0-9_][A-Za-z0-9_.@=+:-]*)?"
)
"""A note's key: a topic (no '@'), the separator, and a node id or nothing."""


def check_note_key(key: str) -> str:
    """``key`` if it can name a note on every store, else a RendezvousError that quotes it."""
    if not _NOTE_KEY.fullmatch(key):
        raise RendezvousError(
            f"Note key {key[:80]!r} is not usable; give '<topic>@<node id>' or '<topic>@' in "
            "up to 200 letters, digits or '_.@=+:-', the topic without '@', neither starting "
            "with one of '.@=+:-'."
        )
    return key


def note_topic(key: str) -> str:
    """The topic of a note's key (``check_note_key``)."""
    return key.partition(NOTE_SEPARATOR)[0]


def check_node_id(node_id: str) -> str:
    """``node_id`` if it can name a member's mark on every store (one znode name), else a
    RendezvousError that quotes it."""
    if not _NAME.fullmatch(node_id):
        raise RendezvousError(
            f"Node id {node_id[:80]!r} cannot name a mark; node ids are 1 to 200 letters, "
            "digits or '_.@=+:-' (as `NodeInfo.new` makes them)."
        )
    return node_id


class Mark(enum.Enum):
    """What a member records about itself in one round, as a small record of its own beside
    the state instead of a field inside it.

    Inside the state, each member's mark is a compare-and-set of the whole state, which all
    the members race and every agent reads again: O(N) versions of an O(N) state a round. As
    records of their own, marks never change the state's token, so N marks are N writes that
    race nobody, and only whoever decides the round needs to read them
    (docs/rendezvous.md, "A layout for thousands of nodes").
    """

    BACK = "back"
    """"I am back in ``next_round`` after this round" (the state's ``ready``). It vanishes
    with its writer's session, as a membership does: a mark of a dead agent must not count."""
    DONE = "done"
    """"My workers of this round all succeeded" (the state's ``succeeded``). It stays: the
    round may end after its writer's session does."""

    @property
    def ephemeral(self) -> bool:
        """Whether the mark vanishes with the session that wrote it."""
        return self is Mark.BACK


def table_digest(table: bytes) -> str:
    """The name of a round's table (``Store.put_table``): its sha256, in hex."""
    return hashlib.sha256(table).hexdigest()


Owner = TypeVar("Owner")


def place_mark(
    marked: dict[str, Owner], kind: Mark, node_id: str, writer: Owner, *, fenced: bool
) -> bool:
    """``Store.mark``'s rule, for a store that keeps a round's marks of one kind in ``marked``
    (node id -> the session or connection that wrote it): a mark that is there stays, and
    counts as written; otherwise it is written only under the fence (``fenced``: the state
    exists and still has the caller's token). A ``BACK`` mark of another writer is taken over
    only under the fence, as ZooKeeper's ``multi(check, delete, create)`` does."""
    owner = marked.get(node_id)
    if owner is not None and (owner is writer or not kind.ephemeral):
        return True  # Idempotent: the mark is there, whatever the state did since.
    if fenced:
        marked[node_id] = writer
    return fenced


class ConnectionState(enum.Enum):
    """What a connection knows about its session, as ZooKeeper's clients report it.

    The agent needs the middle one: a node cut off from the store is only SUSPENDED, and it
    cannot know whether its session (and so its membership) still exists. Once SUSPENDED has
    lasted longer than the session timeout, the others have surely formed a round without it,
    so it must stop its workers then, not when LOST arrives (which only comes on reconnect).
    """

    CONNECTED = "connected"
    """Connected again with the same session: memberships and watches are intact."""
    SUSPENDED = "suspended"
    """Cut off from the store; the session may or may not still be alive there."""
    LOST = "lost"
    """The session expired: this connection's memberships are gone (a new session follows)."""


ConnectionCallback = Callable[[ConnectionState], None]


class Store(ABC):
    """One job's rendezvous storage, as seen through one connection."""

    @abstractmethod
    def get_state(self) -> tuple[bytes | None, int]:
        """The latest state this store knows and its token; may trail the server by one
        notification, which ``set_state`` catches."""

    @abstractmethod
    def set_state(self, data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        """Write ``data`` if the state still has ``token``; return the current state, its
        token, and whether we won. Retrying after a lost connection is safe."""

    def refresh_state(self, data: bytes, token: int) -> tuple[bytes | None, int]:
        """The state as the server holds it now, for a connection back from an outage, whose
        cached view (``data``, ``token``) may trail by more than one notification.

        This default is a compare-and-set of the same bytes: it returns the server's state
        when the view is behind and rewrites it (a new token, the same state) when the view is
        current. Right for any store, but a write for every caller; a store that can read its
        server's latest state directly overrides it."""
        current, token, _ = self.set_state(data, token)
        return current, token

    @abstractmethod
    def join(self, node_id: str, data: bytes) -> None:
        """Make ``node_id`` a member until it leaves or its connection dies; idempotent.

        Raises RendezvousClosedError if the job is closed.
        """

    @abstractmethod
    def leave(self, node_id: str) -> None:
        """Drop the membership at once; idempotent."""

    @abstractmethod
    def alive(self) -> frozenset[str]:
        """Ids of the current members, as last reported by the store's watch."""

    def alive_is_current(self) -> bool:
        """Whether ``alive()`` is at least as new as ``get_state()``: it misses no member that
        joined before the state was written. Only then may a member of the state's round that
        ``alive()`` does not list be counted as gone: on an older list it may just not be
        listed yet (it joined again, and the round that counts it was committed, between two
        listings), and counting it gone ends a healthy round.

        This default suits a store that pushes the state and the membership together (in one
        view, or in order on one channel). A store that lists its members apart from reading
        its state answers False while a listing it needs is on its way, and calls every
        subscriber's ``on_change`` once the list catches up."""
        return True

    @abstractmethod
    def members(self, node_ids: Iterable[str]) -> list[bytes]:
        """The records of those members that still exist, in the order they joined."""

    @abstractmethod
    def subscribe(self, on_change: Callable[[], None], on_session_lost: Callable[[], None]) -> None:
        """Call ``on_change`` after any change of the state or the membership, and
        ``on_session_lost`` when this connection's memberships were dropped by the store."""

    @abstractmethod
    def unsubscribe(self, on_change: Callable[[], None]) -> None:
        """Stop notifying ``on_change`` (and its session callback)."""

    def subscribe_connection(self, callback: ConnectionCallback) -> None:
        """Call ``callback`` with every change of this connection's ``ConnectionState``.

        Callbacks never run inside a client library's I/O thread, but they should still not
        block for long: they delay the store's other notifications. A store that cannot be
        cut off from its state never calls them; that is this default.
        """
        del callback

    def unsubscribe_connection(self, callback: ConnectionCallback) -> None:
        """Stop calling ``callback``; unknown callbacks are ignored."""
        del callback

    @abstractmethod
    def put_note(self, key: str, data: bytes) -> None:
        """Write the note ``key`` (``<topic>@<node_id>``, replacing one of that key): a small
        record that every connection can read until the job is closed, and that outlives the
        connection that wrote it (unlike a membership). A topic new to the job, and a new key
        on the topic a connection follows (``note_keys``), call every subscriber's
        ``on_change`` on that connection (a replaced one need not). Raises
        RendezvousClosedError once the job is closed, RendezvousError for a key
        ``check_note_key`` refuses."""

    @abstractmethod
    def claim_note(self, key: str, data: bytes) -> bytes:
        """Write the note ``key`` only if it does not exist yet, and return the note as it is
        then: ours, or the one written first. Every caller learns the same value, so agents
        that decided apart agree on one answer (``<topic>@``). Retrying after a lost
        connection is safe. Raises as ``put_note`` does."""

    @abstractmethod
    def notes(self, topic: str) -> dict[str, bytes]:
        """Every note on ``topic`` by key, as the server holds them now (empty once the job
        is closed)."""

    @abstractmethod
    def note_topics(self) -> frozenset[str]:
        """Every topic that has a note, as last pushed by the store: no request, so it may be
        called at every poll."""

    @abstractmethod
    def note_keys(self, topic: str) -> frozenset[str]:
        """The keys of the nodes' notes on ``topic`` (not its answer: ``notes`` reads it, and
        ``note_topics`` tells of it) as last pushed, following that topic from now on (one
        topic a connection at a time: following another stops following the last). The first
        call on a topic asks the server; the next ones make no request. Only a follower is
        told of every key: a topic of thousands of nodes' notes is pushed to the one agent
        that reads them, not listed again by every connection at each note."""

    @abstractmethod
    def forget_notes(self, topic: str) -> None:
        """Remove every note on ``topic`` and its answer: a topic nobody reads again, whose
        notes would otherwise stay in the store until the job closes. Idempotent; every
        connection is told of the topic's end as of a new topic."""

    @abstractmethod
    def mark(self, kind: Mark, round_number: int, node_id: str, token: int) -> bool:
        """Record ``node_id``'s mark ``kind`` for round ``round_number`` if, and only if, the
        state still has ``token``: the fence that ``set_state`` applies, so that a mark
        decided on a state that has moved on is refused and decided again. Return whether the
        mark is there (also when it was already: marking is idempotent, and a retry after a
        lost connection finds its own mark). ``ABSENT`` fences nothing, so it is refused.

        A mark never changes the state's token, and marks are never pushed: they are read
        with ``marks``. A ``Mark.BACK`` mark made from another connection is replaced, so
        that it dies with the session that is alive. Raises RendezvousClosedError once the
        job is closed, RendezvousError for a node id ``check_node_id`` refuses."""

    @abstractmethod
    def marks(self, kind: Mark, round_number: int) -> frozenset[str]:
        """The ids of the nodes marked ``kind`` in round ``round_number``, as the server holds
        them now (empty once the job is closed)."""

    def seen_marks(self, kind: Mark, round_number: int) -> frozenset[str]:
        """The ids marked ``kind`` in round ``round_number`` as this connection knows them,
        following those marks from now on (``follow_marks``): what a waiting agent decides
        on at every step. Its own marks are in it as soon as ``mark`` returns them written;
        another connection's, by the time ``on_change`` tells of them. This default asks the
        server every time; a store that keeps the followed marks answers from memory."""
        self.follow_marks(kind, round_number)
        return self.marks(kind, round_number)

    @abstractmethod
    def follow_marks(self, kind: Mark, round_number: int) -> None:
        """From now on, call every subscriber's ``on_change`` when a mark ``kind`` of round
        ``round_number`` comes or goes (a burst of them may cost one call): what a round's
        proposer waits on, so that nobody polls. A connection follows one round's marks at a
        time; following another stops following the last."""

    @abstractmethod
    def put_table(self, round_number: int, table: bytes) -> str:
        """Keep ``table`` (a round's members in rank order, of any size) for round
        ``round_number`` and return its name, ``table_digest(table)``: the state that commits
        the round names its table by that digest. Content-addressed, so it is idempotent and
        two proposers of one round never overwrite each other: each table is its own record,
        and only the one the committed state names is ever read. It is written before the
        state that names it (a table may pass ZooKeeper's 1 MB limit on one request, so it
        cannot ride in the commit's transaction); a proposer that loses the commit leaves a
        table nobody names, which ``forget_rounds`` removes. Raises RendezvousClosedError
        once the job is closed."""

    @abstractmethod
    def table(self, round_number: int, digest: str) -> bytes | None:
        """The table of round ``round_number`` named ``digest``, or None if there is none
        (never written, only partly written by a proposer that died, forgotten, or the job
        closed): what is returned always has that digest."""

    @abstractmethod
    def forget_rounds(self, before_round: int) -> None:
        """Remove every mark and every table of every round before ``before_round``;
        idempotent."""

    @abstractmethod
    def is_closed(self) -> bool:
        """Whether the job was closed (its tombstone exists)."""

    @abstractmethod
    def close_job(self) -> None:
        """Leave a tombstone, then remove the state and every membership; idempotent."""

    @abstractmethod
    def release(self) -> None:
        """Close the connection; memberships made through it vanish."""

    @property
    def where(self) -> str:
        """Where the job's rendezvous lives, for a sentence ("ZooKeeper at 'zk1:2181/team'")."""
        return "the rendezvous store"


class CachedStore(Store):
    """A store whose state, membership and subscribers are kept here, fed by the server's pushes.

    Subclasses feed ``_remember_state``, ``_alive`` and the notes (``_remember_notes``, or
    ``_note_keys`` and ``_note_topics``; under ``_lock``) and
    call each of ``_callbacks()`` after a change.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: tuple[bytes | None, int] = (None, ABSENT)
        self._alive: frozenset[str] = frozenset()
        self._note_keys: frozenset[str] = frozenset()
        """The keys known of the nodes' notes on the followed topic (a store may keep more)."""
        self._note_topics: frozenset[str] = frozenset()
        self._followed_topic: str | None = None
        self._following_notes = threading.Lock()
        """One ``follow_notes`` at a time, so handlers sharing this store follow once."""
        self._subscribers: dict[Callable[[], None], Callable[[], None]] = {}
        self._connection_subscribers: list[ConnectionCallback] = []

    def get_state(self) -> tuple[bytes | None, int]:
        with self._lock:
            return self._state

    def alive(self) -> frozenset[str]:
        with self._lock:
            return self._alive

    def note_topics(self) -> frozenset[str]:
        with self._lock:
            return self._note_topics

    def note_keys(self, topic: str) -> frozenset[str]:
        with self._following_notes:
            with self._lock:
                followed = self._followed_topic == topic
            if not followed:
                self.follow_notes(topic)
            with self._lock:
                answer = f"{topic}{NOTE_SEPARATOR}"
                return frozenset(
                    key for key in self._note_keys if note_topic(key) == topic and key != answer
                )

    def follow_notes(self, topic: str) -> None:
        """Be told of every key on ``topic`` from now on (``note_keys``). This default suits a
        store whose server pushes every key (``_remember_notes``)."""
        with self._lock:
            self._followed_topic = topic

    def _remember_notes(self, keys: frozenset[str]) -> None:
        """Every note key the server holds, from a store that pushes them all (under
        ``_lock``)."""
        self._note_keys = keys
        self._note_topics = frozenset(note_topic(key) for key in keys)

    def subscribe(self, on_change: Callable[[], None], on_session_lost: Callable[[], None]) -> None:
        with self._lock:
            self._subscribers[on_change] = on_session_lost

    def unsubscribe(self, on_change: Callable[[], None]) -> None:
        with self._lock:
            self._subscribers.pop(on_change, None)

    def subscribe_connection(self, callback: ConnectionCallback) -> None:
        with self._lock:
            self._connection_subscribers.append(callback)

    def unsubscribe_connection(self, callback: ConnectionCallback) -> None:
        with self._lock:
            if callback in self._connection_subscribers:
                self._connection_subscribers.remove(callback)

    def _connection_callbacks(self) -> list[ConnectionCallback]:
        with self._lock:
            return list(self._connection_subscribers)

    def _remember_state(self, data: bytes | None, token: int) -> None:
        """Keep the newest state seen, whether pushed or in a reply: a late push of an older
        state must not hide a newer one."""
        with self._lock:
            cached, cached_token = self._state
            if data is not None and cached is not None and token <= cached_token:
                return
            self._state = (data, token)

    def _callbacks(self, *, session_lost: bool = False) -> list[Callable[[], None]]:
        """The subscribers' change callbacks, or their session-lost ones."""
        with self._lock:
            return list(self._subscribers.values() if session_lost else self._subscribers)
