"""The agent's pure rules: how a round ended and what the agent does about it.

Like ``rendezvous/state.py`` for the rendezvous, every decision here is a pure function of
plain values (exit codes, flags, times), with no process, store, link or clock of its own:
``Agent`` (agent.py) gathers the facts, asks these rules, and acts; the simulation
(``hpc_elastic/simulation``) passes its own facts to the very same rules, so what it checks
is what the agent does.

- a poll of the monitor: ``poll_decision`` (the lease rule, ``round_outcome``, the fence
  after a lost connection: ``connection_fenced``, ``fence_after``);
- what follows a round's end, one action at a time: ``after_round`` over ``RoundEnd``, and
  the ``restart`` event's reason, ``restart_reason``;
- an echo's wait for its peer's news: ``echo_deadline``, ``overslept``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, fields

from hpc_elastic.agent.api import ExitCode
from hpc_elastic.contract import FENCED_EXIT_CODE
from hpc_elastic.rendezvous import state as rdzv_state
from hpc_elastic.rendezvous.api import RendezvousSettings

FENCE_FRACTION = 1 / 3
"""A cut-off agent stops its workers once SUSPENDED has lasted this fraction of the session
timeout. Kazoo reports SUSPENDED only when a ping goes unanswered, up to two thirds of the
session after the server last heard from us, and the server may expire the session (and the
others re-form) one session after that: only the last third is left. The simulation finds
the split brain with anything longer (docs/reliability.md)."""

OVERSLEPT = 1.0
"""Seconds past its deadline after which a wait that polls every 0.1 s must have been stalled
(docs/agent.md): ten polls missed is no scheduling jitter."""


class Outcome(enum.Enum):
    """How one round ended for this node, as ``round_outcome`` decides it."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CHANGED = "changed"
    FENCED = "fenced"
    """Cut off from the rendezvous for nearly a session timeout: stop before others re-form."""
    SIGNALLED = "signalled"
    PREEMPTED = "preempted"


def round_outcome(
    codes: Sequence[int | None], *, stop_requested: bool, changed: bool, fenced: bool
) -> tuple[Outcome, int | None] | None:
    """One poll's decision: how the round ended (and the index of the failed worker), or None
    while it goes on. Pure, so the simulator runs the very rule the agent runs."""
    if stop_requested:
        return Outcome.SIGNALLED, None
    if changed:
        return Outcome.CHANGED, None
    if fenced:
        return Outcome.FENCED, None
    if FENCED_EXIT_CODE in codes:
        return Outcome.FENCED, None  # its lease went stale: the round is not ours, no failure
    preempted = ExitCode.PREEMPTED
    for index, code in enumerate(codes):
        if code not in (None, 0, preempted):
            return Outcome.FAILED, index
    if all(code == 0 for code in codes):
        return Outcome.SUCCEEDED, None
    if preempted in codes and None not in codes:
        return Outcome.PREEMPTED, None
    return None


@dataclass(frozen=True)
class PollDecision:
    """What one poll of the monitor decides: renew the workers' lease or not, and how the
    round ended (with the failed worker's index), or None while it goes on."""

    renew_lease: bool
    ended: tuple[Outcome, int | None] | None


def poll_decision(
    codes: Sequence[int | None],
    *,
    stop_requested: bool,
    changed: bool,
    suspended_since: float | None,
    now: float,
    session_timeout: float,
) -> PollDecision:
    """One poll, all of it pure: the agent's monitor and the simulator both call this, so the
    lease rule (renew only while the round is ours and the connection is up) and the fencing
    deadline are the very ones the simulation checks."""
    fenced = connection_fenced(suspended_since, now, session_timeout)
    return PollDecision(
        renew_lease=not changed and suspended_since is None,
        ended=round_outcome(codes, stop_requested=stop_requested, changed=changed, fenced=fenced),
    )


def fence_after(session_timeout: float) -> float:
    """Seconds of lost connection after which the agent stops its workers (split brain)."""
    return session_timeout * FENCE_FRACTION


def connection_fenced(suspended_since: float | None, now: float, session_timeout: float) -> bool:
    """Whether the connection has been down long enough that this node must stop training."""
    return suspended_since is not None and now - suspended_since >= fence_after(session_timeout)


