"""The ZooKeeper Store: the only module that imports kazoo.

Layout of one job, under an optional chroot::

    /hpc-elastic                     world: CREATE only (if we create it): add a job, nothing else
    /hpc-elastic/<run_id>            digest ACL of the job's secret only; checked on connect
        state                        JSON JobState; its znode version is the CAS token
        members/<node_id>            ephemeral, one per live agent; data = NodeInfo JSON
        sentinels/<i>                ephemeral, ``SENTINELS`` of them: the connections that list
                                     the members and write each change into the roster
        roster                       the last changes of members/, for every other connection
        roster-log/<upto>            each of the roster's batches, the last ``roster.LOG_KEPT``
        notes/<topic>/<node_id>      persistent notes (``Store.put_note``): a hang's evidence
        notes/<topic>@               a topic's answer (``Store.claim_note``), created once
        back/<round>/<node_id>       ephemeral marks (``Store.mark``, ``Mark.BACK``), empty
        done/<round>/<node_id>       persistent marks (``Mark.DONE``), empty
        rounds/<round>/<digest>/<i>  a round's table (``Store.put_table``), in chunks
        closed                       tombstone left by close_job; everything else is removed
    /hpc-elastic/.clock-<n>          ephemeral, world READ: ``probe`` reads the server's time
    /hpc-elastic/@users              world: CREATE only, like the prefix ('@' is never in a run id)
    /hpc-elastic/@users/<user>       digest ACL of the user's own secret; checked on connect
        bad-nodes/<host>             JSON BadNode: a node that failed its health check, until when

Every step runs under ``client.retry`` and is idempotent, so a retry after a lost
connection cannot do it twice (each trick is commented where it is played). kazoo's event
and connection threads only ever record and enqueue: subscribers are called on this store's
own notifier thread, because they may block (the agent asks Slurm how many nodes to expect).

Connection states reach subscribers of ``subscribe_connection``: SUSPENDED (cut off; the
session may come back with its ephemerals and watches), CONNECTED (back with the same
session), LOST (the session expired: our memberships are gone, so ``on_session_lost`` fires
too and agents rejoin as new members). The agent stops its workers once SUSPENDED has lasted
longer than the session timeout, since the others may have re-formed without it by then.
"""

from __future__ import annotations

import atexit
import logging
import math
import queue
import random
import re
import select
import socket
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError, SequentialThreadingHandler
from kazoo.protocol.states import WatchedEvent
from kazoo.recipe.watchers import DataWatch
from kazoo.retry import RetryFailedError
from kazoo.security import ACL, OPEN_ACL_UNSAFE, Id, Permissions, make_digest_acl

from hpc_elastic.errors import RendezvousAccessError, RendezvousClosedError, RendezvousError
from hpc_elastic.rendezvous import roster, tables
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.backend import (
    ABSENT,
    NOTE_SEPARATOR,
    CachedStore,
    ConnectionState,
    Mark,
    check_node_id,
    check_note_key,
    note_topic,
    table_digest,
)
from hpc_elastic.rendezvous.badnode import BadNode, check_host
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.secret import require_secret

logger = logging.getLogger(__name__)

PREFIX = "/hpc-elastic"
DIGEST_USER = "hpc-elastic"
CONNECT_TIMEOUT = 10.0
"""Seconds to wait for the ensemble at start before giving up with a clear error."""
RETRY_DEADLINE = 60.0
"""Seconds one operation keeps retrying through connection losses (e.g. a server restart)."""
ROUNDS_SEEN = 8
"""Rounds' nodes for marks a connection remembers to exist (``_round_made``)."""
COALESCE = 0.02
"""Seconds a membership change waits for others before the member list is fetched again."""
SENTINELS = 2
"""Connections of a job that list its members and write each change into the roster; every
other connection reads the roster (``_Members``). Two, so that the loss of one leaves the
roster written while the others list once and one of them takes the free slot."""
ROSTER_PATIENCE = 1.0
"""Seconds a connection whose list is older than its state waits for the roster to carry it
any further before it lists the members itself (its sentinels lost or cut off); while the
roster moves on, behind a busy sentinel, it waits on."""
SLOT_SPREAD = 0.5
"""Seconds over which the connections that see a sentinel's slot freed spread their looks at
it: the first to look takes it, and most of the others find it taken by a read, where all
of them at once would each send a create for the ensemble to refuse."""
ANSWER_WAIT = 2.0
"""Seconds a connect attempt first waits for the server's answer (``answer_wait``)."""

TABLE_CHUNK = 512 * 1024
"""Bytes of a round's table in one znode, before it is compressed: half of ``jute.maxbuffer``
(1 MB by default), which bounds every request, so a table of any size goes as several. zlib
makes a chunk larger by a few hundred bytes at most, where it cannot make it smaller."""
TABLE_LEVEL = 6
"""zlib's level for a table's chunks: a table of real records (ids of ``<slot>-<pid>-<hex>``,
host names, ports) keeps 18 % of its bytes, packed in 21 ms at 16,384 members; level 9 keeps
17 % in 79 ms, level 1 19 % in 9 ms (``bench/table_bytes.py``)."""
FORGET_BATCH = 2000
"""Deletes in one transaction when a round is forgotten: one write through the quorum for
thousands of marks (about 100 bytes each, well under ``jute.maxbuffer``), where kazoo's
recursive delete makes one write a znode."""
_DIGEST = re.compile(r"[0-9a-f]{64}")
"""A table's name (``table_digest``); anything else names no table."""

_SHARED_ACL = [ACL(Permissions.CREATE, Id("world", "anyone"))]
"""For the common prefix (and the chroot above it) when we are the ones to create it: anyone
may add a job, nobody may list, read, delete or re-ACL. With DELETE, anyone could remove a
job node in the instant before its first child exists and re-create it as their own; with
READ, anyone could list every job. A site that made the prefix itself should give it the same
ACL (docs/rendezvous.md); every job node is checked on connect anyway."""


def packed(table: bytes, level: int = TABLE_LEVEL) -> list[bytes]:
    """A round's table as its znodes hold it: each ``TABLE_CHUNK`` of it compressed on its
    own, at zlib's ``level`` (a benchmark compares levels). Every newcomer of a round reads
    its table whole (a join storm of N agents each reads all N records), so its bytes are the
    ensemble's largest cost that grows with N², and a table of real records compresses to
    about a fifth. Each chunk stands alone: two proposers of the same table (two machines,
    whose zlib may not make the same bytes) each fill in the chunks missing, and a table of
    one's chunks and the other's reads as the one table."""
    chunks = [table[at : at + TABLE_CHUNK] for at in range(0, len(table), TABLE_CHUNK)]
    return [zlib.compress(chunk, level) for chunk in chunks or [b""]]


def unpacked(chunks: Sequence[bytes]) -> bytes | None:
    """The table that ``packed`` made into ``chunks``; None where one of them is not a whole
    zlib stream of at most ``TABLE_CHUNK`` bytes (damaged or planted), as for a table only
    partly written. Bounded: a chunk is never inflated past ``TABLE_CHUNK``."""
    parts = []
    for chunk in chunks:
        inflate = zlib.decompressobj()
        try:
            part = inflate.decompress(chunk, TABLE_CHUNK + 1)
        except zlib.error:
            return None
        if not inflate.eof or inflate.unused_data or len(part) > TABLE_CHUNK:
            return None
        parts.append(part)
    return b"".join(parts)


@dataclass(frozen=True)
class ZooKeeperAddress:
    """``--zk``: comma-separated host:port pairs, optionally followed by a chroot path."""

    hosts: str
    chroot: str = ""

    @classmethod
    def parse(cls, text: str) -> ZooKeeperAddress:
        hosts, slash, chroot = text.strip().partition("/")
        pairs = [pair.strip() for pair in hosts.split(",")]
        if not all(_is_host_port(pair) for pair in pairs):
            raise RendezvousError(
                f"--zk '{text}' is not a ZooKeeper address; give host:port pairs separated by "
                "commas, optionally followed by a chroot, e.g. 'zk1:2181,zk2:2181/team'."
            )
        return cls(",".join(pairs), (slash + chroot).rstrip("/"))

    def job_path(self, run_id: str) -> str:
        return f"{self.chroot}{PREFIX}/{run_id}"

    def __str__(self) -> str:
        return self.hosts + self.chroot


def _is_host_port(pair: str) -> bool:
    host, _, port = pair.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


@contextmanager
def _converted(address: ZooKeeperAddress, run_id: str) -> Iterator[None]:
    """Turn kazoo's errors into RendezvousError at the boundary."""
    try:
        yield
    except NoAuthError as error:
        raise RendezvousError(
            f"ZooKeeper at '{address}' refused access to job '{run_id}'; its secret does not "
            "match the one in --zk-auth-file."
        ) from error
    except (RetryFailedError, KazooTimeoutError) as error:
        raise RendezvousError(
            f"ZooKeeper at '{address}' stayed unreachable for {RETRY_DEADLINE:g} s while "
            f"serving job '{run_id}'; check that the ensemble runs."
        ) from error
    except KazooException as error:
        raise RendezvousError(
            f"ZooKeeper at '{address}' failed an operation for job '{run_id}' "
            f"({type(error).__name__}); check the server's log."
        ) from error


def answer_wait(given_up: int, session_timeout: float, hosts: int) -> float:
    """Seconds the next connect attempt waits for the server's answer (the TCP handshake, then
    the reply to its connect request), after ``given_up`` attempts in a row went unanswered:
    ``ANSWER_WAIT``, doubled after each, never more than kazoo's own wait (the session timeout
    over the number of hosts). A server that answers at all answers a reconnection at once
    and a new session within a commit; doubling still lets a slow one get through."""
    return min(session_timeout / hosts, ANSWER_WAIT * 2.0**given_up)


