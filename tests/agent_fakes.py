"""The real rendezvous over the in-memory store, so agent tests run in one process.

Agent tests used to run against a ``FakeRendezvous`` whose rules differed from the real ones;
now every agent gets a real ``StoreRendezvous`` on its own connection to one ``MemoryServer``
(the ZooKeeper stand-in). ``MemoryJob`` also remembers the last state the server held (its
document: the members are in a table beside it), so a test can read the restart count and
root cause after the job closed and removed its state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import Failure, NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.memory import MemoryServer, MemoryStore


class MemoryJob:
    """One job's rendezvous server; ``rendezvous`` connects one more agent to it."""

    def __init__(self, settings: RendezvousSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._last: st.JobState | None = None
        self.server = MemoryServer(deliver=self._deliver)

    def rendezvous(self, node: NodeInfo) -> StoreRendezvous:
        store = self.server.connect(self.settings.run_id, self.settings.session_timeout)
        return StoreRendezvous(self.settings, node, store)

    @property
    def last_state(self) -> st.JobState:
        with self._lock:
            assert self._last is not None, "no agent ever wrote a state"
            return self._last

    @property
    def restarts_used(self) -> int:
        return self.last_state.restarts_used

    @property
    def root_cause(self) -> Failure | None:
        return self.last_state.last_failure

    def _deliver(self, store: MemoryStore, notification: Callable[[], None]) -> None:
        """Deliver at once, and keep the newest state seen before ``close`` removes it."""
        data, _ = self.server.state
        if data is not None:
            with self._lock:
                self._last = st.decode(data).state
        notification()
