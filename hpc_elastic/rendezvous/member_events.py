"""Who joins a job and who leaves it, told by name: one small ZooKeeper session that follows
``members/`` with a persistent recursive watch.

Why: a children watch (kazoo's, and ZooKeeper's before 3.6) says only that ``members/``
changed, so after every loss each connection lists every member again: O(N) bytes a
connection, O(N²) from the ensemble (4,096 agents with a session each, about 570 MB for one
burst of losses). A persistent recursive watch (ZooKeeper 3.6+, ``addWatch``) tells each
creation and deletion under ``members/`` as one event naming the node, and keeps telling
without being set again: a loss of k members costs a connection k events of ~60 bytes. The
whole list is read once, when the session starts (and again only after it was cut off).

Why a session of our own: kazoo 2.11, the newest release, has no ``addWatch`` (its pull
request #715 is still open), and this module may use only kazoo's public API. ZooKeeper's
protocol is public (``zookeeper.jute``) and this needs five of its requests: connect, add
the job's credentials, ``addWatch``, ``getChildren`` and ping; nothing here writes. The
session holds no ephemeral node, so when it is cut off it is simply opened again.

Ordering (what ``current`` relies on): on one session, ZooKeeper sends the events of every
change it applied before it answers a request, and every answer carries the newest
transaction id (zxid) the server had applied. So once an answer with zxid ≥ Z has arrived,
every change of the membership up to Z is known here: a state written at Z is as new as
this list (``place``).
"""

from __future__ import annotations

import logging
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from contextlib import suppress

logger = logging.getLogger(__name__)

ADD_WATCH = 106
GET_CHILDREN = 8
PING = 11
AUTH = 100
CLOSE_SESSION = -11
NOTIFICATION_XID = -1
PING_XID = -2
AUTH_XID = -4
WATCH_XID = 1
LIST_XID = 2
NODE_CREATED = 1
NODE_DELETED = 2
PERSISTENT_RECURSIVE = 1
UNIMPLEMENTED = -6
NO_NODE = -101
SESSION_TIMEOUT_MS = 10_000
"""Asked of the server, which may give less: this session holds no ephemeral node, so its
timeout only says how soon a dead one is let go and how often it pings."""
RETRY_PAUSE = (0.1, 1.0)
"""Seconds between attempts to open the session again, growing from the first to the second."""
MAX_FRAME = 64 * 1024 * 1024
"""Refused above this: a length that large is not ZooKeeper talking."""


class Unsupported(Exception):
    """The server has no persistent watches (ZooKeeper before 3.6)."""


class _Cut(Exception):
    """The session was cut off, or the server said something this module does not expect."""


