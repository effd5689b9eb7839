"""An in-memory Store that behaves like ZooKeeper, for unit tests and the simulator.

``MemoryServer`` holds one job: the state and its version, the ephemeral memberships of each
session, and the tombstone. Each ``MemoryStore`` is one connection to it, with one session at
a time, like a kazoo client. What the ``Store`` protocol promises holds as on ZooKeeper:

* compare-and-set on an integer version (``ABSENT`` before the state exists);
* a membership belongs to the session that made it and vanishes when that session ends:
  ``release()``, ``expire_session()``, or a session that nobody ``touch``\\ ed within its
  timeout when ``MemoryServer.tick()`` runs;
* every change is pushed to every connected session, and the connection reports
  SUSPENDED / CONNECTED / LOST as kazoo does;
* ``close_job`` leaves a tombstone; joining afterwards raises RendezvousClosedError;
* notes (``put_note``, ``claim_note``) outlive their writer's session and go with the job;
  every push carries every key, and ``note_keys`` answers a topic's from it;
* marks (``mark``) are fenced by the state's version without changing it; a ``Mark.BACK``
  mark vanishes with its session, as a membership does, and every push carries every mark
  (``seen_marks`` answers from it); round tables (``put_table``) are kept by
  digest, and both go with ``forget_rounds`` and with the job.

Nothing here runs on its own: time is whatever the injected clock says, and sessions expire
only when ``tick()`` looks at that clock. Every notification goes through the server's
``deliver`` hook, so a simulator can deliver it now (the default), later, twice, or never.
A late or repeated push never makes a connection's view go backwards: every view carries
the server's sequence number and a connection keeps only the newest it saw.

``MemoryBadNodes`` is the same for the users' bad-node books (``zookeeper.BadNodeBook``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hpc_elastic.errors import RendezvousAccessError, RendezvousClosedError, RendezvousError
from hpc_elastic.rendezvous.backend import (
    ABSENT,
    CachedStore,
    ConnectionState,
    Mark,
    check_node_id,
    check_note_key,
    note_topic,
    place_mark,
    table_digest,
)
from hpc_elastic.rendezvous.badnode import BadNode, check_host

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Seconds, monotonic: ``time.monotonic`` in production, a simulated clock in the simulator."""

Deliver = Callable[["MemoryStore", Callable[[], None]], None]
"""How a notification reaches a connection: called with the connection and a thunk that
delivers it. The default runs the thunk at once; a simulator may queue, repeat or drop it."""

DEFAULT_SESSION_TIMEOUT = 10.0


def deliver_now(store: MemoryStore, notification: Callable[[], None]) -> None:
    """Synchronous delivery: the notification runs before the change that caused it returns."""
    del store
    notification()


class ManualClock:
    """A clock that moves only when told: ``clock()`` reads it, ``advance`` moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@dataclass(frozen=True)
class View:
    """What a push carries: the whole picture at one moment, numbered by ``seq``."""

    seq: int
    state: bytes | None
    token: int
    alive: frozenset[str]
    notes: frozenset[str] = frozenset()
    """The keys of the notes (``Store.note_keys``)."""
    marks: frozenset[tuple[Mark, int, str]] = frozenset()
    """Every mark: its kind, its round and the node it marks (``Store.seen_marks``)."""


@dataclass(eq=False)
class _Session:
    """Compared by identity: each session is one object, as each has one id on ZooKeeper."""

    number: int
    timeout: float
    last_heard: float
    ended: bool = False


@dataclass
class _Member:
    order: int
    """Join order, like ZooKeeper's czxid: ``members()`` sorts by it."""
    data: bytes
    session: _Session