def poll_select(
    rlist: Sequence[Any], wlist: Sequence[Any], timeout: float | None
) -> tuple[list[Any], list[Any], list[Any]]:
    """``select.select``'s answer for sockets (or descriptors) to read and to write, asked of
    ``poll(2)`` in one call, with no limit on a descriptor's number. An error or a hang-up
    counts as ready on both sides, as with ``selectors``: the caller's next read or write
    meets it. ``timeout`` None waits for ever."""
    poller = select.poll()
    wanted: dict[int, int] = {}
    files: dict[int, list[Any]] = {}
    for flag, listed in ((select.POLLIN, rlist), (select.POLLOUT, wlist)):
        for file in listed:
            fd = file if isinstance(file, int) else file.fileno()
            if fd < 0:
                raise ValueError(f"Invalid file descriptor: {fd}")
            wanted[fd] = wanted.get(fd, 0) | flag
            same = files.setdefault(fd, [])
            if file not in same:
                same.append(file)
    for fd, flags in wanted.items():
        poller.register(fd, flags)
    milliseconds = None if timeout is None else max(0, math.ceil(timeout * 1000))
    readable: list[Any] = []
    writable: list[Any] = []
    for fd, events in poller.poll(milliseconds):
        for file in files[fd]:
            if events & ~select.POLLOUT and file in rlist:
                readable.append(file)
            if events & ~select.POLLIN and file in wlist:
                writable.append(file)
    return readable, writable, []


class _BoundedHandler(SequentialThreadingHandler):  # type: ignore[misc]
    """kazoo's threading handler (its public ``handler`` option) with two waits bounded, and
    a ``select`` that makes no selector.

    First, its ``start`` registers an ``atexit`` hook that joins its callback threads, and
    one of them can be blocked for good: on a lost connection kazoo calls every watch, and a
    ``DataWatch`` then reads its node again, a request that kazoo holds until the connection
    comes back. With the ensemble gone, an agent that had decided to exit hung in that hook
    for ever. The threads are daemons, so nothing is lost by not joining them at exit; a
    ``client.stop()`` still stops them.

    Second, a connect attempt that gets no answer is given up after ``answer_wait`` seconds;
    kazoo's connection retry then tries again within a second.

    kazoo waits the session timeout over the number of hosts for the reply to a connect
    request (``ConnectionHandler._connect``: ``_invoke(session_timeout / len(hosts), ...)``),
    and its retry backoff only starts after that. ZooKeeper 3.8.0 leaves some requests
    without a reply and their connection open: one read while the server starts, before its
    database is loaded, is refused ("ZooKeeperServer not running"), and closing it then fails
    on a NullPointerException (``zkDb`` is null) before the socket is closed. With a 20 s
    session a client whose attempt fell into that window came back 20 s after the server did,
    or found its session expired meanwhile (tests/rendezvous/test_store_contract.py, ci13).

    The trick: every socket kazoo asks for goes through ``create_connection``, so a timer armed
    there shuts the socket down when the attempt is still unanswered at the deadline; kazoo
    then reads the end of the stream, drops the attempt ("socket connection broken") and
    retries. The client's CONNECTED state (``on_state``, a listener added before ``start``)
    disarms it: kazoo reports CONNECTED as soon as it has read the reply.

    Third, kazoo's ``select`` makes an epoll selector, registers the sockets and closes it
    again at every turn of a connection's loop and before every chunk of a reply it reads:
    py-spy put 30 % of a 4,096-agent benchmark driver's time during a 1 % loss there
    (``EpollSelector.close``, ``register``). ``poll_select`` asks ``poll(2)`` once instead.
    """

    def __init__(self, session_timeout: float, hosts: int) -> None:
        super().__init__()
        self._session_timeout = session_timeout
        self._hosts = hosts
        self._lock = threading.Lock()
        self._pending: tuple[socket.socket, threading.Timer] | None = None
        """The socket of the attempt waiting for its answer, and the timer that gives it up."""
        self._given_up = 0

    def start(self) -> None:
        super().start()
        atexit.unregister(self.stop)

    def select(
        self,
        rlist: Sequence[Any],
        wlist: Sequence[Any],
        xlist: Sequence[Any],
        timeout: float | None = None,
    ) -> tuple[list[Any], list[Any], list[Any]]:
        return poll_select(rlist, wlist, timeout)

    def create_connection(self, *args: Any, **kwargs: Any) -> socket.socket:
        wait = answer_wait(self._given_up, self._session_timeout, self._hosts)
        if kwargs.get("timeout") is not None:  # kazoo's: the session timeout, for the handshake
            kwargs["timeout"] = min(float(kwargs["timeout"]), wait)
        try:
            sock: socket.socket = super().create_connection(*args, **kwargs)
        except TimeoutError:
            with self._lock:
                self._given_up += 1
            raise
        timer = threading.Timer(wait, self._give_up, (sock, wait))
        timer.daemon = True
        with self._lock:
            self._disarm()
            self._pending = (sock, timer)
        timer.start()
        return sock

    def on_state(self, state: str) -> None:
        """The client's state listener: CONNECTED means the pending attempt was answered."""
        if state == KazooState.CONNECTED:
            with self._lock:
                self._disarm()
                self._given_up = 0

    def _disarm(self) -> None:
        """Forget the pending attempt (under ``_lock``)."""
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None

    def _give_up(self, sock: socket.socket, wait: float) -> None:
        with self._lock:
            if self._pending is None or self._pending[0] is not sock:
                return  # answered, or a newer attempt replaced it
            self._pending = None
            self._given_up += 1
        logger.debug("zookeeper: no answer to a connect attempt within %g s; trying again", wait)
        with suppress(OSError):  # kazoo closed it meanwhile
            sock.shutdown(socket.SHUT_RDWR)


def open_client(
    address: ZooKeeperAddress,
    secret: str | None,
    session_timeout: float,
    connect_timeout: float = CONNECT_TIMEOUT,
    client_id: tuple[int, bytes] | None = None,
) -> KazooClient:
    """A started client, or a clear error once ``connect_timeout`` has passed.

    ``client_id`` (session id, password) resumes an existing session instead of opening one:
    tests use it to expire a session for real. A connect attempt that the server leaves
    unanswered is tried again after ``answer_wait`` seconds, not after kazoo's session
    timeout, and the process's exit never waits for kazoo's threads (``_BoundedHandler``).
    """
    handler = _BoundedHandler(session_timeout, len(address.hosts.split(",")))
    client = KazooClient(
        hosts=address.hosts,
        timeout=session_timeout,
        handler=handler,
        client_id=client_id,
        auth_data=[("digest", f"{DIGEST_USER}:{secret}")] if secret else None,
        connection_retry={"max_tries": -1, "delay": 0.1, "max_delay": 1.0},
        command_retry={
            "max_tries": -1,
            "delay": 0.05,
            "max_delay": 1.0,
            "deadline": RETRY_DEADLINE,
        },
    )
    client.add_listener(handler.on_state)
    logger.debug("zookeeper: connecting to %s (session %g s)", address, session_timeout)
    try:
        client.start(timeout=connect_timeout)
    except KazooTimeoutError as error:
        client.close()
        raise RendezvousError(
            f"ZooKeeper at '{address}' did not answer within {connect_timeout:g} s; check --zk "
            "and that the server runs."
        ) from error
    return client


