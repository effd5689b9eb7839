"""The ZooKeeper Store: the only module that imports kazoo.

Layout of one job, under an optional chroot::

    /hpc-elastic/<run_id>            digest ACL: only holders of the job's secret
        state                        JSON JobState; its znode version is the CAS token
        members/<node_id>            ephemeral, one per live agent; data = NodeInfo JSON
        closed                       tombstone left by close_job; everything else is removed

Every step runs under ``client.retry`` and is idempotent, so a retry after a lost
connection cannot do it twice. A SUSPENDED connection is ignored (the session may come
back, with its ephemerals and watches); a LOST session means our memberships are gone,
so subscribers are told and agents rejoin as new members.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import WatchedEvent
from kazoo.recipe.watchers import DataWatch
from kazoo.retry import RetryFailedError
from kazoo.security import ACL, OPEN_ACL_UNSAFE, Id, Permissions, make_digest_acl

from hpc_elastic.errors import RendezvousClosedError, RendezvousError
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.backend import ABSENT, CachedStore
from hpc_elastic.rendezvous.handler import StoreRendezvous

PREFIX = "/hpc-elastic"
DIGEST_USER = "hpc-elastic"
CONNECT_TIMEOUT = 10.0
"""Seconds to wait for the ensemble at start before giving up with a clear error."""
RETRY_DEADLINE = 60.0
"""Seconds one operation keeps retrying through connection losses (e.g. a server restart)."""
COALESCE = 0.02
"""Seconds a membership change waits for others before the member list is fetched again."""

_SHARED_ACL = [
    ACL(Permissions.READ | Permissions.CREATE | Permissions.DELETE, Id("world", "anyone"))
]
"""For the common prefix: anyone may add a job. DELETE only ever removes an empty job node,
because a job's children (and so the job) can only be removed with its secret."""


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