class AfterRound(enum.Enum):
    """What the agent does next about a round that ended: ``after_round``'s answer. The first
    five end the round for this node; the others add a fact to ``RoundEnd`` and ask again."""

    DRAIN = "drain"
    """A stop signal: forward it once, give the workers ``--grace`` to save, leave."""
    DRAIN_PREEMPTED = "drain_preempted"
    """Every worker saved and exited 75 for a preemption: drain, exit 75 (Slurm requeues)."""
    LEAVE = "leave"
    """A stop signal came while the round was being wound up: leave with its exit code."""
    REJOIN = "rejoin"
    """Join the next round (the loop's ``next_round``)."""
    DONE = "done"
    """Every node's workers succeeded: exit 0."""
    BARRIER = "barrier"
    """Every local worker exited 0: wait in the exit barrier for the other nodes."""
    STOP_WORKERS = "stop_workers"
    """Stop the group (SIGTERM, ``stop_grace``, SIGKILL) before anything else."""
    KEEP_WORKERS = "keep_workers"
    """In-place mode: the live workers wait for the next round; only the dead are gone."""
    WAIT_FOR_CHANGE = "wait_for_change"
    """The failure reads as an echo of a peer's death: wait to hear of the peer first."""
    ANNOUNCE_FAILURE = "announce_failure"
    """Say the root cause, record it, and judge whether any restart could fix it."""
    REPORT_FAILURE = "report_failure"
    """Spend one restart of the job's budget (the first report of a round wins)."""
    FAIL_JOB = "fail_job"
    """No restart can fix it (a user error, the breaker): fail the job for every node."""


ENDS_ROUND = frozenset(
    {
        AfterRound.DRAIN,
        AfterRound.DRAIN_PREEMPTED,
        AfterRound.LEAVE,
        AfterRound.REJOIN,
        AfterRound.DONE,
    }
)
"""Actions after which this node is done with the round (the others ask ``after_round`` again)."""


@dataclass(frozen=True)
class RoundEnd:
    """What the agent knows of a round that ended, and what it has done about it so far: the
    input of ``after_round``. Plain values, so that the simulation passes its own."""

    outcome: Outcome
    hung: bool = False
    """The failed rank was killed for a hang (never an echo: it died of nobody's death)."""
    echo: bool = False
    """The failed rank's own error says a peer died (``rootcause.is_echo``)."""
    takes_rounds: bool = False
    """In-place mode, and every live worker's loop takes rounds
    (``InPlaceHandover.takes_rounds``)."""
    stop_signal: bool = False
    """A stop signal is pending (read again before every decision)."""
    workers_stopped: bool = False
    """The group was stopped, or its live workers kept (in-place)."""
    heard_change: bool | None = None
    """After ``WAIT_FOR_CHANGE``: whether the rendezvous said what happened in time."""
    stalled: bool = False
    """After ``WAIT_FOR_CHANGE``: the wait ran out while the agent was stalled (``overslept``)."""
    cut_off: bool = False
    """After ``WAIT_FOR_CHANGE``: the wait ran out while the rendezvous was out of reach
    (SUSPENDED), so nothing could be heard, nor reported."""
    announced: bool = False
    unfixable: bool = False
    """After ``ANNOUNCE_FAILURE``: no restart can fix the failure."""
    reported: bool = False
    """The failure was reported (or the job failed), or the attempt gave up on a stop."""
    barrier: bool | None = None
    """After ``BARRIER``: True when every node succeeded, False when a failure elsewhere
    ended the round (rerun from the checkpoint)."""