class MemberEvents:
    """The live members of one job, as their nodes under ``members/`` come and go.

    ``members()`` reads them. ``on_change(removed)`` is called (on this object's thread; it
    must not block) after each burst of changes the server sent at once, with the members
    removed in it (a member removed and made again is among them: its record may differ);
    ``on_current()`` when ``current`` said no and the list caught up since.

    Why the members are read, not handed on: a join storm of N agents is N events a
    connection; building the set of N members at each burst, for every connection, cost
    more than the listings it replaced. Read, the set is built once a burst at most, and
    only when someone asks."""

    def __init__(
        self,
        hosts: str,
        path: str,
        credentials: str | None,
        on_change: Callable[[frozenset[str]], None],
        on_current: Callable[[], None],
    ) -> None:
        """``hosts``: "h1:p1,h2:p2"; ``path``: the absolute path of ``members/``;
        ``credentials``: "user:password" for the digest scheme, or None."""
        self._hosts = [_host_port(pair) for pair in hosts.split(",")]
        self._path = path
        self._prefix = (path + "/").encode()
        """Every member's path begins so."""
        self._credentials = credentials
        self._on_change = on_change
        self._on_current = on_current
        self._members: set[str] = set()
        self._frozen: frozenset[str] | None = frozenset()
        """``_members`` as ``members()`` last returned them; None once they changed."""
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._listed = False
        """Whether the list of this session has arrived (events before it are in it)."""
        self._seen_zxid = 0
        """The newest zxid an answer of this session carried: every change up to it is known."""
        self._needed_zxid = 0
        """The newest state's zxid placed (``place``)."""
        self._awaited = False
        """Whether ``current`` said no since the list last caught up."""
        self._pinging = False
        """Whether a ping is on its way (its answer carries the server's zxid)."""
        self._sent_at = 0.0
        """When this session last sent something: the server expires a silent one."""
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.counts = {"lists": 0, "events": 0, "bytes_in": 0, "sessions": 0}
        """What this session read: for the benchmarks."""
        self._thread = threading.Thread(target=self._run, name=f"zk-members{path}", daemon=True)

    def start(self, timeout: float) -> None:
        """Open the session and list the members once, or raise ``Unsupported`` (the server
        has no ``addWatch``) or ``OSError`` (the server refused the session or cut it off
        before the list came, or the list did not come within ``timeout``)."""
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise OSError(f"no list of {self._path} within {timeout:g} s")
        if self._failure is not None:
            self.stop()
            raise self._failure

    def stop(self) -> None:
        """Close the session (the server lets it go at once) and follow no more."""
        self._stopped.set()
        with self._lock:
            sock = self._sock
        if sock is not None:
            with suppress(OSError):
                self._send(sock, struct.pack("!ii", 0, CLOSE_SESSION))
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def members(self) -> frozenset[str]:
        """The live members, as the server's events and lists of this session told them."""
        with self._lock:
            if self._frozen is None:
                self._frozen = frozenset(self._members)
            return self._frozen

    def current(self) -> bool:
        """Whether the list is as new as every state placed: listed on a live session that
        has heard every change up to the newest state's zxid."""
        with self._lock:
            current = self._current()
            self._awaited = self._awaited or not current
        return current

    def place(self, zxid: int) -> None:
        """A state written at ``zxid`` was remembered: the list is as new as it once an
        answer carries that zxid or a newer one."""
        with self._lock:
            self._needed_zxid = max(self._needed_zxid, zxid)
        self._ping_if_behind()

    def _current(self) -> bool:
        return self._sock is not None and self._listed and self._seen_zxid >= self._needed_zxid

    # ------------------------------------------------------------------ the session's thread

    def _run(self) -> None:
        pause = RETRY_PAUSE[0]
        while not self._stopped.is_set():
            try:
                self._session()
            except (Unsupported, OSError, EOFError, _Cut, struct.error) as error:
                if not self._ready.is_set():
                    # The first session failed: the server has no persistent watches, or it
                    # takes no more connections from this address (``maxClientCnxns``).
                    kept = isinstance(error, Unsupported | OSError)
                    self._failure = error if kept else OSError(str(error))
                    self._ready.set()
                    return
                logger.debug(
                    "zookeeper: the members' events of %s were cut off: %s", self._path, error
                )
            with self._lock:
                self._sock = None
                # The next session may reach a server that trails this one: how new its list
                # is, its own answers say.
                self._listed = False
                self._seen_zxid = 0
                self._pinging = False
            if self._stopped.wait(pause):
                return
            pause = min(pause * 2, RETRY_PAUSE[1])

    def _session(self) -> None:
        host, port = random.choice(self._hosts)
        sock = socket.create_connection((host, port), timeout=SESSION_TIMEOUT_MS / 1000)
        try:
            reader = _Reader(sock)
            timeout = _handshake(sock, reader)
            with self._lock:
                self._sock = sock
                self._pinging = False
            self.counts["sessions"] += 1
            if self._credentials is not None:
                auth = (struct.pack("!i", 0), _string("digest"), _string(self._credentials))
                self._send(sock, _request(AUTH_XID, AUTH, *auth))
            watch = (_string(self._path), struct.pack("!i", PERSISTENT_RECURSIVE))
            self._send(sock, _request(WATCH_XID, ADD_WATCH, *watch))
            self._send(sock, _request(LIST_XID, GET_CHILDREN, _string(self._path), b"\0"))
            self._serve(sock, reader, timeout)
        finally:
            with self._lock:
                if self._sock is sock:
                    self._sock = None
            sock.close()

    def _serve(self, sock: socket.socket, reader: _Reader, timeout: float) -> None:
        """Read answers and events until the session is cut off; ping when a third of the
        timeout passed since this session last sent something (the server expires a silent
        one), and give up when the server said nothing for two thirds."""
        heard_at = time.monotonic()
        while not self._stopped.is_set():
            now = time.monotonic()
            if now - heard_at > timeout * 2 / 3:
                raise _Cut("the server said nothing for two thirds of the session")
            if now >= self._sent_at + timeout / 3:
                self._ping(sock, idle=True)
            if not _readable(sock, max(0.0, self._sent_at + timeout / 3 - now)):
                continue
            heard_at = time.monotonic()
            burst = _Burst()
            for frame in reader.frames():
                self._take(frame, burst)
            self._apply(burst)

    def _take(self, frame: bytes, burst: _Burst) -> None:
        """One answer or event, decoded into ``burst``. An event is decoded by one ``struct``
        call and its path compared as bytes: half of a job lost at once is thousands of
        events for every connection."""
        burst.bytes += len(frame) + 4
        xid, zxid, error = _HEADER.unpack_from(frame)
        if xid == NOTIFICATION_XID:
            burst.events += 1
            *_, kind, _state, length = _EVENT.unpack_from(frame)
            path = frame[_EVENT.size : _EVENT.size + length]
            if path.startswith(self._prefix):
                name = path[len(self._prefix) :]
                if b"/" not in name and kind in (NODE_CREATED, NODE_DELETED):
                    burst.changes.append((kind, name.decode(), None))
            elif path == self._prefix[:-1] and kind == NODE_DELETED:
                burst.changes.append((_CLOSED, "", None))  # close_job: nobody is left
            return
        burst.zxid = max(burst.zxid, zxid)
        if xid == PING_XID:
            with self._lock:
                self._pinging = False
        elif xid == WATCH_XID and error == UNIMPLEMENTED:
            raise Unsupported("the server has no persistent watches (ZooKeeper before 3.6)")
        elif xid == LIST_XID:
            burst.changes.append((_LISTED, "", self._list(frame[_HEADER.size :], error)))
        elif error not in (0, NO_NODE):
            raise _Cut(f"the server answered request {xid} with error {error}")

    def _list(self, body: bytes, error: int) -> list[str]:
        """The whole list, once a session: every event before it is in it."""
        self.counts["lists"] += 1
        if error == NO_NODE:  # no members node: the job was closed, nobody is left
            return []
        if error != 0:
            raise _Cut(f"the server refused to list {self._path} (error {error})")
        (count,), offset = struct.unpack_from("!i", body), 4
        names = []
        for _ in range(count):
            name, offset = _read_string(body, offset)
            names.append(name)
        return names

    def _apply(self, burst: _Burst) -> None:
        """The burst's changes in their order, then how new the list is, all at once: a
        reader never sees members older than the zxid said (``current``)."""
        self.counts["bytes_in"] += burst.bytes
        self.counts["events"] += burst.events
        removed: set[str] = set()
        with self._lock:
            for kind, name, names in burst.changes:
                if names is not None:  # the list
                    removed |= self._members.difference(names)
                    self._members = set(names)
                    self._listed = True
                elif not self._listed:
                    continue  # a change that the list, still on its way, shows
                elif kind == NODE_CREATED:
                    self._members.add(name)
                elif kind == NODE_DELETED:
                    removed.add(name)
                    self._members.discard(name)
                else:  # closed: every member
                    removed |= self._members
                    self._members.clear()
            changed = bool(burst.changes) and self._listed
            if changed:
                self._frozen = None
            if self._listed:
                self._seen_zxid = max(self._seen_zxid, burst.zxid)
        if self._listed:
            self._ready.set()
        if changed:
            self._on_change(frozenset(removed))
        self._tell_if_caught_up()
        self._ping_if_behind()

    def _tell_if_caught_up(self) -> None:
        with self._lock:
            tell = self._awaited and self._current()
            self._awaited = self._awaited and not tell
        if tell:
            self._on_current()

    def _ping_if_behind(self) -> None:
        """Ask for the server's zxid while the list is behind a state placed: a ping's answer
        carries it (one ping on its way at a time; its answer asks again if still behind)."""
        with self._lock:
            sock = self._sock
            if sock is None or self._current() or self._pinging:
                return
        self._ping(sock)

    def _ping(self, sock: socket.socket, *, idle: bool = False) -> None:
        with self._lock:
            if self._pinging and not idle:
                return
            self._pinging = True
        with suppress(OSError):  # the reading thread hears that the session is gone
            self._send(sock, struct.pack("!ii", PING_XID, PING))

    def _send(self, sock: socket.socket, request: bytes) -> None:
        with self._send_lock:
            self._sent_at = time.monotonic()
            sock.sendall(_frame(request))


