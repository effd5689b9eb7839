"""The rendezvous state machine, on top of any Store.

An agent in ``next_round`` loops: read the state and the membership, ask ``state.next_action``
what to do, do it (one compare-and-set at most) and, when there is nothing to do, sleep until
the store reports a change or the last-call / min-wait deadline passes. No polling: the
store's watches wake the loop, and they also set ``changed`` while workers run.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from functools import partial

from hpc_elastic.errors import RendezvousClosedError
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import (
    Failure,
    JobFailedError,
    NodeInfo,
    Rendezvous,
    RendezvousSettings,
    Round,
)
from hpc_elastic.rendezvous.backend import ABSENT, Store

PROPOSER_STAGGER = 0.1
"""Seconds between the turns of successive node ids to complete a round."""
MAX_STAGGER = 5.0


def free_port() -> int:
    """A port that is free now; the master binds it moments later (the usual small race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port: int = probe.getsockname()[1]
        return port


class StoreRendezvous(Rendezvous):
    """One node's rendezvous over a Store; ``expected_nodes`` says how many nodes could
    arrive soon (e.g. the Slurm allocation), so a round need not wait for the last call."""

    def __init__(
        self,
        settings: RendezvousSettings,
        node: NodeInfo,
        store: Store,
        expected_nodes: Callable[[], int | None] | None = None,
        owns_store: bool = True,
    ) -> None:
        super().__init__(settings, node)
        self._store = store
        self._expected_nodes = expected_nodes
        self._owns_store = owns_store
        self._round = 0
        self._in_round = False
        """From returning a round until the next ``next_round``: only then is ``changed`` set."""
        self._generation = 0
        self._waiting_on: st.Action | None = None
        self._wake = threading.Condition()
        self._rejoin = threading.Event()
        store.subscribe(self._on_change, self._on_session_lost)

    def next_round(self) -> Round:
        self._in_round = False
        self.changed.clear()
        self._join()
        min_deadline = time.monotonic() + self.settings.min_wait
        last_call_deadline: float | None = None
        propose_at: float | None = None
        while True:
            generation = self._generation
            if self._rejoin.is_set():
                self._join()
            data, token = self._store.get_state()
            if data is None:
                self._create_state()
                continue
            state = self._usable(st.decode(data))
            alive = self._store.alive()
            action = self._action(state, alive)
            now = time.monotonic()
            if action is st.Action.RETURN:
                self._round = state.round
                self._in_round = True
                self._on_change()
                return state.to_round()
            if action is st.Action.PUBLISH_PORT:
                self._store.set_state(
                    st.encode(st.publish_master(state, state.round, free_port())), token
                )
                continue
            if action is st.Action.MARK_READY:
                self._store.set_state(st.encode(st.mark_ready(state, self.node.node_id)), token)
                continue
            if action is st.Action.BELOW_MIN:
                last_call_deadline = propose_at = None
                if now >= min_deadline:
                    self._fail_below_min(state, token, len(alive))
                    continue
                self._sleep(generation, min_deadline, action)
                continue
            if action is st.Action.LAST_CALL:
                last_call_deadline = last_call_deadline or now + self.settings.last_call
                if now < last_call_deadline:
                    self._sleep(generation, last_call_deadline, action)
                    continue
            if action in (st.Action.COMPLETE, st.Action.LAST_CALL):
                propose_at = propose_at or now + self._stagger(alive)
                if now >= propose_at:
                    self._complete(state, token, alive)
                    continue
                self._sleep(generation, propose_at, action)
                continue
            propose_at = None
            self._sleep(generation, None, action)

    def report_failure(self, failure: Failure) -> None:
        self._update(lambda state: st.record_failure(state, self._round, failure))

    def report_success(self) -> None:
        state = self._update(lambda state: st.record_success(state, self._round, self.node.node_id))
        if st.all_succeeded(state):
            self.close()
            return
        while True:
            generation = self._generation
            data, _ = self._store.get_state()
            if data is None:
                return
            state = st.decode(data)
            if state.closed or st.all_succeeded(state):
                return
            if state.failed:
                raise JobFailedError(
                    f"Job '{self.settings.run_id}' failed: {state.failure_summary}"
                )
            missing = state.member_ids - self._store.alive() - set(state.succeeded)
            if missing:
                summary = (
                    f"node '{sorted(missing)[0]}' left round {state.round} before its workers "
                    "finished"
                )
                self._update(partial(st.fail, summary=summary))
                continue
            self._sleep(generation, None)

    def close(self) -> None:
        if self._store.get_state()[0] is not None:
            self._update(st.close)
        self._store.close_job()

    def leave(self) -> None:
        self._store.unsubscribe(self._on_change)
        self._store.leave(self.node.node_id)
        if self._owns_store:
            self._store.release()

    def snapshot(self) -> st.JobState | None:
        """The job's state for ``hpc-elastic status``; None before the first agent arrives."""
        data, _ = self._store.get_state()
        return st.decode(data) if data is not None else None

    def _join(self) -> None:
        self._rejoin.clear()
        self._store.join(self.node.node_id, st.encode_node(self.node))

    def _create_state(self) -> None:
        if self._store.is_closed():
            raise RendezvousClosedError(
                f"Job '{self.settings.run_id}' is closed (finished or cancelled); nothing to join."
            )
        initial = st.JobState(max_restarts=self.settings.max_restarts)
        self._store.set_state(st.encode(initial), ABSENT)

    def _usable(self, state: st.JobState) -> st.JobState:
        if state.closed:
            raise RendezvousClosedError(
                f"Job '{self.settings.run_id}' is closed (finished or cancelled); nothing to join."
            )
        if state.failed:
            raise JobFailedError(f"Job '{self.settings.run_id}' failed: {state.failure_summary}")
        return state

    def _complete(self, state: st.JobState, token: int, alive: frozenset[str]) -> None:
        present = st.candidates(state, alive)
        candidates = [st.decode_node(record) for record in self._store.members(present)]
        if self._store.get_state()[1] != token:
            return  # Someone else changed the state meanwhile: decide again, do not encode.
        self._store.set_state(
            st.encode(st.complete_round(state, candidates, self.settings.nodes)), token
        )

    def _stagger(self, alive: frozenset[str]) -> float:
        """Seconds to let lower node ids complete the round first: with hundreds of nodes,
        one proposal instead of a stampede of compare-and-sets that all but one lose."""
        position = sum(1 for other in alive if other < self.node.node_id)
        return min(position * PROPOSER_STAGGER, MAX_STAGGER)

    def _fail_below_min(self, state: st.JobState, token: int, present: int) -> None:
        summary = (
            f"only {present} of the {self.settings.nodes.min} nodes needed joined within "
            f"{self.settings.min_wait:g} s; check that the job got its nodes or lower --nodes"
        )
        self._store.set_state(st.encode(st.fail(state, summary)), token)

    def _update(self, step: Callable[[st.JobState], st.JobState]) -> st.JobState:
        """Apply ``step`` by compare-and-set until it sticks or changes nothing."""
        data, token = self._store.get_state()
        while data is not None:
            state = st.decode(data)
            new = step(state)
            if new == state:
                return state
            data, token, won = self._store.set_state(st.encode(new), token)
            if won:
                return new
        raise RendezvousClosedError(
            f"Job '{self.settings.run_id}' is closed (finished or cancelled); nothing to update."
        )

    def _action(self, state: st.JobState, alive: frozenset[str]) -> st.Action:
        expected = self._expected_nodes() if self._expected_nodes else None
        return st.next_action(
            state, alive, self.node.node_id, self._round, self.settings.nodes, expected=expected
        )

    def _sleep(
        self, generation: int, deadline: float | None, action: st.Action | None = None
    ) -> None:
        """Sleep until a change (one that alters ``action``, if given) or the deadline."""
        with self._wake:
            if self._generation != generation:
                return
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._waiting_on = action
            self._wake.wait(timeout)
            self._waiting_on = None

    def _on_change(self) -> None:
        """Called from the store's watch thread: flag a superseded round, wake the loop."""
        if self._in_round and not self.changed.is_set() and self._superseded():
            self.changed.set()
        if self._nothing_new():
            return
        with self._wake:
            self._generation += 1
            self._wake.notify_all()

    def _nothing_new(self) -> bool:
        """Whether the sleeping loop would decide what it already waits on. Deciding here,
        in the watch thread, spares hundreds of handlers sharing a store from waking up
        for every join (the 1024-agent benchmark)."""
        waiting_on = self._waiting_on
        data, _ = self._store.get_state()
        if waiting_on is None or data is None:
            return False
        state = st.decode(data)
        if state.closed or state.failed:
            return False
        return self._action(state, self._store.alive()) is waiting_on

    def _on_session_lost(self) -> None:
        self._rejoin.set()
        self.changed.set()
        self._on_change()

    def _superseded(self) -> bool:
        data, _ = self._store.get_state()
        if data is None:
            return True
        state = st.decode(data)
        return (
            state.round != self._round
            or state.closed
            or state.failed
            or not st.round_is_live(state, self._store.alive(), self.settings.nodes)
        )
