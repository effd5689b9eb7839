"""The deterministic simulation (hpc_elastic/simulation): many schedules, every property.

The big test runs 20,000 seeded schedules of the real rendezvous and agent rules with
crashes, freezes, partitions, preemptions, failing, hanging and stuck workers, and late or
repeated watches. A failure names each bad seed and the command that replays it.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from hpc_elastic.agent import links, rules
from hpc_elastic.agent.rules import Outcome
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import Failure
from hpc_elastic.simulation import world
from hpc_elastic.simulation.__main__ import main
from hpc_elastic.simulation.world import Fault, drawn_faults, run_many, shrink, simulate

SCHEDULES = 20_000
SPENT_ON_NOTHING = "spent the budget, but no worker really failed in it"
"""The budget's violation for a restart spent on a round in which no worker failed."""


FIGURES = {
    "outcomes": {
        "failed (below_min)": 36,
        "failed (budget)": 681,
        "failed (member_lost)": 1177,
        "failed (unfinished)": 485,
        "stuck": 223,
        "succeeded": 17398,
    },
    "restarts": 995,
    "rounds": 32190,
}
"""What seeds 0-19,999 come to: outcomes by cause (``Result.kind``), restarts spent and rounds
formed. A change of the rules or of the world that changes any schedule's end shows up here
as a diff: if it is meant, put the new figures here (the test prints them) and say why in the
commit; if not, the seeds that changed are found by comparing ``python -m
hpc_elastic.simulation --seed N`` before and after."""
FIRST_SEEDS = 2000
FIRST_FIGURES = {
    "outcomes": {
        "failed (below_min)": 5,
        "failed (budget)": 57,
        "failed (member_lost)": 107,
        "failed (unfinished)": 48,
        "stuck": 26,
        "succeeded": 1757,
    },
    "restarts": 100,
    "rounds": 3221,
}
"""The same for seeds 0-1,999: a change shows up in a few seconds, before the big run."""


@pytest.mark.timeout(900)  # about a minute of CPU; a loaded 2-core machine may triple it
def test_every_property_holds_on_twenty_thousand_schedules() -> None:
    report = run_many(0, SCHEDULES)
    print(report.summary())  # The figure in docs/reliability.md (pytest -s shows it).
    assert not report.failures, report.summary()
    assert report.figures() == FIGURES, f"the outcomes changed: {report.figures()}"
    failed = sum(count for kind, count in report.outcomes.items() if kind.startswith("failed"))
    assert report.outcomes.get("succeeded", 0) > SCHEDULES // 2, report.outcomes
    assert report.outcomes.get("failed (budget)", 0) > 0, "no schedule spent its budget"
    assert failed < SCHEDULES // 5, report.outcomes


def test_the_outcomes_of_the_first_seeds_are_pinned() -> None:
    report = run_many(0, FIRST_SEEDS)
    assert not report.failures, report.summary()
    assert report.figures() == FIRST_FIGURES, f"the outcomes changed: {report.figures()}"


def test_a_schedule_replays_bit_for_bit() -> None:
    first, again = simulate(1234), simulate(1234)
    assert first.trace == again.trace
    assert first.trace != simulate(1235).trace


def test_the_replay_command_prints_the_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seed", "7", "--trace"]) == 0
    out = capsys.readouterr().out
    assert "round 1 formed" in out
    assert out.rstrip().endswith(f"at t={simulate(7).end_time:.1f} s")


def first_violation(schedules: int = 3000) -> str:
    for seed in range(schedules):
        result = simulate(seed)
        if result.violation is not None:
            return result.summary()
    return ""