class ZooKeeperStore(CachedStore):
    """One job's rendezvous on ZooKeeper; the state and membership are cached by watches.

    Subscribers are called on a notifier thread of this store's own, never in kazoo's event
    or connection threads: kazoo forbids blocking there, and a subscriber may well block (the
    agent asks Slurm how many nodes to expect, which can take a minute).

    Why 63 methods: it is the ``Store`` interface on ZooKeeper (twenty methods, and
    ``session_id``, ``sentinel`` and ``job_exists`` for tests and ``close_job``), and under each
    request the one ZooKeeper operation that kazoo's ``retry`` may run twice, written so that a
    retry after a lost reply finds its own write (seventeen: the compare-and-set, the fenced
    mark, the batched deletes of a forgotten round, the synced read of the state and the
    transactions that keep a closed job closed among them), with the session id they check
    (``_session_number``) and what this connection knows it made (``_joined_already``,
    ``_round_made``); the four steps that open a job's nodes and refuse one another user made,
    and the one that makes a round's nodes; kazoo's watch and connection callbacks, the notifier
    thread that hands them on, the state remembered and the marks seen (eight). All of them
    share one client, one job path and one ACL, which is why
    they are one class. What needs none of that lives apart: the cached state, members and
    subscribers (``CachedStore``), the client and its retry and timeouts (``open_client``), the
    coalesced watches (``_CoalescedWatch``), who is alive and whether the list is as new as
    the state (``_Members``: the sentinels and the roster), the users' bad-node books
    (``BadNodeBook``).
    """

    def __init__(
        self,
        client: KazooClient,
        address: ZooKeeperAddress,
        run_id: str,
        secret: str | None,
        *,
        create: bool = True,
        sentinels: int = SENTINELS,
    ) -> None:
        """``create=False`` opens the job read-only, as ``status`` and ``cancel`` do: no znode is
        created (not the prefix, not the job node), so a mistyped run id leaves no trace and a
        client never squats a path for someone else. Either way, an existing job node must
        carry exactly the job's ACL, or RendezvousAccessError is raised. ``sentinels``: the
        job's number of sentinel slots, the same on every connection of the job."""
        super().__init__()
        self._client = client
        self._address = address
        self._run_id = run_id
        self._root = address.job_path(run_id)
        self._acl = [make_digest_acl(DIGEST_USER, secret, all=True)] if secret else OPEN_ACL_UNSAFE
        self._records: dict[str, tuple[int, bytes]] = {}
        """Member records by node id, with their creation order (czxid)."""
        self._joined: dict[str, tuple[int, bytes]] = {}
        """The members this connection made, with the session that owns each (``join``)."""
        self._rounds_seen: OrderedDict[str, None] = OrderedDict()
        """The latest rounds' nodes for marks that this connection knows exist."""
        self._seeing_rounds = threading.Lock()
        """One look at a round's node at a time (``_round_made``)."""
        self._fetching = threading.Lock()
        """One fetch of member records at a time, so handlers sharing this store share it."""
        self._connection_changes = 0
        """How many times kazoo said the connection changed: a view read before the latest
        change is not known to be the server's (``refresh_state``)."""
        self._refreshed_at = -1
        """``_connection_changes`` when the state was last read from the server."""
        self._refreshing = threading.Lock()
        """One read of the state at a time, so handlers sharing this store share it."""
        self._marks_watch: _CoalescedChildrenWatch | None = None
        """The watch on the marks this connection follows (``follow_marks``)."""
        self._followed: tuple[Mark, int] | None = None
        self._heard_marks: frozenset[str] = frozenset()
        """The followed marks as the watch last listed them (``seen_marks``)."""
        self._own_marks: frozenset[str] = frozenset()
        """The followed marks written through this connection since: seen at once, before
        the watch lists them."""
        self._following = threading.Lock()
        """One ``follow_marks`` at a time, so handlers sharing this store set one watch."""
        self._init_notes()
        self._notices: queue.SimpleQueue[_Notice] = queue.SimpleQueue()
        self._notifier = threading.Thread(
            target=self._deliver, name=f"zk-notify-{run_id}", daemon=True
        )
        self._notifier.start()
        self._members = _Members(
            client,
            self._root,
            self._acl,
            self._on_members,
            partial(self._notices.put, _CHANGED),
            sentinels=sentinels if create else 0,
        )
        """Who is alive, and whether that is as new as the state (``alive_is_current``)."""
        with self._converted():
            if create:
                self._ensure_job_node()
            # Before anything is written into the job node: it may be someone else's.
            self._verify_acl()
            if create:
                self._ensure_members_node()
            client.add_listener(self._on_connection_state)
            self._members.start()
            DataWatch(client, self._path("state"), self._on_state)
            _CoalescedChildrenWatch(client, self._path("notes"), self._on_notes)

    def _init_notes(self) -> None:
        self._topic_watch: _CoalescedChildrenWatch | None = None
        """The watch on the notes of the topic this connection follows (``note_keys``)."""
        self._topic_follows = 0
        """How many times a topic was followed: the number of the current watch, so that a
        late listing of an earlier watch on the same topic is not taken for a newer one."""

    @property
    def where(self) -> str:
        return f"ZooKeeper at '{self._address}'"

    @property
    def sentinel(self) -> bool:
        """Whether this connection lists the members for the job's others (``_Members``)."""
        return self._members.sentinel

    @property
    def session_id(self) -> tuple[int, bytes]:
        """The current session's id and password (kazoo's ``client_id``)."""
        session_id, password = self._client.client_id
        return session_id, password

    def set_state(self, data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        with self._converted():
            current, version, won = self._client.retry(self._compare_and_set, data, token)
        self._remember_state(current, version)
        return current, version, won

    def refresh_state(self, data: bytes, token: int) -> tuple[bytes | None, int]:
        """A ``sync`` and one read of the state, once a reconnection for all the handlers of
        this connection, and never a write: the default (a compare-and-set each) made every
        agent write the state at once after a leader change, and every write notified every
        connection. Whatever ``data`` and ``token`` hold, the server's state is read."""
        del data, token
        with self._refreshing:
            with self._lock:
                changes = self._connection_changes
            if self._refreshed_at != changes:
                with self._converted():
                    current, version = self._client.retry(self._read_state)
                self._remember_state(current, version)
                # A change during the read leaves this behind it: the next caller reads again.
                self._refreshed_at = changes
        return self.get_state()

    def join(self, node_id: str, data: bytes) -> None:
        """Every round begins with a join; only the first of a session asks ZooKeeper (three
        requests). Once this session has made the member, and ``alive`` still lists it, it
        is there: a restart of N agents then costs the ensemble no request for their joins."""
        if self._joined_already(node_id, data):
            return
        with self._converted():
            self._client.retry(self._join, node_id, data)

    def leave(self, node_id: str) -> None:
        with self._lock:
            self._joined.pop(node_id, None)
        with self._converted():
            self._client.retry(self._delete, self._path("members", node_id))

    def members(self, node_ids: Iterable[str]) -> list[bytes]:
        """Fetched once per member (a member's record never changes), all in flight at once;
        a fetch cut off by a connection loss is retried on its own."""
        wanted = list(node_ids)
        with self._fetching, self._converted():
            with self._lock:
                missing = [node_id for node_id in wanted if node_id not in self._records]
            pending = [
                (node_id, self._client.get_async(self._path("members", node_id)))
                for node_id in missing
            ]
            for node_id, result in pending:
                try:
                    data, stat = result.get(timeout=RETRY_DEADLINE)
                except NoNodeError:
                    continue
                except (ConnectionLoss, SessionExpiredError):
                    # Reading is idempotent, so the retry (which waits for the connection to
                    # come back) may simply ask again.
                    record = self._client.retry(self._get_record, node_id)
                    if record is None:
                        continue
                    data, stat = record
                with self._lock:
                    self._records[node_id] = (stat.czxid, data)
        with self._lock:
            records = [self._records[node_id] for node_id in wanted if node_id in self._records]
        return [data for _, data in sorted(records)]

    def put_note(self, key: str, data: bytes) -> None:
        path = self._note_path(check_note_key(key))
        with self._converted():
            self._client.retry(self._write_note, path, data, False)

    def claim_note(self, key: str, data: bytes) -> bytes:
        path = self._note_path(check_note_key(key))
        with self._converted():
            current: bytes = self._client.retry(self._write_note, path, data, True)
        return current

    def notes(self, topic: str) -> dict[str, bytes]:
        """One listing of the topic, then its every note and its answer fetched at once (all
        in flight together)."""
        answer = f"{topic}{NOTE_SEPARATOR}"
        with self._converted():
            try:
                names = self._client.retry(self._client.get_children, self._path("notes", topic))
            except NoNodeError:
                names = []  # no node's note on it (or the job is closed)
            keys = [f"{answer}{name}" for name in names] + [answer]
            pending = [(key, self._client.get_async(self._note_path(key))) for key in keys]
            found: dict[str, bytes] = {}
            for key, result in pending:
                try:
                    data, _ = result.get(timeout=RETRY_DEADLINE)
                except NoNodeError:
                    continue  # no answer yet, or removed by close_job since the listing
                except (ConnectionLoss, SessionExpiredError):
                    data = self._client.retry(self._read_note, self._note_path(key))
                    if data is None:
                        continue
                found[key] = data
        return found

    def forget_notes(self, topic: str) -> None:
        """The topic's node and its notes (in transactions of ``FORGET_BATCH`` deletes), then
        its answer."""
        with self._converted():
            self._client.retry(self._delete_tree, self._path("notes", topic), 1)
            self._client.retry(self._delete, self._path("notes", f"{topic}{NOTE_SEPARATOR}"))

    def follow_notes(self, topic: str) -> None:
        """A children watch on the topic's node: its first listing is made before this
        returns, and a topic nobody wrote on yet is listed once its first note makes it."""
        with self._lock:
            self._followed_topic, self._note_keys = topic, frozenset()
            self._topic_follows += 1
            following = (topic, self._topic_follows)
        with self._converted():
            watch = _CoalescedChildrenWatch(
                self._client, self._path("notes", topic), partial(self._on_topic_notes, following)
            )
        with self._lock:
            previous, self._topic_watch = self._topic_watch, watch
        if previous is not None:
            previous.stop()

    def _note_path(self, key: str) -> str:
        """A node's note under its topic's node, where only the topic's followers list it;
        a topic's answer (no node id) beside the topics, where every connection sees it."""
        topic, _, node_id = key.partition(NOTE_SEPARATOR)
        return self._path("notes", topic, node_id) if node_id else self._path("notes", key)

    def mark(self, kind: Mark, round_number: int, node_id: str, token: int) -> bool:
        path = self._path(kind.value, str(round_number), check_node_id(node_id))
        if token == ABSENT:
            return False  # A check of version -1 passes any version: it would fence nothing.
        with self._converted():
            marked: bool = self._client.retry(self._mark, kind, path, token)
        with self._lock:
            if marked and self._followed == (kind, round_number):
                self._own_marks |= {node_id}
        return marked

    def marks(self, kind: Mark, round_number: int) -> frozenset[str]:
        path = self._path(kind.value, str(round_number))
        with self._converted():
            try:
                return frozenset(self._client.retry(self._client.get_children, path))
            except NoNodeError:
                return frozenset()

    def seen_marks(self, kind: Mark, round_number: int) -> frozenset[str]:
        """From the watch's last listing and this connection's own marks: no request once
        the marks are followed, however many handlers share this connection."""
        with self._following:
            with self._lock:
                if self._followed == (kind, round_number):
                    return self._seen_marks()
            self.follow_marks(kind, round_number)
            with self._lock:
                return self._seen_marks()

    def _seen_marks(self) -> frozenset[str]:
        """The marks heard and this connection's own, under ``_lock``: the very set the watch
        last listed while it holds our own, so that the agents of this connection decide on
        one object (``state.with_done`` computes once an object)."""
        if self._own_marks <= self._heard_marks:
            return self._heard_marks
        return self._heard_marks | self._own_marks

    def follow_marks(self, kind: Mark, round_number: int) -> None:
        path = self._path(kind.value, str(round_number))
        followed = (kind, round_number)
        with self._lock:
            self._followed, self._heard_marks, self._own_marks = followed, frozenset(), frozenset()
        with self._converted():
            # The round's node: made now (while the job is open) if no mark has made it yet,
            # and only then (each making is a write through the quorum, and every agent
            # follows every round). The watch's first listing is made before it returns.
            if self._client.retry(self._client.exists, path) is None:
                self._client.retry(self._ensure_with_parent, path, "no mark can be followed")
            watch = _CoalescedChildrenWatch(self._client, path, partial(self._on_marks, followed))
        with self._lock:
            previous, self._marks_watch = self._marks_watch, watch
        if previous is not None:
            previous.stop()

    def put_table(self, round_number: int, table: bytes) -> str:
        digest = table_digest(table)
        with self._converted():
            self._client.retry(
                self._put_table, self._path("rounds", str(round_number), digest), table
            )
        return digest

    def table(self, round_number: int, digest: str) -> bytes | None:
        """Every chunk in flight at once; a table only partly written reads as none."""
        if not _DIGEST.fullmatch(digest):
            return None
        path = self._path("rounds", str(round_number), digest)
        with self._converted():
            try:
                names = sorted(self._client.retry(self._client.get_children, path))
                pending = [self._client.get_async(f"{path}/{name}") for name in names]
                table = unpacked([result.get(timeout=RETRY_DEADLINE)[0] for result in pending])
            except NoNodeError:
                return None  # forgotten, or the job closed, since the listing
        return table if table is not None and table_digest(table) == digest else None

    def forget_rounds(self, before_round: int) -> None:
        with self._converted():
            for kind in (*(mark.value for mark in Mark), "rounds"):
                try:
                    rounds = self._client.retry(self._client.get_children, self._path(kind))
                except NoNodeError:
                    continue
                depth = 2 if kind == "rounds" else 1  # <digest>/<chunk>, or <node_id>
                for name in rounds:
                    if int(name) < before_round:
                        self._client.retry(self._delete_tree, self._path(kind, name), depth)

    def _write_note(self, path: str, data: bytes, claim: bool) -> bytes:
        """Create the note; an existing one is replaced, or with ``claim`` kept and returned.
        Idempotent: a retry after a lost reply finds our own note (a claim returns it, a put
        writes the same bytes again)."""
        for _ in range(2):
            try:
                self._client.create(path, data, acl=self._acl)
                return data
            except NodeExistsError:
                if claim:
                    current, _ = self._client.get(path)
                    return bytes(current)
                self._client.set(path, data)
                return data
            except NoNodeError:
                # The first note on its topic (or a job made before notes existed): make the
                # nodes above it while the job is open.
                self._ensure_with_parent(path.rsplit("/", 1)[0], "no note can be written")
        raise NoNodeError(path)

    def _mark(self, kind: Mark, path: str, token: int) -> bool:
        """One fenced mark: ``multi(check(state, token), create(path))``. Idempotent: a retry
        after a lost reply finds the mark there, and ours (ephemeral: this session owns it;
        persistent: nobody else writes a node's own mark), so it is a success whatever the
        state did since. A BACK mark of another session is deleted in the same fenced
        transaction and made again, so that it dies with the session that is alive.

        The first try takes the mark for a new one, as it nearly always is: one request, and
        a look at the mark (``exists``) only once the create finds it there. The round's node
        is looked at once a connection (``_round_made``)."""
        self._round_made(path.rsplit("/", 1)[0])
        stat = None
        for _ in range(3):
            if stat is not None and stat.ephemeralOwner in (0, self._session_number()):
                return True
            transaction = self._client.transaction()
            transaction.check(self._path("state"), token)
            if stat is not None:
                transaction.delete(path, stat.version)
            transaction.create(path, b"", acl=self._acl, ephemeral=kind.ephemeral)
            results = transaction.commit()
            # The operation that failed reports why (the others: RolledBackError or
            # RuntimeInconsistency), so the check and the create each say what went wrong.
            check, created = results[0], results[-1]
            if not any(isinstance(result, Exception) for result in results):
                return True
            if isinstance(check, NoNodeError) and self._client.exists(self._path("closed")):
                raise RendezvousClosedError(
                    f"Job '{self._run_id}' is closed (finished or cancelled); no mark can be "
                    "written."
                )
            if isinstance(check, (BadVersionError, NoNodeError)):
                return False  # The state moved on (or does not exist): refused, not an error.
            if isinstance(created, NoNodeError):
                # The round's node (or its kind's) is missing: make them, then mark again.
                self._ensure_with_parent(path.rsplit("/", 1)[0], "no mark can be written")
            # NodeExistsError: a try of ours (its reply lost) or a session of this id got
            # there first; BadVersionError of the delete: the mark changed since. Look again.
            stat = self._client.exists(path)
        raise RendezvousError(
            f"The mark '{path}' on ZooKeeper at '{self._address}' kept changing under three "
            "tries; another agent runs with this node id: give each agent its own."
        )

    def _round_made(self, round_path: str) -> None:
        """Make a round's node for its marks unless this connection knows it is there. When a
        round of thousands ends, every member marks at once: each mark that found the node
        missing made it again, two failed writes through the quorum apiece. One read a
        connection instead; a node forgotten since fails the mark's create, which makes it."""
        with self._seeing_rounds:  # the agents sharing this connection mark at once too
            with self._lock:
                if round_path in self._rounds_seen:
                    return
            if self._client.exists(round_path) is None:
                self._ensure_with_parent(round_path, "no mark can be written")
            with self._lock:
                self._rounds_seen[round_path] = None
                while len(self._rounds_seen) > ROUNDS_SEEN:
                    self._rounds_seen.popitem(last=False)

    def _put_table(self, path: str, table: bytes) -> None:
        """Each chunk ``path/<i>`` (``packed``) created unless it is there. The path is the
        table's digest, so a retry after a lost reply, or a second proposer of the same
        table, only fills in what is missing, and a chunk that is there already holds the
        same part of the table."""
        self._ensure_with_parent(path.rsplit("/", 1)[0], "no table can be written")
        self._create_while_open(path, "no table can be written")
        for index, chunk in enumerate(packed(table)):
            try:
                self._create(f"{path}/{index:06d}", chunk, False)
            except NoNodeError as error:
                raise RendezvousClosedError(
                    f"Job '{self._run_id}' is closed (finished or cancelled); no table can be "
                    "written."
                ) from error  # close_job removed the table's nodes since they were made

    def _delete_tree(self, path: str, depth: int) -> None:
        """``path`` and its descendants down to ``depth`` levels, children before parents, in
        transactions of ``FORGET_BATCH`` deletes. A transaction is refused whole if one of its
        znodes went meanwhile (a ``BACK`` mark dies with its session): the tree is listed and
        deleted again, and after three tries kazoo deletes what is left one by one."""
        for _ in range(3):
            doomed = self._tree(path, depth)
            batches = [doomed[at : at + FORGET_BATCH] for at in range(0, len(doomed), FORGET_BATCH)]
            if all(_deleted_all(self._client, batch) for batch in batches):
                return
        self._delete(path, recursive=True)

    def _tree(self, path: str, depth: int) -> list[str]:
        """``path``'s descendants down to ``depth`` levels, deepest first, then ``path``."""
        try:
            children = self._client.get_children(path) if depth > 0 else []
        except NoNodeError:
            return []
        below = [node for child in children for node in self._tree(f"{path}/{child}", depth - 1)]
        return [*below, path]

    def _ensure_with_parent(self, path: str, refused: str) -> None:
        """``path`` under its parent (a round's node under its kind's, ``back/7`` under
        ``back``; a topic's under ``notes``), each made unless it is there, and only while the
        job is open."""
        for node in (path.rsplit("/", 1)[0], path):
            self._create_while_open(node, refused)

    def _create_while_open(self, path: str, refused: str) -> None:
        """Create the persistent ``path`` only while the job is open: in one transaction with a
        ``check`` of ``members``, which ``close_job`` removes, so a late write can never
        recreate a closed job's nodes. An existing ``path`` is kept."""
        transaction = self._client.transaction()
        transaction.check(self._path("members"), -1)
        transaction.create(path, b"", acl=self._acl)
        results = transaction.commit()
        errors = [result for result in results if isinstance(result, Exception)]
        if isinstance(results[0], NoNodeError):
            raise RendezvousClosedError(
                f"Job '{self._run_id}' is closed (finished or cancelled); {refused}."
            )
        if errors and not any(isinstance(error, NodeExistsError) for error in errors):
            raise errors[0]

    def _read_note(self, path: str) -> bytes | None:
        try:
            data, _ = self._client.get(path)
        except NoNodeError:
            return None
        return bytes(data)

    def job_exists(self) -> bool:
        """Whether the job node exists (an agent has connected at least once)."""
        with self._converted():
            return self._client.retry(self._client.exists, self._root) is not None

    def is_closed(self) -> bool:
        with self._converted():
            return self._client.retry(self._client.exists, self._path("closed")) is not None

    def close_job(self) -> None:
        """Tombstone first, so a late agent never takes the empty job for a new one; then the
        members node, whose absence also stops anyone from creating the state again (see
        ``_compare_and_set``); then the state. Each tree goes in transactions of
        ``FORGET_BATCH`` deletes (``_delete_tree``): one by one, the members, marks and tables
        of a job of 496 agents took the closer seconds."""
        with self._converted():
            self._client.retry(self._create, self._path("closed"), b"", False)
            self._client.retry(self._delete_tree, self._path("members"), 1)
            self._client.retry(self._delete_tree, self._path("notes"), 2)  # <topic>/<node_id>
            for kind in Mark:  # <kind>/<round>/<node_id>
                self._client.retry(self._delete_tree, self._path(kind.value), 2)
            self._client.retry(self._delete_tree, self._path("rounds"), 3)  # <r>/<digest>/<i>
            self._client.retry(self._delete_tree, self._path("sentinels"), 1)
            self._client.retry(self._delete_tree, self._path("roster-log"), 1)
            self._client.retry(self._delete, self._path("roster"))
            self._client.retry(self._delete, self._path("state"))
        logger.debug("zookeeper: job %s closed", self._run_id)

    def release(self) -> None:
        self._client.remove_listener(self._on_connection_state)
        self._client.stop()
        self._client.close()
        self._notices.put(_STOP)

    def _path(self, *parts: str) -> str:
        return "/".join((self._root, *parts))

    def _converted(self) -> Any:
        return _converted(self._address, self._run_id)

    def _ensure_job_node(self) -> None:
        """The prefix (and chroot) nodes, then the job node; each kept if it exists."""
        parents = [part for part in self._root.split("/")[1:-1]]
        for depth in range(1, len(parents) + 1):
            path = "/" + "/".join(parents[:depth])
            self._create_unless_refused(path, _SHARED_ACL)
        self._create_unless_refused(self._root, self._acl)

    def _create_unless_refused(self, path: str, acl: list[ACL]) -> None:
        """Create ``path`` if missing. Creating needs CREATE on the parent, which the prefix
        grants everyone: a refusal means someone made a parent theirs."""
        try:
            self._client.retry(self._create, path, b"", False, acl)
        except NoAuthError as error:
            parent = path.rsplit("/", 1)[0] or "/"
            raise RendezvousAccessError(
                f"ZooKeeper at '{self._address}' refused to create '{path}' for job "
                f"'{self._run_id}' because another user made '{parent}' theirs; ask the "
                "ensemble's admin to give it the ACL world:anyone CREATE only (see "
                "docs/rendezvous.md)."
            ) from error

    def _ensure_members_node(self) -> None:
        """``members`` and ``notes``, not once the job is closed: the absence of ``members``
        is what keeps a closed job closed."""
        if self._client.retry(self._client.exists, self._path("closed")) is None:
            for name in ("members", "notes", "sentinels", "roster", "roster-log"):
                self._client.retry(self._create, self._path(name), b"", False)

    def _verify_acl(self) -> None:
        """Refuse a job node that is not exactly ours. Anyone may create children of the
        prefix, so another user who guessed the run id could have created the job node first,
        with an ACL that lets them read the state (the master address), forge it, join as a
        fake member or plant ``closed``. Our own creates skip an existing node (that is what
        makes them idempotent), so this check is what stops us from moving in."""
        try:
            acls, _ = self._client.retry(self._client.get_acls, self._root)
        except NoNodeError:
            return  # Read-only and no agent has come yet: nothing to trust or to refuse.
        except NoAuthError as error:
            # Reading an ACL needs READ or ADMIN, which the job's own ACL grants its secret.
            raise RendezvousAccessError(
                f"ZooKeeper at '{self._address}' refused access to job '{self._run_id}'; its "
                "secret does not match the one in --zk-auth-file, or another user created "
                f"'{self._root}' first (then cancel the job and submit it again)."
            ) from error
        if _acl_set(acls) != _acl_set(self._acl):
            found = ", ".join(sorted(f"{a.id.scheme}:{a.id.id}={a.perms}" for a in acls))
            logger.debug("zookeeper: job node %s has a foreign ACL: %s", self._root, found)
            raise RendezvousAccessError(
                f"ZooKeeper node '{self._root}' of job '{self._run_id}' is not guarded by the "
                f"job's secret (its ACL is '{found}'), so another user may have created it to "
                "read or forge the job; cancel the job and submit it again."
            )

    def _create(
        self, path: str, data: bytes, ephemeral: bool, acl: list[ACL] | None = None
    ) -> None:
        with suppress(NodeExistsError):
            self._client.create(path, data, acl=acl or self._acl, ephemeral=ephemeral)

    def _delete(self, path: str, recursive: bool = False) -> None:
        with suppress(NoNodeError):
            self._client.delete(path, recursive=recursive)

    def _get_record(self, node_id: str) -> tuple[bytes, Any] | None:
        try:
            data, stat = self._client.get(self._path("members", node_id))
        except NoNodeError:
            return None
        return data, stat

    def _compare_and_set(self, data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        try:
            if token == ABSENT:
                self._create_state(data)
                return data, 0, True
            stat = self._client.set(self._path("state"), data, version=token)
            return data, stat.version, True
        except (NodeExistsError, BadVersionError, NoNodeError):
            current, version = self._get_state()
            # A retry after a lost reply finds our own write: that is a win.
            return current, version, current == data

    def _read_state(self) -> tuple[bytes | None, int]:
        # The server this connection reached again may trail the leader; ``sync`` has it
        # catch up first, so the read that follows is at least as new as any finished write.
        self._client.sync(self._path("state"))
        return self._get_state()

    def _get_state(self) -> tuple[bytes | None, int]:
        try:
            current, stat = self._client.get(self._path("state"))
        except NoNodeError:
            return None, ABSENT
        return current, stat.version

    def _create_state(self, data: bytes) -> None:
        """Create the state only while the job is open, in one transaction: ``check`` with
        version -1 passes for any version of ``members`` but fails once ``close_job`` has
        removed it, so a closed job can never be reopened by an agent that checked
        ``is_closed`` just before the close."""
        transaction = self._client.transaction()
        transaction.check(self._path("members"), -1)
        transaction.create(self._path("state"), data, acl=self._acl)
        errors = [result for result in transaction.commit() if isinstance(result, Exception)]
        # The other operations of a failed transaction report RolledBackError or
        # RuntimeInconsistency; the one that failed says why.
        for cause in (NoNodeError, NodeExistsError):
            for error in errors:
                if isinstance(error, cause):
                    raise error
        if errors:
            raise errors[0]

    def _join(self, node_id: str, data: bytes) -> None:
        closed = RendezvousClosedError(
            f"Job '{self._run_id}' is closed (finished or cancelled); nothing to join."
        )
        if self._client.exists(self._path("closed")) is not None:
            raise closed
        path = self._path("members", node_id)
        try:
            self._client.create(path, data, acl=self._acl, ephemeral=True)
        except NoNodeError as error:
            raise closed from error  # Only close_job removes the members node.
        except NodeExistsError:
            # Ours from an attempt whose reply was lost: done. Another session's (an agent
            # of this id whose old session has not expired yet): replace it, so the member
            # dies with the session that is alive.
            stat = self._client.exists(path)
            if stat is not None and stat.ephemeralOwner != self._session_number():
                self._delete(path)
                self._client.create(path, data, acl=self._acl, ephemeral=True)
        with self._lock:
            self._joined[node_id] = (self._session_number(), data)

    def _joined_already(self, node_id: str, data: bytes) -> bool:
        """Whether this very session made ``node_id``'s member with ``data``, and the members'
        watch still lists it. A session lost since has another id, so its members are made
        again; one another session deleted (``close_job``, or an agent of the same id) drops
        out of ``alive`` with the watch's next listing."""
        client_id = self._client.client_id
        with self._lock:
            made = self._joined.get(node_id)
            listed = node_id in self._alive
        return client_id is not None and made == (client_id[0], data) and listed

    def _session_number(self) -> int:
        """This connection's session id. kazoo has none while it reconnects (a leader was
        killed: seen at 256 agents as "'NoneType' object is not subscriptable"); that is a
        ConnectionLoss, which ``client.retry`` waits out like any other."""
        client_id = self._client.client_id
        if client_id is None:
            raise ConnectionLoss("the connection has no session while it reconnects")
        session: int = client_id[0]
        return session

    def alive_is_current(self) -> bool:
        return self._members.current()

    def _remember_state(self, data: bytes | None, token: int) -> None:
        super()._remember_state(data, token)
        self._members.place_state()

    def _on_state(self, data: bytes | None, stat: Any) -> None:
        """Runs in kazoo's thread: remember and hand over to the notifier, nothing more."""
        self._remember_state(data, stat.version if stat is not None else ABSENT)
        self._notices.put(_CHANGED)

    def _on_members(self, alive: frozenset[str]) -> None:
        with self._lock:
            self._alive = alive
            for gone in self._records.keys() - self._alive:
                del self._records[gone]
        self._notices.put(_CHANGED)

    def _on_marks(self, followed: tuple[Mark, int], children: list[str], heard: int) -> None:
        del heard  # marks are decided on as heard: a mark missing yet is waited for
        with self._lock:
            if followed != self._followed:
                return  # the late listing of marks this connection no longer follows
            self._heard_marks = frozenset(children)
        self._notices.put(_CHANGED)

    def _on_notes(self, children: list[str], heard: int) -> None:
        """The topics' nodes and answers: as many names as topics, whatever the job's size."""
        del heard  # a note missing yet is waited for
        with self._lock:
            self._note_topics = frozenset(note_topic(name) for name in children)
        self._notices.put(_CHANGED)

    def _on_topic_notes(self, following: tuple[str, int], children: list[str], heard: int) -> None:
        del heard  # a note missing yet is waited for
        topic, number = following
        with self._lock:
            if (topic, number) != (self._followed_topic, self._topic_follows):
                return  # a late listing of a watch this connection no longer follows
            self._note_keys = frozenset(f"{topic}{NOTE_SEPARATOR}{c}" for c in children)
        self._notices.put(_CHANGED)

    def _on_connection_state(self, state: str) -> None:
        """Runs in kazoo's connection thread, which must never block: only enqueue."""
        logger.debug("zookeeper: connection of job %s is %s", self._run_id, state)
        with self._lock:
            self._connection_changes += 1
            if state == KazooState.LOST:  # the session's BACK marks went with it
                self._own_marks = frozenset()
        self._notices.put(_CONNECTION_STATES[state])

    def _deliver(self) -> None:
        """The notifier thread: call subscribers, in the order the events came."""
        while True:
            notice = self._notices.get()
            if notice is _STOP:
                return
            if notice is _CHANGED:
                for on_change in self._callbacks():
                    _call(on_change)
                continue
            assert isinstance(notice, ConnectionState)
            if notice is ConnectionState.LOST:
                for on_session_lost in self._callbacks(session_lost=True):
                    _call(on_session_lost)
            for callback in self._connection_callbacks():
                _call(partial(callback, notice))


def _call(callback: Callable[[], None]) -> None:
    """One subscriber's error must not end the notifier thread, which serves them all."""
    try:
        callback()
    except Exception:
        logger.exception("zookeeper: a subscriber failed; the others are still notified")


def _acl_set(acls: Iterable[ACL]) -> set[tuple[int, str, str]]:
    return {(acl.perms, acl.id.scheme, acl.id.id) for acl in acls}


class _Marker:
    """A notice that is not a connection state."""


_Notice = ConnectionState | _Marker
_CHANGED = _Marker()
_STOP = _Marker()
_CONNECTION_STATES = {
    KazooState.CONNECTED: ConnectionState.CONNECTED,
    KazooState.SUSPENDED: ConnectionState.SUSPENDED,
    KazooState.LOST: ConnectionState.LOST,
}


class _Members:
    """Who is alive, as this connection knows it, and whether that is as new as a state
    (``Store.alive_is_current``).

    A connection that holds one of the job's ``sentinels/<i>`` slots (ephemeral: the first
    connections to come claim them) lists ``members/`` at each burst of changes and writes
    what changed into the roster (``roster.py``); every other connection reads the roster at
    each version and carries its members on. So a loss of a few costs a connection a read of
    a few names, where every connection listing all N of them cost the ensemble O(N²) bytes.
    A connection that fell behind the batches the roster keeps reads the ones it missed from
    the log beside it (``roster-log/<upto>``, written with the roster in one transaction).
    It lists the members itself when neither carries it (it fell further behind, or a
    sentinel could not tell the change from the roster's end) or the roster leaves it behind a
    state for ``ROSTER_PATIENCE`` without carrying it any further (its sentinels lost and not
    replaced yet, or cut off); while the roster moves on, it waits on.

    The list is named by the ``pzxid`` of ``members/`` (``Members.upto``). Whether it is as new
    as a state: an ``exists`` of ``members/`` asked after the state was read answers with a
    ``pzxid`` at least that of every member made or deleted before the state was written; the
    list is as new once its ``upto`` reaches that. This holds through connection losses: a
    change missed while cut off is one the next ``exists`` counts and the list does not show.
    """

    def __init__(
        self,
        client: KazooClient,
        root: str,
        acl: list[ACL],
        on_members: Callable[[frozenset[str]], None],
        tell: Callable[[], None],
        *,
        sentinels: int,
    ) -> None:
        """``on_members(ids)``: a newer list, to keep; ``tell()``: called when the list
        catches up after ``current`` said no. ``sentinels``: slots this connection may claim
        (0: it only follows, as a read-only store does)."""
        self._client = client
        self._path = f"{root}/members"
        self._roster_path = f"{root}/roster"
        self._log_path = f"{root}/roster-log"
        self._slots = [f"{root}/sentinels/{i}" for i in range(sentinels)]
        self._acl = acl
        self._on_members = on_members
        self._tell = tell
        self._lock = threading.Lock()
        self._members = roster.NOBODY
        self._chain: roster.Members | None = None
        """The members at the roster's end when this sentinel last read or wrote it."""
        self._logged = 0
        """Batches this sentinel wrote into the log: it prunes the log every ``LOG_KEPT``."""
        self._needed = 0
        """The ``pzxid`` of ``members/`` after the latest state was read."""
        self._asking = 0
        """``exists`` asked for states and not answered yet."""
        self._unanswered = False
        """An ``exists`` went unanswered (a connection loss): asked again once back."""
        self._awaited = False
        """Whether ``current`` said no since the list last caught up."""
        self._roles = threading.Lock()
        self._slot: str | None = None
        """The sentinel slot this connection holds."""
        self._listing: _MembersWatch | None = None
        self._following: _CoalescedDataWatch | None = None
        self._patient = False
        """A listing after ``ROSTER_PATIENCE`` is scheduled."""

    def start(self) -> None:
        self._client.add_listener(self._on_session)
        self._take_role()

    @property
    def sentinel(self) -> bool:
        return self._slot is not None

    def current(self) -> bool:
        with self._lock:
            current = self._current()
            self._awaited = self._awaited or not current
        return current

    def place_state(self) -> None:
        """Ask ``members/``'s ``pzxid`` for the state just read (answered in kazoo's callback
        thread, which must not block: ``_answered`` only records)."""
        with self._lock:
            self._asking += 1
        try:
            asked = self._client.exists_async(self._path)
        except KazooException:  # the client is closed: no state needs the list any more
            with self._lock:
                self._asking -= 1
                self._unanswered = True
            return
        asked.rawlink(self._answered)

    def _answered(self, result: Any) -> None:
        with self._lock:
            self._asking -= 1
            try:
                stat = result.get_nowait()
            except KazooException:
                stat = None
                self._unanswered = True  # the connection was lost: asked again once back
            if stat is not None:
                self._needed = max(self._needed, stat.pzxid)
            wait = self._trails() and not self._patient
            self._patient = self._patient or wait
            held = self._members.upto
        self._caught_up()
        if wait:
            logger.debug(
                "zookeeper: session %s: the list of %s trails the state; waiting for the roster",
                self._session(),
                self._path,
            )
            _later(ROSTER_PATIENCE, partial(self._list_if_behind, held))

    def _current(self) -> bool:
        return self._asking == 0 and not self._unanswered and self._members.upto >= self._needed

    def _caught_up(self) -> None:
        with self._lock:
            tell = self._awaited and self._current()
            self._awaited = self._awaited and not tell
        if tell:
            self._tell()

    def _keep(self, members: roster.Members) -> roster.Members:
        """Keep ``members`` if newer than the list held, as the process's one copy of that
        list (``roster.SHARED``); the list held before."""
        members = roster.SHARED.one(self._path, members)
        with self._lock:
            before = self._members
            if members.upto > before.upto:
                self._members = members
                self._on_members(members.ids)  # under the lock: never an older list after
        self._caught_up()
        return before

    def _list(self) -> None:
        """Read the whole list once, without a watch: the roster tells of the next change."""
        try:
            children, stat = self._client.retry(
                self._client.get_children, self._path, include_data=True
            )
        except NoNodeError:
            self._keep(roster.CLOSED)  # only close_job removes members/
            return
        self._keep(roster.Members(frozenset(children), stat.pzxid, stat.cversion))

    def _list_if_behind(self, held: int) -> None:
        """List the members if the roster has carried them no further than ``held`` within
        a patience and, read once more (a busy process may not have handled its watch's
        event yet), still leaves them behind the state. A roster that moved has its
        sentinels at work, only behind the state for now: it is waited for again, by its
        watch, without a read."""
        with self._lock:
            behind = self._trails()
            moved = self._members.upto > held
            self._patient = behind and moved
            held = self._members.upto
        if behind and moved:
            logger.debug(
                "zookeeper: session %s: the roster of %s moves on, behind the state",
                self._session(),
                self._path,
            )
            _later(ROSTER_PATIENCE, partial(self._list_if_behind, held))
            return
        with suppress(KazooException):
            if self._behind():
                data, _ = self._client.retry(self._client.get, self._roster_path)
                self._carry(data) or self._carry_by_log(data)
            if self._behind():
                logger.debug(
                    "zookeeper: session %s: the roster kept %s waiting; listing it",
                    self._session(),
                    self._path,
                )
                self._list()

    def _behind(self) -> bool:
        with self._lock:
            return self._trails()

    def _session(self) -> str:
        """This connection's session id, which tells connections apart in the debug log."""
        client_id = self._client.client_id
        return "none" if client_id is None else f"{client_id[0]:#x}"

    def _trails(self) -> bool:
        """Under the lock: whether this follower's list is older than its latest state."""
        return self._members.upto < self._needed and not self.sentinel

    def _carry(self, data: bytes) -> bool:
        """Carry the members on by the roster in ``data``; whether it could."""
        return self._carried_by(roster.decode(data))

    def _carried_by(self, written: roster.Roster) -> bool:
        carried = roster.SHARED.carried(self._path, written, self._members)
        if carried is not None:
            self._keep(carried)
        return carried is not None

    def _carry_by_log(self, data: bytes) -> bool:
        """Carry the members on by the batches they missed: those of the log (``roster-log``)
        from the point they hold up to the roster's own, read in parallel, then the roster's
        (``roster.logged``). Only the names of the log's entries and the batches missed are
        read, where a listing reads every member. Whether it could."""
        head = roster.decode(data)
        with self._lock:
            held = self._members.upto
        if not head.batches or held == roster.UNLISTED:
            return False
        try:
            names = self._client.retry(self._client.get_children, self._log_path)
        except NoNodeError:
            return False  # the job is closed
        first = head.batches[0].since
        missed = [name for name in names if name.isdigit() and held < int(name) <= first]
        if not missed or len(missed) > roster.LOG_KEPT:
            return False
        pending = [self._client.get_async(f"{self._log_path}/{name}") for name in missed]
        try:
            entries = [roster.decode(result.get(timeout=RETRY_DEADLINE)[0]) for result in pending]
        except NoNodeError:
            return False  # pruned since the listing
        batches = [batch for entry in entries for batch in entry.batches]
        return self._carried_by(roster.logged(batches, head))

    # --- a sentinel ---------------------------------------------------------------------

    def _listed(self, listed: roster.Members) -> None:
        """A sentinel's list: kept, then written into the roster for the others. (A late
        list of a watch stopped meanwhile is as true as any: kept and written too.)"""
        before = self._keep(listed)
        with suppress(NoNodeError):  # the job was closed: nobody follows the roster now
            self._client.retry(self._write_roster, before, listed)
            with suppress(KazooException):  # pruned later: the log only spares listings
                self._prune_log()

    def _write_roster(self, before: roster.Members, listed: roster.Members) -> None:
        """Add the batch from the roster's end to ``listed``, by compare-and-set. The batch
        is a difference from the members at the roster's end (``_chain``): this sentinel
        knows them if the roster carries on, over the other sentinel's batches, from the
        members at its end when this one last read it, or from the list it held before
        (``before``: its previous list, or the members it followed before it took the slot);
        otherwise the batch restarts the chain, and every follower lists. A retry after a lost
        reply finds its own batch there, and adds nothing."""
        while True:
            data, stat = self._client.get(self._roster_path)
            written = roster.decode(data)
            with self._lock:
                known = [m for m in (self._chain, before, listed) if m is not None]
                end = written.end(known)
                self._chain = end or self._chain
            advanced = written.advanced(end, listed)
            if advanced is None:
                return
            try:
                self._set_roster(advanced, stat.version)
            except BadVersionError:
                continue  # another sentinel wrote meanwhile: carried on over its batch
            with self._lock:
                self._chain = listed
            return

    def _set_roster(self, advanced: roster.Roster, version: int) -> None:
        """Write ``advanced`` over the roster's ``version``, and its newest batch into the log
        in the same transaction, so the log holds a batch only if the roster held it. A batch
        too large for both in one request (``LARGEST_LOGGED``), or one the log refuses (an
        entry of that name left by a chain written anew after an unreadable roster), leaves
        the roster written alone: the log only spares listings."""
        newest = advanced.batches[-1]
        if newest.size > roster.LARGEST_LOGGED:
            self._client.set(self._roster_path, advanced.encode(), version=version)
            return
        transaction = self._client.transaction()
        transaction.set_data(self._roster_path, advanced.encode(), version=version)
        transaction.create(
            f"{self._log_path}/{newest.upto:020d}",
            roster.Roster((newest,)).encode(),
            acl=self._acl,
        )
        set_roster, logged = transaction.commit()
        if not isinstance(set_roster, Exception) and not isinstance(logged, Exception):
            self._logged += 1
            return
        # The operation that failed says why; the other reports RolledBackError.
        if isinstance(set_roster, (BadVersionError, NoNodeError)):
            raise set_roster
        self._client.set(self._roster_path, advanced.encode(), version=version)

    def _prune_log(self) -> None:
        """Every ``LOG_KEPT`` batches it wrote, a sentinel deletes the log's entries but the
        newest ``LOG_KEPT``, in transactions of ``FORGET_BATCH``. Both sentinels may prune at
        once: a transaction that finds an entry gone is refused whole, and the next pruning
        deletes what it left."""
        if self._logged < roster.LOG_KEPT:
            return
        self._logged = 0
        names = sorted(self._client.retry(self._client.get_children, self._log_path))
        doomed = [f"{self._log_path}/{name}" for name in names[: -roster.LOG_KEPT]]
        for at in range(0, len(doomed), FORGET_BATCH):
            _deleted_all(self._client, doomed[at : at + FORGET_BATCH])

    # --- roles ----------------------------------------------------------------------------

    def _take_role(self) -> None:
        """Claim a free sentinel slot, or follow the roster. Nobody lists when a sentinel is
        lost: the other sentinel writes on, and a connection that takes a free slot carries
        the roster on from the members it followed (a state that needs a change written
        meanwhile waits ``ROSTER_PATIENCE`` at most)."""
        with self._roles:
            if self._slot is None:
                self._slot = self._claimed()
            if self._slot is not None:
                self._sentinel()
            else:
                self._follower()

    def _claimed(self) -> str | None:
        """The first free slot, now this session's; a follower watches every slot it finds
        held, and tries again when one is freed (or made, to watch it again)."""
        for slot in self._slots:
            # Trick: an exists first, a read that any server answers, so that only a slot
            # seen free costs a write; its watch fires on the slot's deletion or creation.
            held = self._client.retry(self._client.exists, slot, self._on_slot)
            if held is not None:
                if self._ours(held):  # made by an attempt whose reply was lost
                    return slot
                continue
            try:
                self._client.retry(self._client.create, slot, b"", acl=self._acl, ephemeral=True)
            except NodeExistsError:
                # Another connection took it first, unless a retry after a lost reply found
                # this session's own node.
                if not self._ours(self._client.retry(self._client.exists, slot)):
                    continue
            except NoNodeError:
                return None  # no slots: the job is closed
            logger.debug("zookeeper: this connection lists %s (%s)", self._path, slot)
            return slot
        return None

    def _ours(self, stat: Any) -> bool:
        client_id = self._client.client_id
        return stat is not None and client_id is not None and stat.ephemeralOwner == client_id[0]

    def _sentinel(self) -> None:
        if self._following is not None:
            self._following.stop()
            self._following = None
        if self._listing is None:
            self._listing = _MembersWatch(self._client, self._path, self._listed)

    def _follower(self) -> None:
        if self._listing is not None:
            self._listing.stop()
            self._listing = None
        if self._following is None:
            self._following = _CoalescedDataWatch(
                self._client, self._roster_path, self._roster_read
            )

    def _roster_read(self, data: bytes | None, heard: int) -> None:
        del heard  # the roster names the list it carries to by its pzxid
        if data is None or not (self._carry(data) or self._carry_by_log(data)):
            # No roster: the job is closed (then members/ is gone too, and the list says so),
            # or it was made before rosters were, and this connection lists as it did then.
            self._list()

    def _on_slot(self, event: WatchedEvent) -> None:
        """Runs in kazoo's callback thread, which must not block."""
        del event  # a slot freed may be taken; one taken is watched again
        _later(random.uniform(0, SLOT_SPREAD), self._retake_role)

    def _retake_role(self) -> None:
        with suppress(KazooException):
            self._take_role()

    def _on_session(self, state: str) -> None:
        """Runs in kazoo's connection thread: it must not block, so it only schedules."""
        if state == KazooState.LOST:
            self._slot = None  # the slot went with the session
            _later(0, self._retake_role)
        elif state == KazooState.CONNECTED:
            with self._lock:
                ask = self._unanswered
                self._unanswered = False
            if ask:
                self.place_state()


class _CoalescedWatch:
    """A watch whose burst of events costs one read, ``COALESCE`` after the first: when N
    agents join at once, each connection would otherwise read the growing list N times. It
    reads again once the connection is back, since an event may have gone unheard meanwhile.
    Subclasses say what is read (``_read``)."""

    def __init__(self, client: KazooClient, path: str) -> None:
        self._client = client
        self._path = path
        self._lock = threading.Lock()
        self._fetching = threading.Lock()
        """One read and callback at a time, so a newer read is never overwritten by an older."""
        self._scheduled = False
        self._established = False
        self._stopped = False
        self.heard = 0
        """Changes heard: watch events, and each time the connection was cut off (a change
        may have gone unheard then)."""
        client.add_listener(self._on_session)
        with self._fetching:
            self._fetch_once()

    def stop(self) -> None:
        """Call back no more. ZooKeeper cannot take back a watch it has set: it fires once
        more, and nobody hears it."""
        self._stopped = True
        self._client.remove_listener(self._on_session)

    def _on_event(self, event: WatchedEvent) -> None:
        with self._lock:
            self.heard += 1
        self._schedule()

    def _on_session(self, state: str) -> None:
        """Runs in kazoo's connection thread: it must not block, so it only schedules."""
        if state in (KazooState.LOST, KazooState.SUSPENDED):
            with self._lock:
                self.heard += 1
            self._established = False
        elif not self._established:
            self._schedule()

    def _schedule(self) -> None:
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        _later(COALESCE, self._refetch)

    def _refetch(self) -> None:
        with self._fetching:
            with self._lock:
                self._scheduled = False
            # Connection trouble: the session listener fetches again once it is back.
            with suppress(KazooException):
                self._fetch_once()

    def _fetch_once(self) -> None:
        if self._stopped:
            return
        with self._lock:
            asked = self.heard
        for _ in range(3):
            try:
                self._read(asked)
                break
            except NoNodeError:
                # Trick: a watch cannot be set on a missing node by a read, but an exists
                # watch can, and it fires when the node is made; made meanwhile, it is read
                # again.
                if self._client.retry(self._client.exists, self._path, self._on_event) is None:
                    self._absent(asked)
                    break
        else:
            self._absent(asked)  # made and removed again at every read: as good as absent
        self._established = True

    def _read(self, asked: int) -> None:
        raise NotImplementedError

    def _absent(self, asked: int) -> None:
        raise NotImplementedError


class _CoalescedChildrenWatch(_CoalescedWatch):
    """kazoo's ChildrenWatch, coalesced."""

    def __init__(
        self, client: KazooClient, path: str, on_children: Callable[[list[str], int], None]
    ) -> None:
        """``on_children(children, heard)``: a new list, and how many changes the watch had
        heard (``heard``) when it asked for it: the list shows each of them."""
        self._on_children = on_children
        super().__init__(client, path)

    def _read(self, asked: int) -> None:
        children = self._client.retry(self._client.get_children, self._path, watch=self._on_event)
        self._on_children(children, asked)

    def _absent(self, asked: int) -> None:
        # A round's marks go with forget_rounds, and then none is left. A topic's node is
        # made by its first note.
        self._on_children([], asked)


class _MembersWatch(_CoalescedWatch):
    """A sentinel's watch on ``members/``: each list named by the node's ``pzxid``."""

    def __init__(
        self, client: KazooClient, path: str, on_list: Callable[[roster.Members], None]
    ) -> None:
        self._on_list = on_list
        super().__init__(client, path)

    def _read(self, asked: int) -> None:
        del asked  # a list is named by its pzxid
        children, stat = self._client.retry(
            self._client.get_children, self._path, watch=self._on_event, include_data=True
        )
        self._on_list(roster.Members(frozenset(children), stat.pzxid, stat.cversion))

    def _absent(self, asked: int) -> None:
        # Only close_job removes the members node: the job is closed and nobody is left (a
        # member whose deletion fired this watch must not linger in alive()).
        del asked
        self._on_list(roster.CLOSED)


class _CoalescedDataWatch(_CoalescedWatch):
    """kazoo's DataWatch, coalesced, and read outside kazoo's threads (the reader may list)."""

    def __init__(
        self, client: KazooClient, path: str, on_data: Callable[[bytes | None, int], None]
    ) -> None:
        """``on_data(data, heard)``: the node's data (``None`` if it is missing)."""
        self._on_data = on_data
        super().__init__(client, path)

    def _read(self, asked: int) -> None:
        data, _ = self._client.retry(self._client.get, self._path, watch=self._on_event)
        self._on_data(data, asked)

    def _absent(self, asked: int) -> None:
        self._on_data(None, asked)


def _deleted_all(client: KazooClient, paths: list[str]) -> bool:
    """Whether one transaction deleted every one of ``paths`` (it deletes none otherwise)."""
    transaction = client.transaction()
    for path in paths:
        transaction.delete(path)
    return not any(isinstance(result, Exception) for result in transaction.commit())


def _later(delay: float, action: Callable[[], None]) -> None:
    """``action`` on a thread of its own after ``delay`` seconds: never in kazoo's threads."""
    timer = threading.Timer(delay, action)
    timer.daemon = True
    timer.start()


def connect(
    zk: str,
    settings: RendezvousSettings,
    node: NodeInfo,
    *,
    secret: str | None = None,
    open_acl: bool = False,
    expected_nodes: Callable[[], int | None] | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
) -> StoreRendezvous:
    """The agent's entry point: a rendezvous for ``node`` on the ensemble in ``zk``.

    Without a ``secret`` the job's znodes are open to every user of the ensemble, so that
    needs ``open_acl=True`` (the CLI's ``--zk-open-acl``), never just a forgotten flag.
    """
    require_secret(secret, settings.run_id, open_acl=open_acl)
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, secret, settings.session_timeout, connect_timeout)
    try:
        store = ZooKeeperStore(client, address, settings.run_id, secret)
    except RendezvousError:
        client.stop()
        client.close()
        raise
    return StoreRendezvous(settings, node, store, expected_nodes)


@contextmanager
def _existing_job(zk: str, run_id: str, secret: str | None) -> Iterator[ZooKeeperStore]:
    """The job opened read-only (``create=False``): ``status`` and ``cancel`` create no znode."""
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, secret, session_timeout=10.0)
    try:
        store = ZooKeeperStore(client, address, run_id, secret, create=False)
    except RendezvousError:
        client.stop()
        client.close()
        raise
    try:
        yield store
    finally:
        store.release()