def after_round(end: RoundEnd) -> AfterRound:
    """The agent's reaction to how its round ended, one action at a time (decide-then-act,
    as torch's dynamic rendezvous does it): pure, so ``Agent._finish_round`` and the
    simulation execute the very same rules. Every action but those in ``ENDS_ROUND`` adds
    a fact to ``end``, so the rules below always move on."""
    outcome = end.outcome
    if outcome is Outcome.SIGNALLED:
        return AfterRound.DRAIN
    if outcome is Outcome.PREEMPTED:
        return AfterRound.DRAIN_PREEMPTED
    if outcome is Outcome.SUCCEEDED:
        if end.barrier is None:
            return AfterRound.LEAVE if end.stop_signal else AfterRound.BARRIER
        return AfterRound.DONE if end.barrier else AfterRound.REJOIN
    if not end.workers_stopped:
        # In-place survivors take the next round up at a step boundary; after a fence they
        # must stop (their round is no longer theirs), as after anything they never took up.
        keep = end.takes_rounds and outcome in (Outcome.CHANGED, Outcome.FAILED)
        return AfterRound.KEEP_WORKERS if keep else AfterRound.STOP_WORKERS
    if outcome is not Outcome.FAILED:  # CHANGED or FENCED: nothing failed, nothing to spend
        return AfterRound.REJOIN
    if end.echo and not end.hung and (end.heard_change is None or end.stalled):
        # A wait that ran out while this process was stalled (frozen, swapped out) heard
        # nothing because it was not listening: its client has yet to learn, say, that its
        # own session expired meanwhile. Listen again; reporting would charge a node loss.
        return AfterRound.WAIT_FOR_CHANGE
    if end.heard_change:
        return AfterRound.REJOIN  # the peer's own report or departure ends the round
    if end.echo and not end.hung and end.cut_off:
        # Cut off, this node could not hear of the peer: charging the echo would spend a
        # restart on a partition (the simulation's seed 1237565). Rejoin, which waits for
        # the connection or exits for a requeue; the peer's own agent reports a real failure.
        return AfterRound.REJOIN
    if not end.announced:
        return AfterRound.LEAVE if end.stop_signal else AfterRound.ANNOUNCE_FAILURE
    if not end.reported:
        # Also with a stop pending (the failure event may itself have asked this node to
        # leave: the bad-node watch): unreported, a failure that follows the job from node to
        # node (a full checkpoint disk) would never spend the budget or end the job.
        return AfterRound.FAIL_JOB if end.unfixable else AfterRound.REPORT_FAILURE
    return AfterRound.LEAVE if end.stop_signal else AfterRound.REJOIN


def echo_deadline(started: float, settings: RendezvousSettings, unheard: float) -> float:
    """When an echo's wait for its peer's news (``WAIT_FOR_CHANGE``), begun at ``started``,
    gives up: after ``echo_wait`` of time in which this node could hear. Time it could not
    (``unheard``: stalled, or cut off by an outage that has ended) is given back, since the
    news of that time (a watch that re-fires after the reconnection) comes only after it;
    without it, a wait mostly spent frozen charged a node loss (simulation seed 1461216).
    An outage still going on is not given back: the wait ends ``cut_off`` (see
    ``after_round``), and rejoining waits for the connection for ``min_wait`` at most."""
    return started + rdzv_state.echo_wait(settings) + unheard


def overslept(deadline: float, now: float) -> bool:
    """Whether a wait that ends at ``now`` woke well past its ``deadline``: it wakes every
    poll (0.1 s), so a late wake means the process was stalled (a freeze, swap)."""
    return now - deadline > OVERSLEPT


def restart_reason(end: RoundEnd) -> str | None:
    """The ``restart`` event's reason when ``end`` rejoins; None when the job was failed
    (the next ``next_round`` ends it) or the node leaves."""
    if end.outcome is Outcome.SUCCEEDED:
        return "failure on another node"
    if end.outcome is Outcome.CHANGED:
        return "membership or job changed"
    if end.outcome is Outcome.FENCED:
        return "connection lost"
    if end.heard_change:
        return "peer failure"
    if end.cut_off and not end.announced:
        return "connection lost"
    return None if end.unfixable else "worker failure"


def told(end: RoundEnd) -> str:
    """``end`` for the debug log: the outcome and every fact that differs from its default."""
    defaults = RoundEnd(end.outcome)
    learned = [
        f"{each.name}={getattr(end, each.name)}"
        for each in fields(RoundEnd)
        if getattr(end, each.name) != getattr(defaults, each.name)
    ]
    return " ".join([end.outcome.value, *learned])
