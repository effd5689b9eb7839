"""The small interface a rendezvous needs from where its state lives (ZooKeeper, or a fake).

Modelled on torch's ``RendezvousBackend``: one opaque state blob written by compare-and-set,
plus what torch lacks: ephemeral membership and change notifications pushed by the store,
so nobody polls. A store serves one job and may be shared by several node handlers (the
benchmark multiplexes hundreds of simulated nodes over a few connections).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

ABSENT = -1
"""The token of a state that does not exist yet: ``set_state`` with it creates the state."""


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

    @abstractmethod
    def is_closed(self) -> bool:
        """Whether the job was closed (its tombstone exists)."""

    @abstractmethod
    def close_job(self) -> None:
        """Leave a tombstone, then remove the state and every membership; idempotent."""

    @abstractmethod
    def release(self) -> None:
        """Close the connection; memberships made through it vanish."""