def describe_job(zk: str, run_id: str, secret: str | None) -> st.JobState | None:
    """The job's state for ``hpc-elastic status``; None if no agent has arrived yet."""
    with _existing_job(zk, run_id, secret) as store:
        return tables.current(store)[0]


def close_job(zk: str, run_id: str, secret: str | None) -> None:
    """Close the job for ``hpc-elastic cancel``: running agents stop, late ones exit cleanly.

    A job no agent has reached has no node, and gets none: cancelling its Slurm array is
    enough, and creating the node here would squat the path (with the wrong ACL if the
    secret file is missing).
    """
    with _existing_job(zk, run_id, secret) as store:
        if not store.job_exists():
            logger.debug("zookeeper: job %s has no node; nothing to close", run_id)
            return
        tables.update(store, st.close)
        store.close_job()


@dataclass(frozen=True)
class Probe:
    """One health probe of the ensemble: when we asked, when it answered, and its clock."""

    sent: float
    received: float
    server_time: float | None
    """The server's wall clock (a fresh znode's ctime), None where we may not create one."""
    znode: str | None = None
    """The ephemeral znode that told the time; gone with the probe's session."""


def probe(zk: str, connect_timeout: float = CONNECT_TIMEOUT) -> Probe:
    """Connect, read the server's time, disconnect: the preflight's ZooKeeper check.

    The time comes from an ephemeral sequential znode under the prefix, whose creation time
    the server stamps; it vanishes with the session, so a probe leaves nothing behind.
    """
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, None, session_timeout=10.0, connect_timeout=connect_timeout)
    try:
        sent = time.time()
        znode, server_time = _server_time(client, address)
        received = time.time()
    except KazooException as error:
        raise RendezvousError(
            f"ZooKeeper at '{address}' failed the health probe ({type(error).__name__}); "
            "check the server's log."
        ) from error
    finally:
        client.stop()
        client.close()
    logger.debug("zookeeper: probe %s answered in %.3f s", address, received - sent)
    return Probe(sent, received, server_time, znode)


