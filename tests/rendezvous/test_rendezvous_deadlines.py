"""The rendezvous handler's clocks (``rendezvous/deadlines.py``), on a hand-moved clock.

The handler's tests drive these through whole rounds; these pin the answers each wait gives
at its edges: a deadline still ahead, then None from the very instant it is reached.
"""

from __future__ import annotations

from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import RendezvousSettings
from hpc_elastic.rendezvous.deadlines import Deadlines
from hpc_elastic.spec import NodeRange

SETTINGS = RendezvousSettings(
    "job", NodeRange(2, 4), min_wait=60.0, last_call=5.0, exit_barrier_timeout=300.0
)


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_min_wait_runs_from_the_round_start_and_is_over_at_its_deadline() -> None:
    clock = Clock()
    deadlines = Deadlines(SETTINGS, clock)
    deadlines.begin_round()
    assert deadlines.below_min(159.0) == 160.0
    assert deadlines.below_min(160.0) is None


def test_a_round_below_min_drops_the_last_call_so_the_next_one_starts_afresh() -> None:
    deadlines = Deadlines(SETTINGS, Clock())
    deadlines.begin_round()
    assert deadlines.last_call(100.0) == 105.0
    assert deadlines.last_call(104.0) == 105.0  # still the first one's
    deadlines.below_min(104.0)
    assert deadlines.last_call(110.0) == 115.0
    assert deadlines.last_call(115.0) is None


def test_a_proposal_keeps_its_first_turn_until_it_is_dropped() -> None:
    deadlines = Deadlines(SETTINGS, Clock())
    assert deadlines.proposal(100.0, 0.5) == 100.5
    assert deadlines.proposal(100.25, 0.5) == 100.5  # its first turn, not 100.75
    assert deadlines.proposal(100.5, 0.5) is None
    deadlines.drop_proposal()
    assert deadlines.proposal(101.0, 0.5) == 101.5


def test_the_straggler_clock_starts_when_stragglers_are_first_seen_and_restarts_per_round() -> None:
    timeout = st.straggler_timeout(SETTINGS)
    deadlines = Deadlines(SETTINGS, Clock())
    assert deadlines.straggler_wait() is None
    assert not deadlines.judge_stragglers(1, seen=True, now=100.0)
    assert deadlines.straggler_wait() == 100.0 + timeout
    assert deadlines.judge_stragglers(1, seen=True, now=100.0 + timeout)
    assert deadlines.stragglers_overdue
    assert not deadlines.judge_stragglers(1, seen=False, now=100.0 + timeout)
    assert not deadlines.stragglers_overdue
    assert not deadlines.judge_stragglers(2, seen=True, now=100.0 + timeout)
    assert deadlines.straggler_wait() == 100.0 + 2 * timeout


def test_the_finishing_and_port_waits_belong_to_one_round_each() -> None:
    deadlines = Deadlines(SETTINGS, Clock())
    assert deadlines.finishing(3, 100.0) == 400.0
    assert deadlines.finishing(3, 400.0) is None
    assert deadlines.finishing(4, 400.0) == 700.0
    timeout = st.straggler_timeout(SETTINGS)
    assert deadlines.port_wait(3, 100.0) == 100.0 + timeout
    assert deadlines.port_wait(3, 100.0 + timeout) is None
    assert deadlines.port_wait(4, 100.0 + timeout) == 100.0 + 2 * timeout


def test_the_exit_barrier_times_out_its_timeout_after_it_began() -> None:
    clock = Clock()
    deadlines = Deadlines(SETTINGS, clock)
    clock.now = 250.0
    deadlines.begin_barrier()
    clock.now = 260.0
    assert deadlines.barrier_ends() == 550.0


def test_a_member_gone_from_the_exit_barrier_is_waited_for_a_session_timeout_once() -> None:
    """From the first sight of a member gone unfinished; a member seen again stops the clock,
    and one gone later, or in the barrier of another round, waits afresh."""
    session = SETTINGS.session_timeout
    deadlines = Deadlines(SETTINGS, Clock())
    deadlines.begin_barrier()
    assert deadlines.member_gone(1, 100.0) == 100.0 + session
    assert deadlines.member_gone(1, 101.0) == 100.0 + session
    assert deadlines.member_gone(1, 100.0 + session) is None
    deadlines.nobody_gone()
    assert deadlines.member_gone(1, 200.0) == 200.0 + session
    assert deadlines.member_gone(2, 201.0) == 201.0 + session
    deadlines.begin_barrier()
    assert deadlines.member_gone(2, 300.0) == 300.0 + session


def test_an_outage_counts_from_its_first_report_and_adds_its_time_once_it_ends() -> None:
    clock = Clock()
    deadlines = Deadlines(SETTINGS, clock)
    deadlines.connection_up()  # up while up: nothing to count
    assert deadlines.suspended_since() is None
    assert deadlines.give_up_at() is None
    deadlines.connection_down()
    clock.now = 130.0
    deadlines.connection_down()  # suspended, then lost: the same outage
    assert deadlines.suspended_since() == 100.0
    assert deadlines.give_up_at() == 100.0 + SETTINGS.give_up_after
    assert deadlines.time_cut_off() == 0.0
    deadlines.connection_up()
    assert deadlines.suspended_since() is None
    assert deadlines.time_cut_off() == 30.0


def test_a_store_is_out_of_reach_from_the_instant_its_outage_reaches_the_bound() -> None:
    clock = Clock()
    deadlines = Deadlines(SETTINGS, clock)
    assert not deadlines.out_of_reach()
    deadlines.connection_down()
    clock.now = 100.0 + SETTINGS.give_up_after - 0.5
    assert not deadlines.out_of_reach()
    clock.now = 100.0 + SETTINGS.give_up_after
    assert deadlines.out_of_reach()