def open_client(
    address: ZooKeeperAddress,
    secret: str | None,
    session_timeout: float,
    connect_timeout: float = CONNECT_TIMEOUT,
) -> KazooClient:
    """A started client, or a clear error once ``connect_timeout`` has passed."""
    client = KazooClient(
        hosts=address.hosts,
        timeout=session_timeout,
        auth_data=[("digest", f"{DIGEST_USER}:{secret}")] if secret else None,
        connection_retry={"max_tries": -1, "delay": 0.1, "max_delay": 1.0},
        command_retry={
            "max_tries": -1,
            "delay": 0.05,
            "max_delay": 1.0,
            "deadline": RETRY_DEADLINE,
        },
    )
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
    """One job's rendezvous on ZooKeeper; the state and membership are cached by watches."""

    def __init__(
        self, client: KazooClient, address: ZooKeeperAddress, run_id: str, secret: str | None
    ) -> None:
        super().__init__()
        self._client = client
        self._address = address
        self._run_id = run_id
        self._root = address.job_path(run_id)
        self._acl = [make_digest_acl(DIGEST_USER, secret, all=True)] if secret else OPEN_ACL_UNSAFE
        self._records: dict[str, tuple[int, bytes]] = {}
        """Member records by node id, with their creation order (czxid)."""
        self._fetching = threading.Lock()
        """One fetch of member records at a time, so handlers sharing this store share it."""
        with self._converted():
            self._ensure_paths()
            client.add_listener(self._on_connection_state)
            DataWatch(client, self._path("state"), self._on_state)
            _CoalescedChildrenWatch(client, self._path("members"), self._on_members)

    def set_state(self, data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        with self._converted():
            current, version, won = self._client.retry(self._compare_and_set, data, token)
        self._remember_state(current, version)
        return current, version, won

    def join(self, node_id: str, data: bytes) -> None:
        with self._converted():
            self._client.retry(self._join, node_id, data)

    def leave(self, node_id: str) -> None:
        with self._converted():
            self._client.retry(self._delete, self._path("members", node_id))

    def members(self, node_ids: Iterable[str]) -> list[bytes]:
        """Fetched once per member (a member's record never changes), all in flight at once."""
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
                with self._lock:
                    self._records[node_id] = (stat.czxid, data)
        with self._lock:
            records = [self._records[node_id] for node_id in wanted if node_id in self._records]
        return [data for _, data in sorted(records)]

    def is_closed(self) -> bool:
        with self._converted():
            return self._client.retry(self._client.exists, self._path("closed")) is not None

    def close_job(self) -> None:
        with self._converted():
            self._client.retry(self._create, self._path("closed"), b"", False)
            self._client.retry(self._delete, self._path("state"))
            self._client.retry(self._delete, self._path("members"), True)

    def release(self) -> None:
        self._client.remove_listener(self._on_connection_state)
        self._client.stop()
        self._client.close()

    def _path(self, *parts: str) -> str:
        return "/".join((self._root, *parts))

    def _converted(self) -> Any:
        return _converted(self._address, self._run_id)

    def _ensure_paths(self) -> None:
        parents = [part for part in self._root.split("/")[1:-1]]
        for depth in range(1, len(parents) + 1):
            path = "/" + "/".join(parents[:depth])
            self._client.retry(self._create, path, b"", False, _SHARED_ACL)
        self._client.retry(self._create, self._root, b"", False)
        if self._client.retry(self._client.exists, self._path("closed")) is None:
            self._client.retry(self._create, self._path("members"), b"", False)

    def _create(
        self, path: str, data: bytes, ephemeral: bool, acl: list[ACL] | None = None
    ) -> None:
        with suppress(NodeExistsError):
            self._client.create(path, data, acl=acl or self._acl, ephemeral=ephemeral)

    def _delete(self, path: str, recursive: bool = False) -> None:
        with suppress(NoNodeError):
            self._client.delete(path, recursive=recursive)

    def _compare_and_set(self, data: bytes, token: int) -> tuple[bytes | None, int, bool]:
        try:
            if token == ABSENT:
                self._client.create(self._path("state"), data, acl=self._acl)
                return data, 0, True
            stat = self._client.set(self._path("state"), data, version=token)
            return data, stat.version, True
        except (NodeExistsError, BadVersionError, NoNodeError):
            try:
                current, stat = self._client.get(self._path("state"))
            except NoNodeError:
                return None, ABSENT, False
            # A retry after a lost reply finds our own write: that is a win.
            return current, stat.version, current == data

    def _join(self, node_id: str, data: bytes) -> None:
        if self._client.exists(self._path("closed")) is not None:
            raise RendezvousClosedError(
                f"Job '{self._run_id}' is closed (finished or cancelled); nothing to join."
            )
        path = self._path("members", node_id)
        try:
            self._client.create(path, data, acl=self._acl, ephemeral=True)
        except NodeExistsError:
            stat = self._client.exists(path)
            if stat is not None and stat.ephemeralOwner != self._client.client_id[0]:
                self._delete(path)
                self._client.create(path, data, acl=self._acl, ephemeral=True)

    def _on_state(self, data: bytes | None, stat: Any) -> None:
        self._remember_state(data, stat.version if stat is not None else ABSENT)
        self._notify()

    def _on_members(self, children: list[str]) -> None:
        with self._lock:
            self._alive = frozenset(children)
            for gone in self._records.keys() - self._alive:
                del self._records[gone]
        self._notify()

    def _on_connection_state(self, state: str) -> None:
        if state == KazooState.LOST:
            for callback in self._callbacks(session_lost=True):
                callback()

    def _notify(self) -> None:
        for callback in self._callbacks():
            callback()


class _CoalescedChildrenWatch:
    """kazoo's ChildrenWatch, except that a burst of changes costs one fetch of the list: when
    N agents join at once, each connection would otherwise fetch the growing list N times."""

    def __init__(
        self, client: KazooClient, path: str, on_children: Callable[[list[str]], None]
    ) -> None:
        self._client = client
        self._path = path
        self._on_children = on_children
        self._lock = threading.Lock()
        self._fetching = threading.Lock()
        """One fetch and callback at a time, so a newer list is never overwritten by an older."""
        self._scheduled = False
        self._established = False
        client.add_listener(self._on_session)
        with self._fetching, suppress(NoNodeError):
            self._fetch_once()

    def _on_event(self, event: WatchedEvent) -> None:
        self._schedule()

    def _on_session(self, state: str) -> None:
        """Runs in kazoo's connection thread: it must not block, so it only schedules."""
        if state in (KazooState.LOST, KazooState.SUSPENDED):
            self._established = False
        elif not self._established:
            self._schedule()

    def _schedule(self) -> None:
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        timer = threading.Timer(COALESCE, self._refetch)
        timer.daemon = True
        timer.start()

    def _refetch(self) -> None:
        with self._fetching:
            with self._lock:
                self._scheduled = False
            # NoNodeError: the job was closed, nothing left to watch. Any other error is
            # connection trouble: the session listener fetches again once it is back.
            with suppress(KazooException):
                self._fetch_once()

    def _fetch_once(self) -> None:
        children = self._client.retry(self._client.get_children, self._path, watch=self._on_event)
        self._established = True
        self._on_children(children)


def connect(
    zk: str,
    settings: RendezvousSettings,
    node: NodeInfo,
    *,
    secret: str | None = None,
    expected_nodes: Callable[[], int | None] | None = None,
    connect_timeout: float = CONNECT_TIMEOUT,
) -> StoreRendezvous:
    """The agent's entry point: a rendezvous for ``node`` on the ensemble in ``zk``."""
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
def _job_store(zk: str, run_id: str, secret: str | None) -> Iterator[ZooKeeperStore]:
    address = ZooKeeperAddress.parse(zk)
    client = open_client(address, secret, session_timeout=10.0)
    try:
        yield ZooKeeperStore(client, address, run_id, secret)
    finally:
        client.stop()
        client.close()


def describe_job(zk: str, run_id: str, secret: str | None) -> st.JobState | None:
    """The job's state for ``hpc-elastic status``; None if no agent has arrived yet."""
    with _job_store(zk, run_id, secret) as store:
        data, _ = store.get_state()
        return st.decode(data) if data is not None else None


def close_job(zk: str, run_id: str, secret: str | None) -> None:
    """Close the job for ``hpc-elastic cancel``: running agents stop, late ones exit cleanly."""
    with _job_store(zk, run_id, secret) as store:
        data, token = store.get_state()
        while data is not None:
            data, token, won = store.set_state(st.encode(st.close(st.decode(data))), token)
            if won:
                break
        store.close_job()
