"""The agent's pure rules for one poll of its workers: how a round ended, the lease, the fence.

The simulation runs these very functions (``rules.poll_decision``), but the cases here are
the ones a world of its own rarely makes: a worker that saved for a preemption while another
still runs, a boundary that only a clock landing exactly on it shows.
"""

from __future__ import annotations

import pytest

from hpc_elastic.agent.rules import (
    Outcome,
    PollDecision,
    connection_fenced,
    echo_deadline,
    fence_after,
    overslept,
    poll_decision,
    round_outcome,
)
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import RendezvousSettings
from hpc_elastic.spec import NodeRange
from hpc_elastic.train.exitcodes import FENCED_EXIT_CODE

PREEMPTED = 75


def outcome(*codes: int | None, **flags: bool) -> tuple[Outcome, int | None] | None:
    facts = {"stop_requested": False, "changed": False, "fenced": False, **flags}
    return round_outcome(list(codes), **facts)


@pytest.mark.parametrize(
    ("codes", "ended"),
    [
        ((None, None), None),
        ((0, None), None),  # a node is done only once every one of its workers exited 0
        ((None, 0, 0), None),
        ((0, 0, 0), (Outcome.SUCCEEDED, None)),
        ((0, 1, None), (Outcome.FAILED, 1)),
        ((None, -9), (Outcome.FAILED, 1)),
        ((PREEMPTED, None), None),  # the others still save: wait for them
        ((PREEMPTED, PREEMPTED), (Outcome.PREEMPTED, None)),
        ((0, PREEMPTED), (Outcome.PREEMPTED, None)),
        ((PREEMPTED, 1), (Outcome.FAILED, 1)),
        ((None, FENCED_EXIT_CODE), (Outcome.FENCED, None)),
        ((1, FENCED_EXIT_CODE), (Outcome.FENCED, None)),  # its lease went stale: no failure
    ],
)
def test_how_a_round_ended_for_a_node_of_several_workers(
    codes: tuple[int | None, ...], ended: tuple[Outcome, int | None] | None
) -> None:
    assert outcome(*codes) == ended


def test_a_stop_signal_then_a_change_then_a_fence_come_before_what_the_workers_say() -> None:
    assert outcome(1, stop_requested=True, changed=True) == (Outcome.SIGNALLED, None)
    assert outcome(1, changed=True, fenced=True) == (Outcome.CHANGED, None)
    assert outcome(1, fenced=True) == (Outcome.FENCED, None)
    assert outcome(None, fenced=True) == (Outcome.FENCED, None)


def poll(*, changed: bool = False, suspended_since: float | None = None) -> PollDecision:
    """One poll at t=100 s of a node whose worker still runs, with a 6 s session."""
    return poll_decision(
        [None],
        stop_requested=False,
        changed=changed,
        suspended_since=suspended_since,
        now=100.0,
        session_timeout=6.0,
    )


def test_the_lease_is_renewed_only_while_the_round_is_live_and_the_connection_up() -> None:
    """A stale lease is how the workers of a frozen, cut-off or superseded agent stop."""
    assert poll().renew_lease
    assert not poll(changed=True).renew_lease, "the round is no longer ours"
    assert not poll(suspended_since=99.9).renew_lease, "cut off: the others may re-form"
    assert poll(suspended_since=99.9).ended is None, "within a third of the session, no fence"


def test_a_cut_off_agent_fences_once_a_third_of_the_session_has_passed() -> None:
    assert fence_after(6.0) == 2.0
    assert not connection_fenced(None, 1e9, 6.0)
    assert not connection_fenced(10.0, 11.9, 6.0)
    assert connection_fenced(10.0, 12.0, 6.0), "waking exactly at the deadline fences"
    assert poll(suspended_since=98.0).ended == (Outcome.FENCED, None)


def test_an_echo_wait_gets_back_the_time_it_could_not_listen() -> None:
    settings = RendezvousSettings("job", NodeRange(1, 2), session_timeout=6.0)
    assert echo_deadline(50.0, settings, 0.0) == 50.0 + st.echo_wait(settings)
    assert echo_deadline(50.0, settings, 4.5) == 54.5 + st.echo_wait(settings)


def test_a_wait_that_woke_more_than_a_second_late_was_stalled() -> None:
    assert not overslept(10.0, 10.5)
    assert not overslept(10.0, 11.0), "one second late is still scheduling"
    assert overslept(10.0, 11.25)
    assert not overslept(10.0, 8.0), "early is not late"
