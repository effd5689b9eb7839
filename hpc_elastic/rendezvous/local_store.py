"""The embedded Store for local mode: a tiny server on a unix socket, no ZooKeeper needed.

``hpc-elastic run`` serves one job from a thread of its own process; every agent connects as
a client. The wire is newline-delimited JSON, bytes travel as base64, nothing is pickled::

    request   {"id": 7, "op": "cas", "data": "<b64>", "token": 3}
    reply     {"id": 7, "ok": true, "data": "<b64>", "token": 4, "won": true}
    push      {"push": true, "data": "<b64>|null", "token": 4, "alive": ["n1-..", ...],
               "notes": ["hang-3-1.1@n1-..", ...]}

It keeps ZooKeeper's semantics where the rendezvous relies on them: the state has an integer
version for compare-and-set (``ABSENT`` before it exists), a membership belongs to the
connection that made it and vanishes the moment that connection closes (a SIGKILLed agent is
gone at once), and every change is pushed to every connection, so nobody polls.
"""

from __future__ import annotations

import base64
import itertools
import json
import queue
import socket
import threading
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_elastic.errors import RendezvousClosedError, RendezvousError
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous import tables
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
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
from hpc_elastic.rendezvous.handler import StoreRendezvous

SCHEME = "local:"
"""``--zk local:/path/to/socket`` picks this store instead of ZooKeeper."""
REQUEST_TIMEOUT = 30.0


def is_local(address: str) -> bool:
    return address.startswith(SCHEME)


def socket_path(address: str) -> Path:
    path = address.removeprefix(SCHEME)
    if not path:
        raise RendezvousError(
            f"--zk '{address}' names no socket; give 'local:/path/to/socket', as "
            "`hpc-elastic run` does."
        )
    return Path(path)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


# --- the server ----------------------------------------------------------------------------


@dataclass
class _Member:
    order: int
    data: bytes
    connection: _Connection


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    following: tuple[Mark, int] | None = None
    """The round whose marks this connection follows (``Store.follow_marks``)."""

    def send(self, message: dict[str, Any]) -> None:
        line = (json.dumps(message) + "\n").encode()
        with self.lock, suppress(OSError):
            self.sock.sendall(line)