class MemoryServer:
    """One job's rendezvous state, shared by the ``MemoryStore`` connections made to it."""

    def __init__(self, clock: Clock = time.monotonic, deliver: Deliver = deliver_now) -> None:
        self.clock = clock
        self.deliver = deliver
        self._lock = threading.RLock()
        self._state: bytes | None = None
        self._version = ABSENT
        self._members: dict[str, _Member] = {}
        self._notes: dict[str, bytes] = {}
        self._marks: dict[tuple[Mark, int], dict[str, _Session]] = {}
        """Each round's marks of each kind: node id -> the session that wrote it."""
        self._tables: dict[tuple[int, str], bytes] = {}
        """Each round's tables by digest."""
        self._closed = False
        self._order = itertools.count()
        self._seq = 0
        self._session_numbers = itertools.count(1)
        self._connections: dict[_Session, MemoryStore] = {}
        self._pending: list[tuple[MemoryStore, View]] = []

    def connect(
        self, run_id: str = "job", session_timeout: float = DEFAULT_SESSION_TIMEOUT
    ) -> MemoryStore:
        """A new connection with a new session."""
        return MemoryStore(self, run_id, session_timeout)

    def tick(self) -> list[MemoryStore]:
        """Expire every session not heard from within its timeout; return their connections.

        As on ZooKeeper, the owner of an expired session learns it only when it next hears
        from the server: at once if it is connected, on ``reconnect`` if it is cut off.
        """
        now = self.clock()
        with self._lock:
            overdue = [
                (session, store)
                for session, store in self._connections.items()
                if now - session.last_heard > session.timeout
            ]
        for session, store in overdue:
            logger.debug(
                "memory store: session %d expired (silent for %.3f s, timeout %.3f s)",
                session.number,
                now - session.last_heard,
                session.timeout,
            )
            self._end_session(session)
            store._session_expired(session)
        return [store for _, store in overdue]

    # --- read-only views for tests and the simulator's property checks -----------------------

    @property
    def state(self) -> tuple[bytes | None, int]:
        """The state and its version as the server holds it now."""
        with self._lock:
            return self._state, self._version

    @property
    def member_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._members)

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    # --- what connections call ----------------------------------------------------------------

    def _open_session(self, store: MemoryStore, timeout: float) -> _Session:
        session = _Session(next(self._session_numbers), timeout, self.clock())
        with self._lock:
            self._connections[session] = store
        logger.debug("memory store: session %d opened", session.number)
        return session

    def _end_session(self, session: _Session) -> None:
        """The session's memberships vanish with it, like ZooKeeper ephemerals."""
        with self._lock:
            if session.ended:
                return
            session.ended = True
            self._connections.pop(session, None)
            gone = [node for node, member in self._members.items() if member.session is session]
            for node in gone:
                del self._members[node]
            for (kind, round_number), marked in self._marks.items():
                if kind.ephemeral:
                    mine = [node for node, owner in marked.items() if owner is session]
                    for node in mine:
                        del marked[node]
                    if mine:
                        self._marks_changed(kind, round_number)
            if gone:
                logger.debug("memory store: session %d ended; %s left", session.number, gone)
                self._changed()
        self._push_pending()

    def _view(self) -> View:
        with self._lock:
            return View(
                self._seq,
                self._state,
                self._version,
                frozenset(self._members),
                frozenset(self._notes),
                frozenset(
                    (kind, round_number, node)
                    for (kind, round_number), marked in self._marks.items()
                    for node in marked
                ),
            )

    def _changed(self) -> View:
        """Number the new picture and push it to every live session; return it.

        Called under the lock, so the view is exactly the one the change made; the pushes
        happen once the caller lets go of the lock (see ``_push_pending``).
        """
        self._seq += 1
        view = self._view()
        self._pending.extend((store, view) for store in self._connections.values())
        return view

    def _push_pending(self) -> None:
        """Deliver outside the lock, so a callback may call the store again."""
        with self._lock:
            pending, self._pending = self._pending, []
        for store, view in pending:
            store._push(view)

    def _compare_and_set(self, data: bytes, token: int) -> tuple[View, bool]:
        with self._lock:
            if self._closed:
                won = False  # A closed job is never reopened, as on ZooKeeper.
            elif token == ABSENT:
                won = self._state is None
            else:
                won = self._state is not None and token == self._version
            if won:
                self._state = data
                self._version = 0 if token == ABSENT else self._version + 1
                logger.debug("memory store: state version %d written", self._version)
                view = self._changed()
            else:
                view = self._view()
        self._push_pending()
        return view, won

    def _join(self, session: _Session, node_id: str, data: bytes, run_id: str) -> None:
        with self._lock:
            if self._closed:
                raise RendezvousClosedError(
                    f"Job '{run_id}' is closed (finished or cancelled); nothing to join."
                )
            member = self._members.get(node_id)
            if member is not None and member.session is session:
                return  # Idempotent: joining again from the same session changes nothing.
            # A member of that id from another (older) session is replaced, as zookeeper.py does
            # for an agent whose previous session has not expired yet: it becomes a new member.
            self._members[node_id] = _Member(next(self._order), data, session)
            logger.debug("memory store: %s joined (session %d)", node_id, session.number)
            self._changed()
        self._push_pending()

    def _leave(self, node_id: str) -> None:
        with self._lock:
            if self._members.pop(node_id, None) is not None:
                logger.debug("memory store: %s left", node_id)
                self._changed()
        self._push_pending()

    def _put_note(self, key: str, data: bytes, run_id: str, *, claim: bool) -> bytes:
        """Write a note (only if absent with ``claim``); the note as it is now."""
        with self._lock:
            if self._closed:
                raise RendezvousClosedError(
                    f"Job '{run_id}' is closed (finished or cancelled); no note can be written."
                )
            new = key not in self._notes
            if new or not claim:
                self._notes[key] = data
                logger.debug("memory store: note %s written", key)
            if new:
                self._changed()
            current = self._notes[key]
        self._push_pending()
        return current

    def _mark(
        self,
        session: _Session,
        kind: Mark,
        round_number: int,
        node_id: str,
        token: int,
        *,
        run_id: str,
    ) -> bool:
        with self._lock:
            if self._closed:
                raise RendezvousClosedError(
                    f"Job '{run_id}' is closed (finished or cancelled); no mark can be written."
                )
            marked = self._marks.setdefault((kind, round_number), {})
            # No state, no fence: its version is ABSENT then, and ABSENT fences nothing.
            fenced = token != ABSENT and token == self._version
            new = node_id not in marked
            written = place_mark(marked, kind, node_id, session, fenced=fenced)
            if written and new:
                self._marks_changed(kind, round_number)
            logger.debug(
                "memory store: %s of %s, round %d: %s", kind, node_id, round_number, written
            )
        self._push_pending()
        return written

    def _marks_changed(self, kind: Mark, round_number: int) -> None:
        """Tell every connection (under the lock, as ``_changed``): the followers of these
        marks must hear, and the others' views keep every mark (``MemoryStore.seen_marks``)."""
        logger.debug("memory store: the %s marks of round %d changed", kind.value, round_number)
        self._changed()

    def _read_marks(self, kind: Mark, round_number: int) -> frozenset[str]:
        with self._lock:
            return frozenset(self._marks.get((kind, round_number), ()))

    def _put_table(self, round_number: int, table: bytes, run_id: str) -> str:
        with self._lock:
            if self._closed:
                raise RendezvousClosedError(
                    f"Job '{run_id}' is closed (finished or cancelled); no table can be written."
                )
            digest = table_digest(table)
            self._tables[round_number, digest] = table
            return digest

    def _read_table(self, round_number: int, digest: str) -> bytes | None:
        with self._lock:
            return self._tables.get((round_number, digest))

    def _forget_rounds(self, before_round: int) -> None:
        with self._lock:
            forgotten = [key for key in self._marks if key[1] < before_round]
            for key in forgotten:
                del self._marks[key]
            for done in [key for key in self._tables if key[0] < before_round]:
                del self._tables[done]
            if forgotten:
                self._changed()
        self._push_pending()

    def _forget_notes(self, topic: str) -> None:
        with self._lock:
            doomed = [key for key in self._notes if note_topic(key) == topic]
            for key in doomed:
                del self._notes[key]
            if doomed:
                self._changed()
        self._push_pending()

    def _read_notes(self, topic: str) -> dict[str, bytes]:
        with self._lock:
            return {key: data for key, data in self._notes.items() if note_topic(key) == topic}

    def _records(self, node_ids: Iterable[str]) -> list[bytes]:
        with self._lock:
            found = [self._members[node] for node in node_ids if node in self._members]
        return [member.data for member in sorted(found, key=lambda member: member.order)]

    def _close_job(self) -> None:
        with self._lock:
            changed = (
                not self._closed
                or self._state is not None
                or bool(self._members)
                or bool(self._notes)
            )
            self._closed = True
            self._state, self._version = None, ABSENT
            self._members.clear()
            self._notes.clear()
            self._marks.clear()
            self._tables.clear()
            if changed:
                logger.debug("memory store: job closed")
                self._changed()
        self._push_pending()


