"""Links between the agents of a round: a peer's process that exits closes its link at once.

ZooKeeper notices a dead agent when its session expires (the session timeout after its last
word), although the kernel of a node whose processes die (SIGKILL, the OOM killer, a segfault,
Slurm killing the step) closes their connections at once. So each agent listens on a port of
its own (``NodeInfo.link_port``), and at the start of a round every member opens one TCP
connection to the round's group rank 0, the centre: a star, N-1 links at the centre, one on
every other node. The centre's death is seen by every other member, another member's by the
centre. After a handshake that names the job, the round and both node ids, nothing is ever
sent on a link, so that nothing lies unread in either receive buffer.

**Only an orderly end is evidence** (``is_evidence``): ``recv`` returning no bytes, the peer's
kernel sent FIN, which a process that exits (killed or not) makes its kernel send for every
socket it held with nothing unread. A reset, a refused or timed-out connection and silence
are not: a firewall or a middlebox can produce each of them for a live node, and a frozen or
partitioned node produces silence. Those wait for the session, as before.

**A live agent never ends a link of the latest round.** It closes the links of round N only
once it holds a later round (``hold``: the store's round has moved past N, so an end of them
proves nothing, and ``state.depart`` ignores it), and the rest when it exits, after its workers
are gone (``Agent.run``). Its workers die with it (``PR_SET_PDEATHSIG``): on Linux a dying
process's files are closed (``exit_files``) microseconds before its children get the death
signal (``exit_notify``), while the survivors' reaction takes a compare-and-set on ZooKeeper
and the start of new processes.

Every link is one socket and one entry in one selector, watched by one thread; what to do
with an end (``on_departed``: ``Rendezvous.report_departed``) runs on a thread of its own,
since it waits on the store. Wrong or late handshakes are dropped without a word to anyone:
they are never evidence.

**A centre of thousands needs as many files.** Each link is an open file at the centre, and
many clusters let a process open 1,024 (``ulimit -n``). The centre of a round raises its own
limit as far as the hard limit lets it (``_afford``); past that, ``accept`` fails, the
connection it could not take stays queued and keeps the listener readable, and a watch that
selected it again would spin a core. So the listener rests (``waiting_for_files``) and is
tried again once a link ends or ``ACCEPT_RETRY`` later; the members it cannot take are
noticed by their sessions alone, as without links, and the agent says so once a round.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hpc_elastic.contract import FILES_SPARE
from hpc_elastic.rendezvous.api import Round
from hpc_elastic.rendezvous.handler import port_range
from hpc_elastic.spec import MASTER_PORTS_ENV

log = logging.getLogger(__name__)

HANDSHAKE_WAIT = 30.0
"""Seconds a link's handshake may take (connect, hello, answer): milliseconds on a LAN; the
margin is for a loaded node, whose links thread may wait seconds for a core (a waiting
handshake costs nothing: until a link is up, the session decides, as without links). A link
that is not up by then is given up."""

HELLO_LIMIT = 1024
"""Bytes of a hello line at most: a connection that sends more is no agent of ours."""

ACCEPT_RETRY = 1.0
"""Seconds the listener rests after the process ran out of files, unless a link ends first."""


class LinkEnd(enum.Enum):
    """How a link ended, as its socket tells it."""

    CLOSED = "closed"
    """``recv`` returned no bytes: the peer's kernel sent FIN (its process closed the socket,
    or exited)."""
    RESET = "reset"
    """An error: a reset (``ECONNRESET``, which a middlebox can forge), a timeout, an
    unreachable host."""
    DATA = "data"
    """Bytes arrived after the handshake: not our protocol, so not our agent."""


def is_evidence(end: LinkEnd) -> bool:
    """Whether a link's end says its peer's process exited: only an orderly close does. The
    simulation runs this very rule (hpc_elastic/simulation), where a middlebox resets a live
    node's links."""
    return end is LinkEnd.CLOSED


@dataclass(frozen=True)
class Peer:
    """The other end of a link: a member's node id and the round the link belongs to."""

    node_id: str
    round: int


OnDeparted = Callable[[Peer], None]


@dataclass
class _Link:
    sock: socket.socket
    peer: Peer | None = None
    """None until the handshake is done (the centre learns the peer from the hello)."""
    buffer: bytes = b""
    deadline: float = field(default_factory=lambda: time.monotonic() + HANDSHAKE_WAIT)


def listen_port(environ: Mapping[str, str]) -> socket.socket:
    """A listening socket on every address, on a port of ``HPC_ELASTIC_MASTER_PORTS`` when it
    is set (``submit --master-port-range``: the ports a site opens between its nodes), else
    any. Raises OSError when none is free."""
    low, high = port_range(environ.get(MASTER_PORTS_ENV))
    error: OSError | None = None
    for port in range(low, high + 1) if high else [0]:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("", port))
            listener.listen(socket.SOMAXCONN)  # a centre of hundreds of members
        except OSError as failed:
            listener.close()
            error = failed
            continue
        return listener
    raise error or OSError(f"no free port in {MASTER_PORTS_ENV} '{low}:{high}'")