def _server_time(client: KazooClient, address: ZooKeeperAddress) -> tuple[str | None, float | None]:
    _ensure_shared(client, f"{address.chroot}{PREFIX}")
    try:
        path, stat = client.create(
            f"{address.chroot}{PREFIX}/.clock-",
            b"",
            acl=[ACL(Permissions.READ, Id("world", "anyone"))],
            ephemeral=True,
            sequence=True,
            include_data=True,
        )
    except (NoNodeError, NoAuthError):
        logger.debug("zookeeper: no clock probe under %s%s", address.chroot, PREFIX)
        return None, None
    return str(path), float(stat.ctime) / 1000.0


def _ensure_shared(client: KazooClient, path: str) -> None:
    """``path`` and its parents, each created (if missing) with the shared CREATE-only ACL, as
    a job's agent creates the prefix; a parent someone else made and guards is left alone."""
    parts = path.split("/")[1:]
    for depth in range(1, len(parts) + 1):
        with suppress(NodeExistsError, NoAuthError):
            client.retry(client.create, "/" + "/".join(parts[:depth]), b"", acl=_SHARED_ACL)


USERS = "@users"


class BadNodeBook:
    """One user's remembered bad nodes, in a znode only the user's secret opens."""

    def __init__(self, client: KazooClient, address: ZooKeeperAddress, user: str, secret: str):
        self._client = client
        self._address = address
        self._user = check_host(user)
        self._root = f"{address.chroot}{PREFIX}/{USERS}/{user}"
        self._acl = [make_digest_acl(DIGEST_USER, secret, all=True)]
        with self._converted():
            self._ensure()

    def remember(self, record: BadNode) -> None:
        """Record ``record.host`` as bad, replacing an older record of the same host."""
        path = f"{self._root}/bad-nodes/{check_host(record.host)}"
        with self._converted():
            try:
                self._client.retry(self._client.create, path, record.encode(), acl=self._acl)
            except NodeExistsError:
                self._client.retry(self._client.set, path, record.encode())
        logger.debug("zookeeper: user %s remembers bad node %s", self._user, record.host)

    def records(self) -> list[BadNode]:
        """Every readable record, expired or not."""
        found: list[BadNode] = []
        with self._converted():
            for host in self._client.retry(self._client.get_children, f"{self._root}/bad-nodes"):
                try:
                    data, _ = self._client.retry(self._client.get, f"{self._root}/bad-nodes/{host}")
                except NoNodeError:
                    continue  # Cleared by another agent between the listing and the read.
                record = BadNode.decode(data)
                if record is not None:
                    found.append(record)
        return found

    def forget(self, hosts: Iterable[str]) -> None:
        with self._converted():
            for host in hosts:
                with suppress(NoNodeError):
                    self._client.retry(
                        self._client.delete, f"{self._root}/bad-nodes/{check_host(host)}"
                    )
                logger.debug("zookeeper: user %s forgets bad node %s", self._user, host)

    def _ensure(self) -> None:
        """The shared parents (CREATE-only for everyone), then the user's node with the
        user's ACL, checked like a job node, since anyone could have made it first."""
        _ensure_shared(self._client, self._root.rsplit("/", 1)[0])
        with suppress(NodeExistsError):
            self._client.retry(self._client.create, self._root, b"", acl=self._acl)
        try:
            acls, _ = self._client.retry(self._client.get_acls, self._root)
        except NoAuthError:
            acls = []
        if _acl_set(acls) != _acl_set(self._acl):
            raise RendezvousAccessError(
                f"ZooKeeper node '{self._root}' is not guarded by user '{self._user}'s secret: "
                "either your user secret file (--user-secret-file) was replaced since your "
                "agents made the node, so restore it, or another user made it, so ask the "
                "ensemble's admin to delete it."
            )
        with suppress(NodeExistsError):
            self._client.retry(self._client.create, f"{self._root}/bad-nodes", b"", acl=self._acl)

    @contextmanager
    def _converted(self) -> Iterator[None]:
        """As a job's, but a refusal names the user's secret, not a job's --zk-auth-file."""
        try:
            with _converted(self._address, f"{USERS}/{self._user}"):
                yield
        except RendezvousError as error:
            if not isinstance(error.__cause__, NoAuthError):
                raise
            raise RendezvousAccessError(
                f"ZooKeeper at '{self._address}' refused user '{self._user}'s bad-node list "
                "to the secret in your user secret file (--user-secret-file); restore the "
                "file your agents used, or ask the ensemble's admin to delete "
                f"'{self._root}' to start a new list."
            ) from error.__cause__