class LocalStoreServer:
    """One job's rendezvous state, served to the agents of a local run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._state: bytes | None = None
        self._version = ABSENT
        self._members: dict[str, _Member] = {}
        self._notes: dict[str, bytes] = {}
        self._marks: dict[tuple[Mark, int], dict[str, _Connection]] = {}
        """Each round's marks of each kind: node id -> the connection that wrote it."""
        self._tables: dict[tuple[int, str], bytes] = {}
        """Each round's tables by digest."""
        self._order = itertools.count()
        self._views = itertools.count(1)
        self._closed = False
        self._connections: set[_Connection] = set()
        self._broadcasting = threading.Lock()
        """Held from snapshot to send, so every connection sees the views in order."""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._thread = threading.Thread(target=self._accept, name="local-store", daemon=True)

    def start(self) -> None:
        with suppress(FileNotFoundError):
            self.path.unlink()
        self._listener.bind(str(self.path))
        self._listener.listen(64)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving; connected agents see their session end."""
        with suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)
        with suppress(FileNotFoundError):
            self.path.unlink()

    def snapshot(self) -> bytes | None:
        with self._lock:
            return self._state

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            connection = _Connection(sock)
            with self._lock:
                self._connections.add(connection)
            threading.Thread(
                target=self._serve, args=(connection,), name="local-store-conn", daemon=True
            ).start()

    def _serve(self, connection: _Connection) -> None:
        try:
            with connection.sock.makefile("rb") as lines:
                for line in lines:
                    request = json.loads(line)
                    reply, changed = self._handle(request, connection)
                    connection.send({"id": request["id"], **reply})
                    if changed:
                        self._broadcast()
                    if reply.get("marked_anew"):
                        self._tell_followers(Mark(request["kind"]), request["round"])
        except (OSError, ValueError, KeyError):
            pass
        finally:
            self._disconnect(connection)

    def _disconnect(self, connection: _Connection) -> None:
        """The connection's memberships vanish with it, like ZooKeeper ephemerals."""
        with self._lock:
            self._connections.discard(connection)
            gone = [node for node, m in self._members.items() if m.connection is connection]
            for node in gone:
                del self._members[node]
            unmarked = []
            for (kind, round_number), marked in self._marks.items():
                mine = [node for node, owner in marked.items() if owner is connection]
                if kind.ephemeral and mine:
                    for node in mine:
                        del marked[node]
                    unmarked.append((kind, round_number))
        connection.sock.close()
        if gone:
            self._broadcast()
        for kind, round_number in unmarked:
            self._tell_followers(kind, round_number)

    def _handle(
        self, request: dict[str, Any], connection: _Connection
    ) -> tuple[dict[str, Any], bool]:
        """Apply one request under the lock; return the reply and whether anything changed."""
        op = request["op"]
        with self._lock:
            if op == "watch":
                return {"ok": True, **self._view()}, False
            if op == "cas":
                return self._compare_and_set(_unb64(request["data"]) or b"", request["token"])
            if op == "join":
                if self._closed:
                    return {"ok": False, "closed": True}, False
                node = request["node"]
                member = self._members.get(node)
                if member is not None and member.connection is connection:
                    return {"ok": True}, False
                data = _unb64(request["data"]) or b""
                self._members[node] = _Member(next(self._order), data, connection)
                return {"ok": True}, True
            if op == "leave":
                return {"ok": True}, self._members.pop(request["node"], None) is not None
            if op == "members":
                found = [self._members[n] for n in request["nodes"] if n in self._members]
                found.sort(key=lambda member: member.order)
                return {"ok": True, "records": [_b64(m.data) for m in found]}, False
            if op in ("put_note", "claim_note", "notes", "forget_notes"):
                return self._note_request(op, request)
            if op in ("mark", "marks", "follow_marks", "put_table", "table", "forget_rounds"):
                return self._round_request(op, request, connection), False
            if op == "is_closed":
                return {"ok": True, "closed": self._closed}, False
            if op == "close_job":
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
                return {"ok": True}, changed
        return {"ok": False, "error": f"unknown operation '{op}'"}, False

    def _note_request(self, op: str, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """``Store.put_note``, ``claim_note``, ``notes`` and ``forget_notes``; the reply, and
        whether the keys changed (every connection is then told)."""
        if op in ("put_note", "claim_note"):
            return self._put_note(request["key"], _unb64(request["data"]) or b"", op)
        on_topic = [key for key in self._notes if note_topic(key) == request["topic"]]
        if op == "notes":
            return {"ok": True, "notes": {key: _b64(self._notes[key]) for key in on_topic}}, False
        for key in on_topic:
            del self._notes[key]
        return {"ok": True}, bool(on_topic)

    def _put_note(self, key: str, data: bytes, op: str) -> tuple[dict[str, Any], bool]:
        """A new key is pushed to everyone (``Store.put_note``); a claim keeps the first."""
        if self._closed:
            return {"ok": False, "closed": True}, False
        new = key not in self._notes
        if new or op == "put_note":
            self._notes[key] = data
        return {"ok": True, "data": _b64(self._notes[key])}, new

    def _round_request(
        self, op: str, request: dict[str, Any], connection: _Connection
    ) -> dict[str, Any]:
        """``Store.mark``, ``marks``, ``follow_marks``, ``put_table``, ``table`` and
        ``forget_rounds``: records of a round beside the state, pushed only to followers."""
        round_number = request.get("round", 0)
        if op == "forget_rounds":
            for key in [key for key in self._marks if key[1] < request["before"]]:
                del self._marks[key]
            for done in [key for key in self._tables if key[0] < request["before"]]:
                del self._tables[done]
            return {"ok": True}
        if op == "table":
            return {"ok": True, "data": _b64(self._tables.get((round_number, request["digest"])))}
        kind = Mark(request.get("kind", Mark.BACK.value))
        marked = self._marks.get((kind, round_number), {})
        if op == "marks":
            return {"ok": True, "nodes": sorted(marked)}
        if op == "follow_marks":
            connection.following = (kind, round_number)
            return {"ok": True}
        if self._closed:
            return {"ok": False, "closed": True}
        if op == "put_table":
            table = _unb64(request["data"]) or b""
            self._tables[round_number, table_digest(table)] = table
            return {"ok": True, "digest": table_digest(table)}
        # No state, no fence: its version is ABSENT then, and ABSENT fences nothing.
        fenced = request["token"] != ABSENT and request["token"] == self._version
        marked = self._marks.setdefault((kind, round_number), marked)
        new = request["node"] not in marked
        written = place_mark(marked, kind, request["node"], connection, fenced=fenced)
        return {"ok": True, "marked": written, "marked_anew": written and new}

    def _compare_and_set(self, data: bytes, token: int) -> tuple[dict[str, Any], bool]:
        # A closed job is never reopened, as on ZooKeeper: an agent that checked is_closed
        # just before the close must not create a fresh state.
        won = not self._closed and (
            (token == ABSENT and self._state is None)
            or (self._state is not None and token == self._version)
        )
        if won:
            self._state = data
            self._version = 0 if token == ABSENT else self._version + 1
        return {"ok": True, "data": _b64(self._state), "token": self._version, "won": won}, won

    def _view(self) -> dict[str, Any]:
        """The whole picture, numbered: a reply may overtake a push, the number tells."""
        return {
            "data": _b64(self._state),
            "token": self._version,
            "alive": sorted(self._members),
            "notes": sorted(self._notes),
            "seq": next(self._views),
        }

    def _tell_followers(self, kind: Mark, round_number: int) -> None:
        """A push of the current view to the connections that follow these marks: their
        subscribers are called, as for any other change."""
        with self._broadcasting:
            with self._lock:
                message = {"push": True, **self._view()}
                followers = [c for c in self._connections if c.following == (kind, round_number)]
            for connection in followers:
                connection.send(message)

    def _broadcast(self) -> None:
        with self._broadcasting:
            with self._lock:
                message = {"push": True, **self._view()}
                connections = list(self._connections)
            for connection in connections:
                connection.send(message)


# --- the client ----------------------------------------------------------------------------


class LocalStore(CachedStore):
    """An agent's connection to the embedded store; state and membership cached from pushes."""

    def __init__(self, path: Path, run_id: str) -> None:
        super().__init__()
        self._path = path
        self._run_id = run_id
        self._ids = itertools.count(1)
        self._pending: dict[int, queue.SimpleQueue[dict[str, Any] | None]] = {}
        self._alive_seq = 0
        self._notices: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._connected = True
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(str(path))
        except OSError as error:
            self._sock.close()
            raise RendezvousError(
                f"The local rendezvous at '{path}' does not answer ({error.strerror}); "
                "start the job with `hpc-elastic run`, which serves it."
            ) from error
        threading.Thread(target=self._read, name="local-store-reader", daemon=True).start()
        threading.Thread(target=self._deliver, name="local-store-notify", daemon=True).start()
        self._look()

    def _look(self) -> None:
        """Ask for the whole view (the state, the members, every note's key) and keep it."""
        reply = self._call("watch")
        view = (reply["seq"], reply["alive"], reply["notes"])
        self._remember(_unb64(reply["data"]), reply["token"], view)

    @property
    def where(self) -> str:
        return f"the local rendezvous at '{self._path}'"

    def set_state(self, data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        reply = self._call("cas", data=_b64(data), token=token)
        current = _unb64(reply["data"])
        self._remember(current, reply["token"], None)
        return current, reply["token"], reply["won"]

    def join(self, node_id: str, data: bytes) -> None:
        if not self._call("join", node=node_id, data=_b64(data))["ok"]:
            raise RendezvousClosedError(
                f"Job '{self._run_id}' is closed (finished or cancelled); nothing to join."
            )

    def leave(self, node_id: str) -> None:
        self._call("leave", node=node_id)

    def members(self, node_ids: Iterable[str]) -> list[bytes]:
        records = self._call("members", nodes=list(node_ids))["records"]
        return [base64.b64decode(record) for record in records]

    def put_note(self, key: str, data: bytes) -> None:
        self._note("put_note", key, data)

    def claim_note(self, key: str, data: bytes) -> bytes:
        return self._note("claim_note", key, data)

    def _note(self, op: str, key: str, data: bytes) -> bytes:
        reply = self._call(op, key=check_note_key(key), data=_b64(data))
        if not reply["ok"]:
            raise RendezvousClosedError(
                f"Job '{self._run_id}' is closed (finished or cancelled); no note can be written."
            )
        return _unb64(reply["data"]) or b""

    def follow_notes(self, topic: str) -> None:
        """Every push carries every key; the first look at a topic asks for the view, so that
        it is as new as the server's (a push may still be on its way)."""
        super().follow_notes(topic)
        self._look()

    def forget_notes(self, topic: str) -> None:
        self._call("forget_notes", topic=topic)

    def notes(self, topic: str) -> dict[str, bytes]:
        found = self._call("notes", topic=topic)["notes"]
        return {key: base64.b64decode(data) for key, data in found.items()}

    def mark(self, kind: Mark, round_number: int, node_id: str, token: int) -> bool:
        node = check_node_id(node_id)
        reply = self._call("mark", kind=kind.value, round=round_number, node=node, token=token)
        if not reply["ok"]:
            raise RendezvousClosedError(
                f"Job '{self._run_id}' is closed (finished or cancelled); no mark can be written."
            )
        return bool(reply["marked"])

    def marks(self, kind: Mark, round_number: int) -> frozenset[str]:
        return frozenset(self._call("marks", kind=kind.value, round=round_number)["nodes"])

    def follow_marks(self, kind: Mark, round_number: int) -> None:
        self._call("follow_marks", kind=kind.value, round=round_number)

    def put_table(self, round_number: int, table: bytes) -> str:
        reply = self._call("put_table", round=round_number, data=_b64(table))
        if not reply["ok"]:
            raise RendezvousClosedError(
                f"Job '{self._run_id}' is closed (finished or cancelled); no table can be written."
            )
        return str(reply["digest"])

    def table(self, round_number: int, digest: str) -> bytes | None:
        return _unb64(self._call("table", round=round_number, digest=digest)["data"])

    def forget_rounds(self, before_round: int) -> None:
        self._call("forget_rounds", before=before_round)

    def is_closed(self) -> bool:
        return bool(self._call("is_closed")["closed"])

    def close_job(self) -> None:
        self._call("close_job")

    def release(self) -> None:
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        request_id = next(self._ids)
        answer: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        with self._lock:
            if not self._connected:
                raise self._gone()
            self._pending[request_id] = answer
        try:
            self._sock.sendall((json.dumps({"id": request_id, "op": op, **fields}) + "\n").encode())
            reply = answer.get(timeout=REQUEST_TIMEOUT)
        except (OSError, queue.Empty) as error:
            raise self._gone() from error
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
        if reply is None:
            raise self._gone()
        return reply

    def _gone(self) -> RendezvousError:
        return RendezvousError(
            f"The local rendezvous at '{self._path}' went away; the `hpc-elastic run` that "
            "served it has stopped."
        )

    def _read(self) -> None:
        """Route replies to their callers and apply pushes; on EOF, fail every caller."""
        try:
            with self._sock.makefile("rb") as lines:
                for line in lines:
                    message = json.loads(line)
                    if message.get("push"):
                        view = (message["seq"], message["alive"], message["notes"])
                        self._remember(_unb64(message["data"]), message["token"], view)
                        self._notices.put(True)
                        continue
                    with self._lock:
                        waiter = self._pending.get(message["id"])
                    if waiter is not None:
                        waiter.put(message)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        with self._lock:
            self._connected = False
            waiters = list(self._pending.values())
        for waiter in waiters:
            waiter.put(None)
        self._notices.put(False)

    def _deliver(self) -> None:
        """Run callbacks on their own thread, so a callback may call the store without
        waiting for the reader thread that it would block."""
        while True:
            connected = self._notices.get()
            for callback in self._callbacks(session_lost=not connected):
                callback()
            if not connected:
                # The server went away with our memberships: the session is LOST for good
                # (there is no reconnecting to a local run's socket).
                for on_connection in self._connection_callbacks():
                    on_connection(ConnectionState.LOST)
                return

    def _remember(
        self, data: bytes | None, token: int, view: tuple[int, list[str], list[str]] | None
    ) -> None:
        """Keep the newest state, membership and note keys seen, pushed or in a reply."""
        self._remember_state(data, token)
        with self._lock:
            if view is not None and view[0] > self._alive_seq:
                self._alive_seq, alive, notes = view
                self._alive = frozenset(alive)
                self._remember_notes(frozenset(notes))


def connect(
    address: str,
    settings: RendezvousSettings,
    node: NodeInfo,
    *,
    secret: str | None = None,
    expected_nodes: Callable[[], int | None] | None = None,
) -> StoreRendezvous:
    """The agent's entry point for ``--zk local:/path``; the secret is unused (a private socket)."""
    del secret
    store = LocalStore(socket_path(address), settings.run_id)
    return StoreRendezvous(settings, node, store, expected_nodes)


def describe_job(address: str, run_id: str) -> st.JobState | None:
    """The live state of a local run for ``hpc-elastic status``; None before the first round."""
    store = LocalStore(socket_path(address), run_id)
    try:
        return tables.current(store)[0]
    finally:
        store.release()