class MemoryStore(CachedStore):
    """One connection to a ``MemoryServer``: a session, and the view its pushes built.

    Why 33 methods: it is the ``Store`` interface (eighteen, most of them a check that the
    connection is up and one call of the server), the handles a simulator or a test turns on
    the connection as faults (``connected``, ``touch``, ``disconnect``, ``reconnect``,
    ``expire_session``), and the session's life as a kazoo client sees it (heard, expired,
    replaced) with the pushes that reach it through the server's ``deliver`` hook. The fault
    handles and the session are one thing, the session this connection holds, so they stay
    in one class; the job's own state and every session's memberships are
    ``MemoryServer``'s, the cached view and the subscribers ``CachedStore``'s.
    """

    def __init__(
        self, server: MemoryServer, run_id: str, session_timeout: float = DEFAULT_SESSION_TIMEOUT
    ) -> None:
        super().__init__()
        self.server = server
        self.run_id = run_id
        self.session_timeout = session_timeout
        self._seq = -1
        self._connected = True
        self._released = False
        self._session = server._open_session(self, session_timeout)
        self._marks_view: frozenset[tuple[Mark, int, str]] = frozenset()
        """Every mark, as the newest push had them."""
        self._own_marks: set[tuple[Mark, int, str]] = set()
        """The marks written through this connection in its current session: seen at once,
        before the push that tells of them."""
        self._remember(server._view())

    # --- the Store protocol -------------------------------------------------------------------

    @property
    def where(self) -> str:
        return "the in-memory rendezvous"

    def set_state(self, data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        self._heard()
        view, won = self.server._compare_and_set(data, token)
        self._remember(view)
        return view.state, view.token, won

    def join(self, node_id: str, data: bytes) -> None:
        self._heard()
        self.server._join(self._session, node_id, data, self.run_id)

    def leave(self, node_id: str) -> None:
        self._heard()
        self.server._leave(node_id)

    def members(self, node_ids: Iterable[str]) -> list[bytes]:
        self._heard()
        return self.server._records(node_ids)

    def put_note(self, key: str, data: bytes) -> None:
        check_note_key(key)
        self._heard()
        self.server._put_note(key, data, self.run_id, claim=False)

    def claim_note(self, key: str, data: bytes) -> bytes:
        check_note_key(key)
        self._heard()
        return self.server._put_note(key, data, self.run_id, claim=True)

    def notes(self, topic: str) -> dict[str, bytes]:
        self._heard()
        return self.server._read_notes(topic)

    def forget_notes(self, topic: str) -> None:
        self._heard()
        self.server._forget_notes(topic)

    @property
    def followed_topic(self) -> str | None:
        """The topic whose notes this connection follows (``note_keys``), if any."""
        with self._lock:
            return self._followed_topic

    def mark(self, kind: Mark, round_number: int, node_id: str, token: int) -> bool:
        check_node_id(node_id)
        self._heard()
        session = self._session
        written = self.server._mark(session, kind, round_number, node_id, token, run_id=self.run_id)
        if written:
            with self._lock:
                self._own_marks.add((kind, round_number, node_id))
        return written

    def marks(self, kind: Mark, round_number: int) -> frozenset[str]:
        self._heard()
        return self.server._read_marks(kind, round_number)

    def seen_marks(self, kind: Mark, round_number: int) -> frozenset[str]:
        """No request: every push carries every mark, so a connection that is cut off (and
        not told yet) decides on what it last heard, as a ZooKeeper connection does."""
        with self._lock:
            known = self._marks_view | self._own_marks
        return frozenset(node for k, r, node in known if (k, r) == (kind, round_number))

    def follow_marks(self, kind: Mark, round_number: int) -> None:
        """Every push carries every mark: a follower needs nothing more than a live
        connection."""
        del kind, round_number
        self._heard()

    def put_table(self, round_number: int, table: bytes) -> str:
        self._heard()
        return self.server._put_table(round_number, table, self.run_id)

    def table(self, round_number: int, digest: str) -> bytes | None:
        self._heard()
        return self.server._read_table(round_number, digest)

    def forget_rounds(self, before_round: int) -> None:
        self._heard()
        self.server._forget_rounds(before_round)

    def is_closed(self) -> bool:
        self._heard()
        return self.server.closed

    def close_job(self) -> None:
        self._heard()
        self.server._close_job()

    def release(self) -> None:
        """Close the session: its memberships vanish at once, like a clean kazoo ``stop``."""
        if self._released:
            return
        self._released = True
        self._connected = False
        self.server._end_session(self._session)

    # --- what the simulator does to this connection -------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    def touch(self) -> None:
        """A heartbeat: the session is heard from now (kazoo pings while connected)."""
        if self._connected:
            self._session.last_heard = self.server.clock()

    def disconnect(self) -> None:
        """Cut this connection off: SUSPENDED; the session lives on until its timeout."""
        if not self._connected or self._released:
            return
        self._connected = False
        logger.debug("memory store: session %d suspended", self._session.number)
        self._tell(lambda: self._report(ConnectionState.SUSPENDED))

    def reconnect(self) -> None:
        """Reach the server again: CONNECTED with the same session if it still lives, else
        LOST and then CONNECTED with a new one (kazoo's order). Watches fire with the latest
        view either way, as ZooKeeper re-arms them."""
        if self._connected or self._released:
            return
        self._connected = True
        if self._session.ended:
            self._replace_session()
            return
        self._session.last_heard = self.server.clock()
        logger.debug("memory store: session %d reconnected", self._session.number)
        view = self.server._view()
        self._tell(lambda: self._report(ConnectionState.CONNECTED))
        self._tell(lambda: self._apply(view))

    def expire_session(self) -> None:
        """The server expires this session now, as if its timeout had passed."""
        session = self._session
        self.server._end_session(session)
        self._session_expired(session)

    # --- internals ----------------------------------------------------------------------------

    def _heard(self) -> None:
        """Every request needs the connection, and counts as a heartbeat."""
        if self._released or not self._connected:
            raise RendezvousError(
                f"The in-memory rendezvous of job '{self.run_id}' is out of reach (this "
                "connection is cut off or released); reconnect it first."
            )
        if self._session.ended:
            # The expiry was not delivered yet: as on ZooKeeper, a request is how a client
            # learns it. Deliver it now, then go on with the new session.
            self._replace_session()
        self._session.last_heard = self.server.clock()

    def _session_expired(self, session: _Session) -> None:
        """Called once the server ended ``session``: a connected client hears it at once."""
        if self._connected and not self._released and session is self._session:
            self._replace_session()

    def _replace_session(self) -> None:
        old = self._session
        self._session = self.server._open_session(self, self.session_timeout)
        with self._lock:  # the old session's ephemeral marks went with it
            self._own_marks = {mark for mark in self._own_marks if not mark[0].ephemeral}
        logger.debug(
            "memory store: session %d lost, session %d follows", old.number, self._session.number
        )
        view = self.server._view()
        self._tell(self._lost)
        self._tell(lambda: self._report(ConnectionState.CONNECTED))
        self._tell(lambda: self._apply(view))

    def _push(self, view: View) -> None:
        """From the server after a change; a cut-off connection hears nothing."""
        if self._connected and not self._released:
            self._tell(lambda: self._apply(view))

    def _tell(self, notification: Callable[[], None]) -> None:
        self.server.deliver(self, notification)

    def _apply(self, view: View) -> None:
        self._remember(view)
        for callback in self._callbacks():
            callback()

    def _lost(self) -> None:
        for callback in self._callbacks(session_lost=True):
            callback()
        self._report(ConnectionState.LOST)

    def _report(self, state: ConnectionState) -> None:
        for callback in self._connection_callbacks():
            callback(state)

    def _remember(self, view: View) -> None:
        """Keep the newest view: a late or repeated push must not hide a newer one."""
        with self._lock:
            if view.seq <= self._seq:
                return
            self._seq = view.seq
            self._state = (view.state, view.token)
            self._alive = view.alive
            self._remember_notes(view.notes)
            self._marks_view = view.marks


class MemoryBadNodes:
    """Every user's bad-node book, as ZooKeeper keeps them under ``@users``: each user's
    records are guarded by the secret of the first book opened for that user, as the digest
    ACL of ``zookeeper.BadNodeBook`` is, and are stored encoded, so a record that cannot be
    read is skipped here as there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[str, tuple[str, dict[str, bytes]]] = {}

    def book(self, user: str, secret: str) -> MemoryBadNodeBook:
        """The user's book; refused, with ZooKeeper's sentence, to any other secret."""
        with self._lock:
            owner, records = self._users.setdefault(check_host(user), (secret, {}))
        if owner != secret:
            raise RendezvousAccessError(
                f"The bad-node list of user '{user}' is not guarded by user '{user}'s secret: "
                "either your user secret file (--user-secret-file) was replaced, so restore "
                "it, or another user made the list, so ask the ensemble's admin to delete it."
            )
        return MemoryBadNodeBook(self._lock, records)

    def plant(self, user: str, host: str, data: bytes) -> None:
        """Store raw bytes as a record, as a broken or older agent might have written."""
        with self._lock:
            self._users[user][1][host] = data


class MemoryBadNodeBook:
    """One user's book in a ``MemoryBadNodes`` (``badnodes.Book``)."""

    def __init__(self, lock: threading.Lock, records: dict[str, bytes]) -> None:
        self._lock = lock
        self._records = records

    def remember(self, record: BadNode) -> None:
        with self._lock:
            self._records[check_host(record.host)] = record.encode()

    def records(self) -> list[BadNode]:
        with self._lock:
            raw = list(self._records.values())
        return [record for data in raw if (record := BadNode.decode(data)) is not None]

    def forget(self, hosts: Iterable[str]) -> None:
        with self._lock:
            for host in hosts:
                self._records.pop(check_host(host), None)