@contextmanager
def bad_node_book(
    zk: str, user: str, secret: str, connect_timeout: float = CONNECT_TIMEOUT
) -> Iterator[BadNodeBook]:
    """The user's bad-node book, connected for the duration of the ``with`` block."""
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, secret, session_timeout=10.0, connect_timeout=connect_timeout)
    try:
        yield BadNodeBook(client, address, user, secret)
    finally:
        client.stop()
        client.close()


def remember_bad_node(zk: str, user: str, secret: str, record: BadNode) -> None:
    """Remember one bad node for the user's later jobs."""
    with bad_node_book(zk, user, secret) as book:
        book.remember(record)


ACL_CHECK = ".acl-check-"
"""Ephemeral znodes under the prefix that ``acls_enforced`` makes: gone with its session."""


def acls_enforced(zk: str, connect_timeout: float = CONNECT_TIMEOUT) -> bool | None:
    """Whether the ensemble enforces the digest ACLs every job's nodes rely on (``doctor``):
    a node readable only with a fresh secret is made, then read by a client without it. True
    when that client is refused; False when it may read (the server runs with ``skipACL``, or
    gives everyone a superuser's rights); None when no such node may be made under the prefix
    (the site's ACL on it), so that nothing could be told. The node is ephemeral: it goes with
    the session, which is closed at once, so the check leaves nothing behind."""
    import secrets  # noqa: PLC0415 (only doctor asks)

    address = ZooKeeperAddress.parse(zk)
    secret = secrets.token_urlsafe(16)
    owner = open_client(address, secret, session_timeout=10.0, connect_timeout=connect_timeout)
    stranger: KazooClient | None = None
    try:
        _ensure_shared(owner, f"{address.chroot}{PREFIX}")
        try:
            path = owner.create(
                f"{address.chroot}{PREFIX}/{ACL_CHECK}",
                b"",
                acl=[make_digest_acl(DIGEST_USER, secret, all=True)],
                ephemeral=True,
                sequence=True,
            )
        except (NoNodeError, NoAuthError):
            logger.debug("zookeeper: no ACL check possible under %s%s", address.chroot, PREFIX)
            return None
        stranger = open_client(address, None, session_timeout=10.0, connect_timeout=connect_timeout)
        try:
            stranger.get(path)
        except NoAuthError:
            return True
        return False
    except KazooException as error:
        raise RendezvousError(
            f"ZooKeeper at '{address}' failed the ACL check ({type(error).__name__}); check the "
            "server's log."
        ) from error
    finally:
        for client in (stranger, owner):
            if client is not None:
                client.stop()
                client.close()