_HEADER = struct.Struct("!iqi")
"""An answer's header: its xid, the server's newest zxid, an error code."""
_EVENT = struct.Struct("!iqiiii")
"""An event: the header, then its type, the session's state and the length of its path."""
_LISTED, _CLOSED = 100, 101
"""Changes of ``_Burst`` that are no ZooKeeper event type: a whole list, the job closed."""


class _Burst:
    """What one read of the socket brought: the members' changes in their order (a kind:
    ``NODE_CREATED`` or ``NODE_DELETED`` with a name, ``_LISTED`` with every name, or
    ``_CLOSED``), the newest zxid an answer carried, and how much came."""

    def __init__(self) -> None:
        self.changes: list[tuple[int, str, list[str] | None]] = []
        self.zxid = 0
        self.events = 0
        self.bytes = 0


class _Reader:
    """Length-prefixed frames off a socket, as they arrive."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def frame(self) -> bytes:
        """The next frame, waiting for it."""
        while True:
            frames = self._complete()
            if frames:
                return frames[0]
            self._fill()

    def frames(self) -> list[bytes]:
        """The frames that arrived: at least one read of the socket, which is readable."""
        self._fill()
        return self._complete()

    def _fill(self) -> None:
        chunk = self._sock.recv(1 << 20)
        if not chunk:
            raise EOFError("the server closed the connection")
        self._buffer += chunk

    def _complete(self) -> list[bytes]:
        frames = []
        offset = 0
        while len(self._buffer) - offset >= 4:
            (length,) = struct.unpack_from("!i", self._buffer, offset)
            if not 0 <= length <= MAX_FRAME:
                raise _Cut(f"a frame of {length} bytes")
            if len(self._buffer) - offset - 4 < length:
                break
            frames.append(self._buffer[offset + 4 : offset + 4 + length])
            offset += 4 + length
        self._buffer = self._buffer[offset:]
        return frames


def _handshake(sock: socket.socket, reader: _Reader) -> float:
    """Open a new session; its timeout in seconds, as the server granted it."""
    password = b"\0" * 16
    connect = struct.pack("!iqiqi", 0, 0, SESSION_TIMEOUT_MS, 0, len(password))
    sock.sendall(_frame(connect + password + b"\0"))  # read-only: no
    _version, granted = struct.unpack_from("!ii", reader.frame())
    if granted <= 0:
        raise _Cut("the server refused the session")
    return float(granted) / 1000


def _request(xid: int, opcode: int, *parts: bytes) -> bytes:
    return struct.pack("!ii", xid, opcode) + b"".join(parts)


def _frame(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


def _string(text: str) -> bytes:
    encoded = text.encode()
    return struct.pack("!i", len(encoded)) + encoded


def _read_string(buffer: bytes, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("!i", buffer, offset)
    start = offset + 4
    if length < 0:
        return "", start
    return buffer[start : start + length].decode(), start + length


def _readable(sock: socket.socket, timeout: float) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(timeout * 1000))


def _host_port(pair: str) -> tuple[str, int]:
    host, _, port = pair.strip().rpartition(":")
    return host.strip("[]"), int(port)