class Links:
    """This agent's links: the listener, the links it accepted as a round's centre, and the one
    it opened to its round's centre; ``on_departed`` hears of each orderly end of a link of
    the round it holds (or a later one), on a thread of its own."""

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self.port: int = listener.getsockname()[1]
        self._me = ""
        self._run_id = ""
        self._on_departed: OnDeparted | None = None
        self._round = 0
        """The latest round this agent holds (returned by ``next_round``)."""
        self._links: dict[socket.socket, _Link] = {}
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._resting_until: float | None = None
        """While the process may open no more files: when the listener is tried again."""

    @classmethod
    def open(cls, environ: Mapping[str, str]) -> Links | None:
        """This agent's links, listening; None (said at debug level) when no port is free:
        its death is then noticed by its session alone."""
        try:
            return cls(listen_port(environ))
        except OSError as error:
            log.debug("no port for the links (%s): this node's death waits for its session", error)
            return None

    def start(self, me: str, run_id: str, on_departed: OnDeparted) -> None:
        """Accept and watch links from now on, as node ``me`` of job ``run_id``."""
        self._me, self._run_id, self._on_departed = me, run_id, on_departed
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._watch, name="hpc-elastic-links", daemon=True)
        self._thread.start()

    def hold(self, held: Round) -> None:
        """This agent returned round ``held``: close the links of older rounds (the store's
        round has moved past them, so their ends prove nothing) and, unless this node is the
        round's centre, open a link to it (on a thread: the round's start waits for nothing)."""
        with self._lock:
            self._round = max(self._round, held.number)
            old = [link for link in self._links.values() if _older(link, self._round)]
        for link in old:
            self._drop(link, "its round is over")
        centre = held.members[0]
        if centre.node_id == self._me:
            self._make_room(held)
        if centre.node_id == self._me or not centre.link_port or self._closed:
            return
        peer = Peer(centre.node_id, held.number)
        threading.Thread(
            target=self._connect,
            args=(centre.host, centre.link_port, peer),
            name="hpc-elastic-link",
            daemon=True,
        ).start()

    @property
    def waiting_for_files(self) -> bool:
        """Whether the listener rests because the process may open no more files."""
        with self._lock:
            return self._resting_until is not None

    def _make_room(self, held: Round) -> None:
        """As this round's centre, open files enough for a link from every other member, or
        say once that some of them will be noticed by their sessions alone."""
        wanted = len(held.members) - 1
        limit = _afford(wanted)
        if limit is None:
            return
        log.warning(
            "node %s is the centre of round %d, whose %d other members each open a link to it, "
            "but it may open only %d files; the death of a member it cannot link with is "
            "noticed when its session expires; raise the limit ('ulimit -n %d' in the job's "
            "script, or ask the cluster's admin for a higher hard limit).",
            self._me,
            held.number,
            wanted,
            limit,
            wanted + FILES_SPARE + _open_files(),
        )

    def peers(self) -> frozenset[Peer]:
        """The other ends of the links that are up (their handshake done)."""
        with self._lock:
            return frozenset(link.peer for link in self._links.values() if link.peer is not None)

    def close(self) -> None:
        """Close every link and the listener: only at the agent's end, its workers gone."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(2.0)
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            with contextlib.suppress(OSError):
                link.sock.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()

    # --- the member's side ------------------------------------------------------------------

    def _connect(self, host: str, port: int, peer: Peer) -> None:
        """Open a link to the centre: hello, its answer, then hand it to the watch."""
        hello = {"run": self._run_id, "round": peer.round, "from": self._me, "to": peer.node_id}
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_WAIT)
        except OSError as error:
            log.debug("no link to %s for round %d: %s", peer.node_id, peer.round, error)
            return
        try:
            sock.sendall(json.dumps(hello).encode() + b"\n")
            answer = _read_line(sock, time.monotonic() + HANDSHAKE_WAIT)
            if answer is None or _decoded(answer).get("ok") != peer.round:
                raise OSError(f"the centre answered {answer!r}")
            sock.setblocking(False)
        except OSError as error:
            log.debug("link to %s for round %d refused: %s", peer.node_id, peer.round, error)
            sock.close()
            return
        self._adopt(_Link(sock, peer))

    # --- the watch ----------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed:
            self._end_rest(time.monotonic())
            for key, _ in self._selector.select(timeout=ACCEPT_RETRY):
                sock = key.fileobj
                if sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                elif sock is self._listener:
                    self._accept()
                else:
                    assert isinstance(sock, socket.socket)
                    self._readable(sock)
            self._expire_handshakes()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError as error:
            if error.errno in (errno.EMFILE, errno.ENFILE):
                self._rest(error.strerror or str(error))
            return
        sock.setblocking(False)
        self._adopt(_Link(sock))

    def _rest(self, why: str) -> None:
        """Out of files: stop selecting the listener, which the connection it could not take
        keeps readable (a watch selecting it would spin), until ``ACCEPT_RETRY`` later."""
        with self._lock:
            if self._resting_until is not None:
                return
            self._resting_until = time.monotonic() + ACCEPT_RETRY
            self._selector.unregister(self._listener)
        log.debug("links: the listener rests (%s) with %d links", why, len(self._links))

    def _end_rest(self, now: float, link_ended: bool = False) -> None:
        """Select the listener again, once its rest is over or a link ended (a file is free)."""
        with self._lock:
            if self._resting_until is None or (now < self._resting_until and not link_ended):
                return
            self._resting_until = None
            if not self._closed:
                self._selector.register(self._listener, selectors.EVENT_READ)

    def _adopt(self, link: _Link) -> None:
        with self._lock:
            if self._closed or (link.peer is not None and _older(link, self._round)):
                link.sock.close()
                return
            self._links[link.sock] = link
            self._selector.register(link.sock, selectors.EVENT_READ)
        if link.peer is not None:
            log.debug("link to %s for round %d up", link.peer.node_id, link.peer.round)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _readable(self, sock: socket.socket) -> None:
        link = self._links.get(sock)
        if link is None:
            return
        try:
            data = sock.recv(HELLO_LIMIT)
        except BlockingIOError:
            return
        except OSError as error:
            self._ended(link, LinkEnd.RESET, str(error))
            return
        if not data:
            self._ended(link, LinkEnd.CLOSED, "closed by its peer")
        elif link.peer is not None:
            self._ended(link, LinkEnd.DATA, f"{len(data)} bytes after the handshake")
        else:
            self._hello(link, data)

    def _hello(self, link: _Link, data: bytes) -> None:
        """The centre's side of a handshake: a hello of this job, for this node, of a round
        not older than the one it holds, is answered; anything else is dropped."""
        link.buffer += data
        line, newline, rest = link.buffer.partition(b"\n")
        if not newline:
            if len(link.buffer) > HELLO_LIMIT:
                self._drop(link, "a hello too long")
            return
        hello = _decoded(line)
        number, sender = hello.get("round"), hello.get("from")
        with self._lock:
            held = self._round
        if (
            rest
            or hello.get("run") != self._run_id
            or hello.get("to") != self._me
            or not isinstance(sender, str)
            or not sender
            or type(number) is not int
            or number < held
        ):
            self._drop(link, f"a hello that is not for this node's round: {line[:200]!r}")
            return
        try:
            link.sock.sendall(json.dumps({"ok": number}).encode() + b"\n")
        except OSError as error:
            self._drop(link, f"the answer failed: {error}")
            return
        link.peer, link.buffer = Peer(sender, number), b""
        log.debug("link from %s for round %d up", sender, number)

    def _ended(self, link: _Link, end: LinkEnd, why: str) -> None:
        self._drop(link, why)
        peer = link.peer
        if peer is None or not is_evidence(end):
            return
        with self._lock:
            current = not _older(link, self._round) and not self._closed
        if not current or self._on_departed is None:
            return
        log.debug("link to %s of round %d %s: its process exited", peer.node_id, peer.round, why)
        threading.Thread(
            target=_report, args=(self._on_departed, peer), name="hpc-elastic-departed", daemon=True
        ).start()

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [link for link in self._links.values() if link.peer is None]
        for link in late:
            if now > link.deadline:
                self._drop(link, "no hello in time")

    def _drop(self, link: _Link, why: str) -> None:
        with self._lock:
            if self._links.pop(link.sock, None) is None:
                return
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(link.sock)
        with contextlib.suppress(OSError):
            link.sock.close()
        self._end_rest(time.monotonic(), link_ended=True)
        who = link.peer.node_id if link.peer is not None else "a peer"
        log.debug("link with %s dropped: %s", who, why)


def _report(on_departed: OnDeparted, peer: Peer) -> None:
    """``on_departed`` on its own thread: a failure there is the session's to make up for, and
    is no reason for a traceback on the agent's stderr."""
    try:
        on_departed(peer)
    except Exception:  # logged: the session still notices the peer
        log.debug("reporting %s departed failed", peer.node_id, exc_info=True)


def _afford(links: int) -> int | None:
    """Raise this process's limit of open files, within its hard limit, to hold ``links``
    more files than it holds now (and ``FILES_SPARE``); None when it does, else the limit it
    is left with. The limit is the process's: the workers this agent starts next inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _open_files() + links + FILES_SPARE
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return None
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    except (ValueError, OSError):
        raised = soft
    return None if raised >= wanted else raised


def _open_files() -> int:
    """Files this process holds open (Linux: its ``/proc/self/fd``)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _older(link: _Link, held: int) -> bool:
    return link.peer is not None and link.peer.round < held


def _read_line(sock: socket.socket, deadline: float) -> bytes | None:
    """One line from a blocking socket by ``deadline``; None if the peer closed first."""
    buffer = b""
    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0 or len(buffer) > HELLO_LIMIT:
            raise OSError("no answer in time")
        sock.settimeout(left)
        chunk = sock.recv(HELLO_LIMIT)
        if not chunk:
            return None
        buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    if rest:
        raise OSError("more than one line")
    return line


def _decoded(line: bytes) -> dict[str, object]:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