@pytest.fixture
def old_barrier_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 11's deadlock: once a member succeeded, everybody else waited in next_round."""
    fixed = st.next_action

    def old(*args: object, **kwargs: object) -> st.Action:
        state = args[0]
        assert isinstance(state, st.JobState)
        if state.succeeded:
            return st.Action.WAIT
        return fixed(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(st, "next_action", old)


@pytest.mark.usefixtures("old_barrier_rule")
def test_the_simulation_finds_the_exit_barrier_deadlock_when_its_fix_is_reverted() -> None:
    found = first_violation()
    assert "liveness" in found
    assert "replay: python -m hpc_elastic.simulation --seed" in found


def test_the_simulation_finds_the_split_brain_without_fencing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Neither the agent stops its workers when cut off, nor do the workers fence themselves
    on a stale lease: the reproduced split brain of issue 11."""
    monkeypatch.setattr(rules, "connection_fenced", lambda since, now, session: False)
    monkeypatch.setattr(world, "LEASE", float("inf"))
    assert "two groups train at once" in first_violation()


def test_the_simulation_finds_stragglers_waited_for_for_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(st, "straggler_timeout", lambda settings: float("inf"))
    assert "liveness" in first_violation()


def broken_after_round(monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    """Replace one rule of the agent's production ``after_round``, in the agent and the
    simulation at once: the simulation runs the very function, so it must see the bug."""
    fixed = rules.after_round

    def broken(end: rules.RoundEnd) -> rules.AfterRound:
        unreported = end.workers_stopped and not end.reported
        if rule == "membership change charged" and end.outcome is Outcome.CHANGED and unreported:
            return rules.AfterRound.REPORT_FAILURE
        if rule == "signal charged" and end.outcome is Outcome.SIGNALLED and not end.reported:
            return rules.AfterRound.REPORT_FAILURE
        if rule == "rerun taken for done" and end.barrier is False:
            return rules.AfterRound.DONE
        return fixed(end)

    monkeypatch.setattr(rules, "after_round", broken)


def test_the_simulation_finds_a_membership_change_charged_to_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broken_after_round(monkeypatch, "membership change charged")
    assert SPENT_ON_NOTHING in first_violation()


def test_the_simulation_finds_a_preemption_signal_charged_as_a_worker_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broken_after_round(monkeypatch, "signal charged")
    assert SPENT_ON_NOTHING in first_violation()


def test_the_simulation_finds_a_node_that_exits_0_while_the_others_rerun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The barrier's rerun taken for the job's success: Slurm never requeues that slot."""
    broken_after_round(monkeypatch, "rerun taken for done")
    found = first_violation()
    assert "VIOLATION: success: " in found, found
    assert "has not succeeded on every member" in found, found


def silent_deaths(monkeypatch: pytest.MonkeyPatch) -> None:
    """No link tells a peer's death, as when its kernel or its power goes (or before the
    agents had links): the peers hear of it when its session expires. The schedules found
    before the links (agent/links.py) ran so; with them, a crash is noticed at once."""
    monkeypatch.setattr(links, "is_evidence", lambda end: False)


def test_the_simulation_finds_echoes_charged_to_the_budget_with_the_old_echo_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 11: an echo waited only session + 1 s for the peer's departure, which ZooKeeper
    notices at tick granularity and the watch may bring later still. For a peer whose death
    no link tells (its kernel or its power went): a killed process is noticed at once."""
    silent_deaths(monkeypatch)
    monkeypatch.setattr(st, "echo_wait", lambda settings: settings.session_timeout + 1.0)
    assert SPENT_ON_NOTHING in first_violation()


def test_the_simulation_finds_echoes_reported_without_waiting_for_the_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fixed = rules.after_round
    monkeypatch.setattr(rules, "after_round", lambda end: fixed(replace(end, echo=False)))
    assert "budget: " in first_violation()


def test_the_simulation_finds_an_echo_reported_by_an_agent_frozen_through_its_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the simulation (seed 14961) once echoes were simulated: frozen through the
    end of its echo wait, an agent woke and reported the echo before its client learned that
    the peer, and its own session, were gone. It now listens again after a stalled wait. The
    rule for a wait that ended cut off (seed 1237565, below) saves this schedule too, so both
    are taken away to show it. The peer's death is a silent one (no link tells it)."""
    silent_deaths(monkeypatch)
    fixed = rules.after_round
    monkeypatch.setattr(
        rules, "after_round", lambda end: fixed(replace(end, stalled=False, cut_off=False))
    )
    found = simulate(14961)
    assert found.violation is not None
    assert found.violation.startswith("budget: "), found.summary()


def test_the_simulation_finds_an_echo_reported_while_its_agent_was_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the million-schedule run (seed 1237565): both nodes partitioned, one fenced
    and left; the other's worker died of it (an echo), its agent, cut off, heard nothing in
    its echo wait and reported the echo once the link was back: a restart spent on a
    partition. An echo's wait that ends cut off now rejoins without reporting.

    Replayed with that seed's two partitions on seed 416's world: a seed's schedule shifts
    whenever the rules write the state more or less often (every watch delivered draws a
    delay, and the workers' lifetimes come after), and seed 1237565's own workers now finish
    before its partitions."""
    partitions = (Fault(15.79, "partition", 0), Fault(13.47, "partition", 1))
    assert simulate(416, partitions).violation is None
    fixed = rules.after_round
    monkeypatch.setattr(rules, "after_round", lambda end: fixed(replace(end, cut_off=False)))
    found = simulate(416, partitions)
    assert found.violation is not None
    assert found.violation.startswith("budget: "), found.summary()


def test_the_simulation_finds_an_echo_charged_after_a_wait_spent_mostly_frozen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a 15,000-schedule window (seed 1461216): a peer crashed, this node's worker
    died of it (an echo), and its agent froze for 6 s of its 14 s echo wait. Its session
    survived; the watch that re-fired after the reconnection came 3 s late, after the wait
    had run out, and the echo was charged as a node loss. The time a wait spends cut off is
    now given back (``echo_deadline``); without that the violation comes back. The peer's
    death is a silent one (no link tells it)."""
    silent_deaths(monkeypatch)
    assert simulate(1461216).violation is None
    monkeypatch.setattr(
        rules, "echo_deadline", lambda started, settings, unheard: started + st.echo_wait(settings)
    )
    found = simulate(1461216)
    assert found.violation is not None
    assert found.violation.startswith("budget: "), found.summary()


def test_a_node_stuck_for_good_is_charged_once_as_a_real_failure_of_its_round() -> None:
    """Seed 1467254's shrunk faults: a node froze, its worker fenced, and its agent stuck for
    good with its session alive. Its peers' workers died of it; hearing nothing, both
    reported the round (the second report spends nothing), and they went on without it once
    it was overdue. Since the world has hot spares, seed 1467254 has one, which replaces the
    stuck node at once; seed 1467289 is the same story without a spare."""
    faults = tuple(map(world.Fault.parse, ("stuck@15.02:1", "freeze@10.87:1")))  # shrunk
    result = simulate(1467289, faults)
    assert result.violation is None, result.summary()
    assert (result.outcome, result.restarts_used) == ("succeeded", 1), result.summary()
    reports = [line for line in result.trace if "after the round: report_failure" in line]
    assert len(reports) == 2, result.trace


def test_the_agents_reaction_to_a_round_is_the_production_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every action the simulated agents take after a round comes from ``after_round``."""
    asked: list[rules.AfterRound] = []
    fixed = rules.after_round

    def spy(end: rules.RoundEnd) -> rules.AfterRound:
        asked.append(fixed(end))
        return asked[-1]

    monkeypatch.setattr(rules, "after_round", spy)
    result = simulate(7)
    taken = [line.rsplit(": ", 1)[1] for line in result.trace if "after the round: " in line]
    assert taken == [action.value for action in asked]
    assert {"barrier", "done"} <= set(taken), result.trace


def test_a_violation_shrinks_to_fewer_faults_and_its_replay_command_reproduces_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With fencing reverted, the first split brain that several faults lead to shrinks to
    the one fault that matters, and the printed command replays that shrunk schedule."""
    monkeypatch.setattr(rules, "connection_fenced", lambda since, now, session: False)
    monkeypatch.setattr(world, "LEASE", float("inf"))
    found = next(
        result
        for result in map(simulate, range(3000))
        if result.violation is not None and len(result.faults) >= 2
    )
    shrunk = shrink(found)
    assert len(shrunk.faults) < len(found.faults), (found.faults, shrunk.faults)
    assert shrunk.violation is not None
    assert "two groups train at once" in shrunk.violation
    for fault in shrunk.faults:  # each one of the seed's own, at most as late
        assert any(
            (fault.kind, fault.slot) == (own.kind, own.slot) and fault.when <= own.when
            for own in found.faults
        ), (fault, found.faults)

    command = shlex.split(shrunk.replay())
    assert command[:3] == ["python", "-m", "hpc_elastic.simulation"]
    assert main([*command[3:], "--no-shrink"]) == 1
    out = capsys.readouterr().out
    assert shrunk.trace == simulate(shrunk.seed, shrunk.faults).trace
    assert f"VIOLATION: {shrunk.violation}" in out


def test_a_fault_list_that_names_no_kind_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--seed", "1", "--faults", "meteor@3:0"])
    assert "fault 'meteor@3:0' names no kind" in capsys.readouterr().err


def without_split_brain(schedules: int, *, freezes: bool = True) -> str:
    """The first split brain (two groups training at once) of the first ``schedules`` seeds,
    or ""; ``freezes=False`` runs each schedule without its freezes."""
    for seed in range(schedules):
        faults = drawn_faults(seed)
        kept = faults if freezes else tuple(f for f in faults if f.kind != "freeze")
        result = simulate(seed, None if kept == faults else kept)
        if result.violation is not None and "two groups train at once" in result.violation:
            return result.summary()
    return ""


def renewing_while_cut_off(fixed: Callable[..., rules.PollDecision]) -> Callable[..., object]:
    """``poll_decision`` with the lease renewed while the connection is down."""

    def broken(codes: list[int | None], **kwargs: Any) -> rules.PollDecision:
        decision = fixed(codes, **kwargs)
        return replace(decision, renew_lease=not kwargs["changed"])

    return broken


def test_the_lease_alone_fences_a_node_cut_off_or_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the agent's own fence off, the workers' lease, renewed only while the agent is
    connected and its round live, stops every cut-off or frozen node's workers before a
    round forms without it; renewed while cut off, it lets a partitioned node train on."""
    monkeypatch.setattr(rules, "connection_fenced", lambda since, now, session: False)
    assert without_split_brain(2000) == ""
    monkeypatch.setattr(world, "poll_decision", renewing_while_cut_off(rules.poll_decision))
    assert "two groups train at once" in without_split_brain(3000)


def test_the_agents_fence_alone_stops_a_cut_off_node_within_a_third_of_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the lease off (workers never fence themselves), the agent's fence alone stops a
    partitioned node's workers in time: once SUSPENDED has lasted a third of the session.
    A frozen agent fences nothing (only the lease covers a freeze), so these schedules run
    without their freezes. Fencing after a full session, as it once did, is too late."""
    monkeypatch.setattr(world, "LEASE", float("inf"))
    monkeypatch.setattr(world, "BUGGIFY_SHARE", 0.0)  # its planted freezes are freezes too
    assert without_split_brain(2000, freezes=False) == ""
    monkeypatch.setattr(rules, "FENCE_FRACTION", 1.0)
    assert "two groups train at once" in without_split_brain(3000, freezes=False)


def broken_record_failure(monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    """``record_failure`` with one planted bug."""
    fixed = st.record_failure

    def broken(state: st.JobState, round_number: int, failure: Failure) -> st.JobState:
        new = fixed(state, round_number, failure)
        if rule == "one restart too many" and new.failed and not state.failed:
            return replace(new, restarts_used=state.restarts_used + 1, failure_summary="")
        if rule == "a failure never spends a restart" and new.restarts_used > state.restarts_used:
            return replace(new, restarts_used=state.restarts_used)
        return new

    monkeypatch.setattr(st, "record_failure", broken)


def test_the_simulation_finds_one_restart_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    broken_record_failure(monkeypatch, "one restart too many")
    found = first_violation()
    assert "VIOLATION: budget: " in found, found
    assert "restarts spent of a budget of" in found, found


def test_the_simulation_finds_a_failure_that_never_spends_a_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broken_record_failure(monkeypatch, "a failure never spends a restart")
    found = first_violation()
    assert "VIOLATION: budget: " in found, found


def test_the_simulation_finds_a_node_done_before_all_its_workers_exited_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node with several workers counts as done only once every one of them exited 0."""
    fixed = rules.round_outcome

    def any_zero(codes: list[int | None], **kwargs: bool) -> tuple[Outcome, int | None] | None:
        if 0 in codes and None in codes:
            return Outcome.SUCCEEDED, None
        return fixed(codes, **kwargs)

    monkeypatch.setattr(rules, "round_outcome", any_zero)
    found = first_violation()
    assert "VIOLATION: success: " in found, found
    assert "workers exited [0, None" in found or "None, 0" in found, found


def test_a_job_without_faults_succeeds_on_every_node_with_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Schedules whose nodes run one, two or three workers each, and no fault at all (none
    drawn, none planted)."""
    monkeypatch.setattr(world, "BUGGIFY_SHARE", 0.0)
    for seed in range(200):
        result = simulate(seed, ())
        assert result.violation is None, result.summary()
        assert (result.kind, result.restarts_used) == ("succeeded", 0) or result.kind == "closed"


def test_running_many_schedules_leaves_the_processs_logging_as_it_found_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_many(0, 2)
    logging.getLogger("hpc_elastic").warning("still heard")
    assert "still heard" in caplog.text


def test_the_simulation_finds_a_reset_link_taken_for_a_dead_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partition's middlebox resets the links of a node that lives on: taken for its death,
    the others form a round without it while its workers still train."""
    monkeypatch.setattr(links, "is_evidence", lambda end: True)
    assert "two groups train at once" in first_violation()


def test_a_crashed_node_is_left_out_before_its_session_expires() -> None:
    """Its links end with FIN at the crash: the next round forms while the store still lists
    it, in the schedules where it held a round with others (every property holding)."""
    left = []
    for seed in range(100):
        crashed = world.World(seed, (world.Fault(15.0, "crash", 0),))
        result = crashed.run()
        assert result.violation is None, result.summary()
        left += crashed.properties.left_before_expiry
    assert left, "no crash was noticed before its session expired"
