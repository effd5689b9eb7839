"""The clocks of one node's rendezvous: when each of ``StoreRendezvous``'s waits began and
when it ends.

The handler's steps say *what* they wait for (the min wait, the last call, a proposal's turn,
stragglers, a finishing round, rank 0's port, the exit barrier, a lost connection); this
module says *until when*. How long each wait lasts comes from the settings and from
``state``'s rules (``straggler_timeout``, ``stragglers_overdue``); nothing here reads the
store or decides an action.

Each wait of a round answers alike: the time it ends while that is still ahead, or None once
it has passed. Passed means ``now >=`` the deadline itself, so that a loop woken exactly at
the deadline it computed always finds it passed, whatever the float rounding (a simulated
agent would otherwise wait for the very same instant again, for ever).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import RendezvousSettings


def out_of_reach(suspended_since: float | None, now: float, limit: float) -> bool:
    """Whether a connection down since ``suspended_since`` (None: up) has been down for
    ``limit`` seconds at ``now``: every wait on the store then gives up."""
    # Compared with the deadline itself (not ``now - suspended_since``), as the handler's
    # wait computes it: waking up exactly at that deadline must find it passed.
    return suspended_since is not None and now >= suspended_since + limit


Since = tuple[int, float]
"""(round, since when) a wait that belongs to one round began; a new round restarts it."""


def _since(wait: Since | None, round_: int, now: float) -> Since:
    """The wait for ``round_``: the one under way, or one that begins ``now``."""
    return wait if wait is not None and wait[0] == round_ else (round_, now)


class Deadlines:
    """Every deadline and timer of one node's rendezvous, behind methods named for the
    decisions they serve.

    Thread safety: ``_lock`` guards every field, and every method holds it for its whole
    body. Three threads meet here: the loop's (``next_round`` and the exit barrier, or the
    simulator's only thread) moves the round clocks; the store's connection thread moves the
    outage clock (``connection_down``, ``connection_up``) while the loop, the agent and its
    investigation thread read it (``suspended_since``, ``time_cut_off``, ``out_of_reach``);
    and the store's watch thread reads the last straggler decision (``stragglers_overdue``)
    to judge whether a change would wake the loop. The lock makes each method one step that no
    other thread sees half done (an outage ended, but its time not yet counted). It is held
    only inside these methods, which call nothing but the clock and ``state``'s pure rules,
    so no other lock is ever taken while it is held and it cannot deadlock with the
    handler's ``_wake``.
    """

    def __init__(self, settings: RendezvousSettings, clock: Callable[[], float]) -> None:
        self._settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._min_wait_ends = 0.0
        self._last_call_ends: float | None = None
        self._propose_at: float | None = None
        self._straggling: Since | None = None
        """The round whose stragglers this node waits for, and since when."""
        self._overdue = False
        """The last judgement of ``judge_stragglers``: leave that round's stragglers out."""
        self._finishing: Since | None = None
        """The finishing round this node waits for, and since when."""
        self._port_wait: Since | None = None
        """The round whose rank 0 this node waits for to publish its port, and since when."""
        self._ending: Since | None = None
        """The round this node is back from, nobody having ended it yet, and since when."""
        self._barrier_since = 0.0
        self._gone: Since | None = None
        """The round in whose exit barrier this node sees a member gone unfinished, and
        since when."""
        self._suspended_at: float | None = None
        self._cut_off = 0.0
        """Seconds the connection was down, summed over the outages that have ended."""

    # --- a round's waits (``next_round``) ------------------------------------------------

    def begin_round(self) -> None:
        """Restart the clocks for a new ``next_round``: the min wait runs from now, and no
        last call, proposal, straggler, finishing or port wait is under way."""
        with self._lock:
            self._min_wait_ends = self._clock() + self._settings.min_wait
            self._last_call_ends = self._propose_at = None
            self._straggling = None
            self._finishing = None
            self._port_wait = None
            self._ending = None

    def below_min(self, now: float) -> float | None:
        """The round has fewer than MIN nodes: drop a last call or a proposal under way, and
        say when the min wait ends (None: it is over, and the job fails below MIN)."""
        with self._lock:
            self._last_call_ends = self._propose_at = None
            return None if now >= self._min_wait_ends else self._min_wait_ends

    def last_call(self, now: float) -> float | None:
        """When the last call ends (None: it has), begun at this round's first LAST_CALL."""
        with self._lock:
            self._last_call_ends = self._last_call_ends or now + self._settings.last_call
            return None if now >= self._last_call_ends else self._last_call_ends

    def proposal(self, now: float, stagger: float) -> float | None:
        """When this node proposes the round (None: now), fixed ``stagger`` seconds after it
        first found the round ready to complete (``StoreRendezvous._stagger``)."""
        with self._lock:
            self._propose_at = self._propose_at or now + stagger
            return None if now >= self._propose_at else self._propose_at

    def ending(self, round_: int, now: float, wait: float) -> float | None:
        """When this node ends ``round_`` in the state itself (None: now), ``wait`` seconds
        after it first found itself back from it with nobody having ended it
        (``StoreRendezvous._ending_turn``)."""
        with self._lock:
            self._ending = _since(self._ending, round_, now)
            ends = self._ending[1] + wait
            return None if now >= ends else ends

    def drop_proposal(self) -> None:
        """The round is no longer ready to complete: a later one staggers afresh."""
        with self._lock:
            self._propose_at = None

    def judge_stragglers(self, round_: int, seen: bool, now: float) -> bool:
        """Whether this node leaves out the stragglers it sees (``seen``) of ``round_``: they
        are overdue (``state.stragglers_overdue``) on a clock that starts when it first sees
        stragglers of that round. The answer is kept for ``stragglers_overdue``."""
        with self._lock:
            if seen:
                self._straggling = _since(self._straggling, round_, now)
                self._overdue = st.stragglers_overdue(self._straggling[1], now, self._settings)
            else:
                self._overdue = False
            return self._overdue

    @property
    def stragglers_overdue(self) -> bool:
        """The last ``judge_stragglers``; the watch thread reads it, and never judges."""
        with self._lock:
            return self._overdue

    def straggler_wait(self) -> float | None:
        """When the wait for stragglers ends (None: none began since ``begin_round``)."""
        with self._lock:
            if self._straggling is None:
                return None
            return self._straggling[1] + st.straggler_timeout(self._settings)

    def finishing(self, round_: int, now: float) -> float | None:
        """When this node stops waiting for finishing ``round_`` to close (None: now, and the
        job fails naming a member that never finished): the exit barrier's timeout after it
        first saw that round finishing."""
        with self._lock:
            self._finishing = _since(self._finishing, round_, now)
            deadline = self._finishing[1] + self._settings.exit_barrier_timeout
            return None if now >= deadline else deadline

    def port_wait(self, round_: int, now: float) -> float | None:
        """When this node stops waiting for rank 0 of ``round_`` to publish its port (None:
        now, and the round ends without it): ``straggler_timeout`` after it first waited."""
        with self._lock:
            self._port_wait = _since(self._port_wait, round_, now)
            since = self._port_wait[1]
            if st.stragglers_overdue(since, now, self._settings):
                return None
            return since + st.straggler_timeout(self._settings)

    # --- the exit barrier ---------------------------------------------------------------

    def begin_barrier(self) -> None:
        """This node's success is recorded: the exit barrier's timeout runs from now."""
        with self._lock:
            self._barrier_since = self._clock()
            self._gone = None

    def member_gone(self, round_: int, now: float) -> float | None:
        """When this node fails the job for a member of ``round_`` gone from the exit barrier
        before its success was recorded (None: now): a session timeout after it first saw one
        gone. A live agent whose session expired as its workers finished (a node frozen for a
        moment, or one starved on a loaded machine) comes back with a new session and records
        its success within that time; a node that died is no more than that late to fail."""
        with self._lock:
            self._gone = _since(self._gone, round_, now)
            ends = self._gone[1] + self._settings.session_timeout
            return None if now >= ends else ends

    def nobody_gone(self) -> None:
        """No member is gone unfinished any more: one gone later waits afresh."""
        with self._lock:
            self._gone = None

    def barrier_ends(self) -> float:
        """When the exit barrier times out (``state.barrier_action`` compares, not this)."""
        with self._lock:
            return self._barrier_since + self._settings.exit_barrier_timeout

    # --- the connection (the store's connection thread moves it) -------------------------

    def connection_down(self) -> None:
        """The connection is suspended or lost: the outage began now, unless it is under way."""
        with self._lock:
            if self._suspended_at is None:
                self._suspended_at = self._clock()

    def connection_up(self) -> None:
        """The connection is back: the outage under way (if any) ends, and its time counts."""
        with self._lock:
            if self._suspended_at is not None:
                self._cut_off += self._clock() - self._suspended_at
            self._suspended_at = None

    def suspended_since(self) -> float | None:
        """When the connection went down (None: it is up)."""
        with self._lock:
            return self._suspended_at

    def time_cut_off(self) -> float:
        """Seconds the connection was down, over the outages that have ended."""
        with self._lock:
            return self._cut_off

    def give_up_at(self) -> float | None:
        """When a wait on the store gives up, cut off as it is (None: it is not)."""
        with self._lock:
            if self._suspended_at is None:
                return None
            return self._suspended_at + self._settings.give_up_after

    def out_of_reach(self) -> bool:
        """Whether the store has been out of reach for ``give_up_after`` seconds now."""
        with self._lock:
            now = self._clock()
            return out_of_reach(self._suspended_at, now, self._settings.give_up_after)
