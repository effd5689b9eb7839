"""Pure rules for a job that runs unattended: learned deadlines, stragglers, a breaker for
futile restarts, and which worker exits are worth a restart at all (see docs/agent.md).

Nothing here reads a clock, a file or a process: the agent feeds observations in and acts on
the answers, so each rule is tested on plain numbers. The rules follow NVIDIA's resiliency
extension in spirit (timeouts computed from observed intervals times a safety factor, a
no-progress restart limit), with our own defaults for a shared, loaded machine.
"""

from __future__ import annotations

import enum
import logging
import math
import re
import statistics
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hpc_elastic.events import Event, Kind

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """What a rank is doing while the agent waits for its heartbeat to move."""

    STARTUP = "startup"
    """From launch to the first heartbeat: imports, process group, checkpoint load."""
    STEP = "step"
    """Between two heartbeats of a training loop."""
    CHECKPOINT = "checkpoint"
    """Writing a checkpoint, during which the heartbeat does not move: from the rank's mark
    ("STEP checkpoint", ``train/heartbeat.py``) to the step it writes back after the save.
    Its durations are learned apart from the steps' (``RankWatch._learn``)."""


@dataclass(frozen=True)
class DeadlineRule:
    """How one phase's deadline is learned: ``max(floor, percentile(samples) * factor)``.

    Until ``min_samples`` durations are known the deadline is ``initial``: generous, because a
    first start-up (cold imports on a shared filesystem) can take minutes, and a false hang
    kills healthy work while a missed one only costs time.
    """

    initial: float
    floor: float
    percentile: float = 99.0
    factor: float = 5.0
    min_samples: int = 5


DEFAULT_RULES: Mapping[Phase, DeadlineRule] = {
    Phase.STARTUP: DeadlineRule(initial=1800.0, floor=300.0, min_samples=1),
    Phase.STEP: DeadlineRule(initial=600.0, floor=60.0),
    Phase.CHECKPOINT: DeadlineRule(initial=1800.0, floor=120.0, min_samples=2),
}
"""The floors stay far above a loaded machine's hiccups: the fault matrix saw false hangs at a
fixed 4 s on 2 busy cores, and a step's 99th percentile times 5 alone would repeat that."""

WINDOW = 1000
"""Durations kept per phase: enough for a stable 99th percentile, bounded for a week-long job."""


def percentile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of a non-empty sequence: always one
    of the observed values, so one outlier in a small window is the maximum, not extrapolated."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def learned_deadline(
    samples: Sequence[float], rule: DeadlineRule, override: float | None = None
) -> float:
    """Seconds a phase may last before the rank counts as hung; ``override`` (``--hang-timeout``)
    wins over anything learned."""
    if override is not None:
        return override
    if len(samples) < rule.min_samples:
        return rule.initial
    return max(rule.floor, percentile(samples, rule.percentile) * rule.factor)


@dataclass
class Deadlines:
    """The observed durations of each phase and the deadlines learned from them.

    One per agent, kept across rounds: a restart does not forget how long a step takes.
    """

    rules: Mapping[Phase, DeadlineRule] = field(default_factory=lambda: dict(DEFAULT_RULES))
    override: float | None = None
    _samples: dict[Phase, deque[float]] = field(default_factory=dict)

    def observe(self, phase: Phase, seconds: float) -> None:
        if seconds < 0 or math.isnan(seconds):
            return
        self._samples.setdefault(phase, deque(maxlen=WINDOW)).append(seconds)

    def samples(self, phase: Phase) -> list[float]:
        return list(self._samples.get(phase, ()))

    def deadline(self, phase: Phase) -> float:
        """``override`` (``--hang-timeout``) never shortens start-up: a second round's imports
        on a loaded machine can take longer than a hang timeout tuned for steps."""
        override = None if phase is Phase.STARTUP else self.override
        value = learned_deadline(self.samples(phase), self.rules[phase], override)
        logger.debug("watchdog: %s deadline %.1f s", phase.value, value)
        return value


@dataclass(frozen=True)
class StragglerRule:
    """A rank slower than ``factor`` times the median step time for ``consecutive`` steps in a
    row is a straggler; one slow step (a garbage collection, a checkpoint) is not."""

    factor: float = 1.5
    consecutive: int = 20
    min_ranks: int = 3
    """With fewer ranks the median is one of two ranks' times, so nobody can be told apart."""


@dataclass
class Stragglers:
    """Counts, per rank, the consecutive observations in which it was slow.

    ``observe`` takes one step time per rank (seconds per step, from the heartbeat) and
    returns the ranks that have *just* become stragglers, so each produces one event, not
    one per poll. A reported rank is forgiven (and may be reported again later) only after as
    many fast observations in a row as it took to report it: one fast sample among slow ones
    (the others slowed by a loaded machine) reported the same straggler twice in 10 s.
    """

    rule: StragglerRule = field(default_factory=StragglerRule)
    _slow_for: dict[int, int] = field(default_factory=dict)
    _fast_for: dict[int, int] = field(default_factory=dict)
    """Fast observations in a row of a reported rank, towards its forgiveness."""

    def observe(self, step_times: Mapping[int, float]) -> list[int]:
        if len(step_times) < self.rule.min_ranks:
            return []
        median = statistics.median(step_times.values())
        newly: list[int] = []
        for rank, seconds in sorted(step_times.items()):
            if median > 0 and seconds > self.rule.factor * median:
                self._fast_for.pop(rank, None)
                self._slow_for[rank] = self._slow_for.get(rank, 0) + 1
                if self._slow_for[rank] == self.rule.consecutive:
                    logger.debug(
                        "watchdog: rank %d straggles (%.3f s vs %.3f)", rank, seconds, median
                    )
                    newly.append(rank)
            elif self._slow_for.get(rank, 0) >= self.rule.consecutive:
                self._fast_for[rank] = self._fast_for.get(rank, 0) + 1
                if self._fast_for[rank] >= self.rule.consecutive:
                    del self._slow_for[rank], self._fast_for[rank]
                    logger.debug("watchdog: rank %d caught up", rank)
            elif self._slow_for.pop(rank, 0):
                logger.debug("watchdog: rank %d is not slow any more", rank)
        return newly

    def score(self, step_times: Mapping[int, float]) -> dict[int, float]:
        """Each rank's step time over the median (1.0 is typical), for the metric."""
        if not step_times:
            return {}
        median = statistics.median(step_times.values())
        return {rank: (s / median if median > 0 else 1.0) for rank, s in step_times.items()}


@dataclass(frozen=True)
class Breaker:
    """Stops a job that restarts without moving its checkpoint.

    ``checkpoint`` is the newest committed step when each restart happened (None before the
    first commit). Once ``limit`` restarts in a row saw the same checkpoint, more restarts
    only burn the allocation; ``tripped`` returns the one sentence the job stops with.
    """

    limit: int = 5

    def tripped(self, checkpoints_at_restarts: Iterable[int | None]) -> str | None:
        history = list(checkpoints_at_restarts)
        if not history:
            return None
        newest = history[-1]
        streak = 0
        for step in reversed(history):
            if step != newest:
                break
            streak += 1
        if streak < self.limit:
            return None
        since = f"step {newest}" if newest is not None else "the start (no checkpoint yet)"
        return (
            f"The job restarted {streak} times since {since} without progress; fix the cause "
            "in the workers' logs, then resubmit."
        )


BREAKER_KINDS = frozenset({Kind.CHECKPOINT, Kind.FAILURE})
"""The events ``checkpoints_at_restarts`` reads: the only ones worth decoding for it."""


def checkpoints_at_restarts(events: Iterable[Event]) -> list[int | None]:
    """The breaker's input from the job's events file: for each round that ended in a
    worker failure (a ``failure`` event: a root cause, a hang), the newest committed
    checkpoint step at that moment.

    Restarts for lost or arriving nodes do not count: churn is not futile, nodes come back.
    Two agents may report failures of one round, so rounds count once. The file is shared
    by all nodes, so every agent that reads it reaches the same verdict.
    """
    newest: int | None = None
    failed: set[int | None] = set()
    history: list[int | None] = []
    for event in sorted(events, key=lambda event: event.time):
        step = event.details.get("step")
        if event.kind == Kind.CHECKPOINT and isinstance(step, int):
            newest = step if newest is None else max(newest, step)
        elif event.kind == Kind.FAILURE and event.round not in failed:
            failed.add(event.round)
            history.append(newest)
    return history


class ExitClass(enum.Enum):
    """Whether a worker's failure is worth a restart."""

    RETRY = "retry"
    """Hardware, network, a peer, a hang: another round may well succeed."""
    USER_ERROR = "user_error"
    """The same code fails the same way every time: restarting only wastes the allocation."""


BAD_ARGUMENT_EXIT = 2
"""argparse's and click's exit code for a bad command line."""

_USER_ERRORS = re.compile(
    r"^\s*(ModuleNotFoundError|ImportError|SyntaxError|IndentationError|TabError)\b",
    re.MULTILINE,
)
"""Exceptions no restart can fix, as the last line of a Python traceback names them."""


def classify_exit(exit_code: int | None, message: str) -> ExitClass:
    """Classify one failed worker from its exit code and its error file (or log tail).

    A signal (exit_code None) is never the user's fault here: it came from the OOM killer,
    Slurm or our own hang detection.
    """
    if exit_code is None:
        return ExitClass.RETRY
    if exit_code == BAD_ARGUMENT_EXIT or _USER_ERRORS.search(message):
        return ExitClass.USER_ERROR
    return ExitClass.RETRY


def user_error_sentence(rank: int, exit_code: int | None, message: str) -> str:
    """The one sentence the job stops with after a user error."""
    found = _USER_ERRORS.search(message)
    what = found.group(1) if found else f"exit code {exit_code} (a bad argument)"
    return (
        f"Worker rank {rank} failed with {what}, which no restart can fix; the job is not "
        "retried: correct the script or its arguments and resubmit."
    )


Reading = tuple[float, int | None]
"""One heartbeat reading: the file's mtime and the step written in it."""


def step_seconds(previous: Reading | None, current: Reading) -> float | None:
    """Seconds per step between two heartbeat readings; None until the step has moved.

    The heartbeat is written at most every half second, so one reading may cover many steps:
    dividing by the steps advanced gives the per-step time the straggler rule compares.
    """
    if previous is None or previous[1] is None or current[1] is None:
        return None
    advanced = current[1] - previous[1]
    if advanced <= 0:
        return None
    return max(0.0, current[0] - previous[0]) / advanced


@dataclass(frozen=True)
class Hung:
    """How long a rank has waited in its phase, and its deadline: past it, what the root-cause
    line says."""

    rank: int
    phase: Phase
    waited: float
    """Wall seconds since the rank last made progress."""
    deadline: float
    counted: float | None = None
    """``waited`` less the time the machine was too busy to run the rank or its agent (see
    ``RankWatch``): what is compared with the deadline. None: all of ``waited``."""
    cpu: float | None = None
    """CPU seconds the rank used since its last progress; None if unknown."""
    cpu_per_step: float | None = None
    """The most CPU seconds a step of this rank used (the 99th percentile of its steps so
    far); None until known. A rank that used many times that without a step spins."""

    @property
    def past_deadline(self) -> bool:
        return (self.waited if self.counted is None else self.counted) > self.deadline

    def sentence(self, overridden: bool) -> str:
        if self.phase is Phase.CHECKPOINT:
            how = "--hang-timeout" if overridden else "learned save deadline"
            return (
                f"Rank {self.rank} hung in a checkpoint save: no progress for {self.waited:.1f} s "
                f"while saving ({how} {self.deadline:.1f} s)."
            )
        how = "--hang-timeout" if overridden else "learned deadline"
        return (
            f"Rank {self.rank} made no progress for {self.waited:.1f} s in {self.phase.value} "
            f"({how} {self.deadline:.1f} s) and was killed."
        )


@dataclass(frozen=True)
class Verdict:
    hung: list[Hung]
    stragglers: list[int]
    """Ranks that have just become stragglers."""
    scores: dict[int, float]
    """Each rank's latest step time over the median, for the straggler metric."""
    waits: dict[int, Hung] = field(default_factory=dict)
    """Every timed rank's wait so far, hung or not: a hang's evidence (agent/hangs.py)."""


CPU_STEPS_KEPT = 200
"""Steps of CPU time remembered per rank, for the CPU a step takes."""

STALLS_KEPT = 4096
"""Late polls remembered: far more than a deadline's worth of them on a machine that is busy."""


@dataclass
class RankWatch:
    """Watches one round's local ranks through their heartbeats, learning as it goes.

    ``poll`` takes the time, each rank's heartbeat reading (None before its first beat),
    which ranks' readings are a checkpoint mark (``saving``), and each rank's seconds spent
    waiting for a CPU so far (``queued``, from ``/proc/PID/schedstat``); it feeds the
    durations it sees into ``deadlines`` (kept by the agent across rounds) and returns the
    hung ranks and the new stragglers.

    **Saves** are learned as their own phase: from the reading that is a rank's mark to the
    next one that is not (the step written back), a checkpoint duration, never a step. Counted
    as a step, a save inflated the step deadline (a save every 50 steps is 2 % of the gaps,
    above the 99th percentile) while the checkpoint deadline stayed at its initial value for
    ever. A save shorter than a poll, mark and write-back both unseen, still counts as one
    long step: the agent polls every 0.1 s, so only saves that short, which no deadline is
    near, go unseen.

    **Under load** (docs/reliability.md, "Deadlines under load"): the time a rank waited for
    a CPU is not held against it, neither is the time this watch itself was polled late
    (with ``poll_interval`` given: the agent was not scheduled, the machine is busy). A hung
    rank still exceeds its deadline: one that sleeps (a stopped rank, a rank waiting in a
    collective, a ``sleep``) never queues for a CPU, and one that spins gets its share.
    """

    deadlines: Deadlines
    stragglers: Stragglers
    started: float
    """When the round's workers were launched: the start of every rank's start-up phase."""
    poll_interval: float | None = None
    """How often ``poll`` is meant to be called; a later call counts the delay as a stall."""
    _last: dict[int, Reading] = field(default_factory=dict)
    _step_times: dict[int, float] = field(default_factory=dict)
    _arrivals: dict[int, dict[int, float]] = field(default_factory=dict)
    """rank -> step -> when the rank was first seen at that step (see ``arrival_lags``)."""
    _queued: dict[int, float] = field(default_factory=dict)
    """Each rank's seconds waiting for a CPU, as last read."""
    _queued_at_move: dict[int, float] = field(default_factory=dict)
    """... as read when its heartbeat last moved."""
    _queued_per_step: dict[int, float] = field(default_factory=dict)
    _ran: dict[int, float] = field(default_factory=dict)
    """Each rank's CPU seconds, as last read; and as read when its heartbeat last moved:"""
    _ran_at_move: dict[int, float] = field(default_factory=dict)
    _cpu_per_step: dict[int, deque[float]] = field(default_factory=dict)
    _save_started: dict[int, float] = field(default_factory=dict)
    """rank -> the mtime of its checkpoint mark, while its readings are the mark."""
    _polled_at: float | None = None
    _stalls: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=STALLS_KEPT))
    """(when a late poll came, seconds it was late)."""
    _excused_at: float = -math.inf

    def poll(
        self,
        now: float,
        readings: Mapping[int, Reading | None],
        *,
        checkpointing: bool = False,
        queued: Mapping[int, float] | None = None,
        ran: Mapping[int, float] | None = None,
        saving: Collection[int] = (),
    ) -> Verdict:
        """``ran``: each rank's CPU seconds so far (``/proc/PID/schedstat``), for the CPU a
        step takes (a hang's evidence: a rank that spins uses far more without a step).
        ``saving``: the ranks whose reading is a checkpoint mark, read with the reading (the
        save's duration is learned from them). Every rank is timed by the checkpoint deadline
        while one of them saves, or with ``checkpointing``: a rank that waits for a saving
        peer cannot beat either."""
        self._note_stall(now)
        self._queued.update(queued or {})
        self._ran.update(ran or {})
        checkpointing = checkpointing or bool(saving)
        moved = False
        hung = []
        waits = {}
        for rank, reading in sorted(readings.items()):
            if reading is not None:
                moved |= self._learn(rank, reading, rank in saving)
                if not checkpointing:
                    # A checkpoint mark rewrites the step after the collective, when every
                    # rank is there: it says nothing about who arrived last.
                    _remember_arrival(self._arrivals.setdefault(rank, {}), reading)
            elif not self.deadlines.samples(Phase.STARTUP):
                # No rank has ever beaten: an unmodified script that never calls the
                # heartbeat must never be killed for silence.
                continue
            waits[rank] = wait = self._waiting(rank, reading, now, checkpointing)
            if wait.past_deadline and (
                self._excused_at == -math.inf
                or self._waiting(rank, reading, now, checkpointing, self._excused_at).past_deadline
            ):
                hung.append(wait)
        paced = paced_step_times(self._step_times, self._arrivals, self._queued_per_step)
        newly = self.stragglers.observe(paced) if moved else []
        return Verdict(hung, newly, self.stragglers.score(paced), waits)

    def excuse(self, now: float) -> None:
        """Time every rank afresh from ``now`` before calling it hung again: a hang's
        investigation found the job still moving (agent/hangs.py, ``first_look``), so the ranks
        that waited waited for a peer that was slow, not stuck. The waits reported as
        evidence still count from each rank's last progress."""
        self._excused_at = now
        logger.debug("watchdog: waits excused at %.3f", now)

    def _note_stall(self, now: float) -> None:
        """A poll later than ``poll_interval`` after the last one: the agent was not run."""
        if self.poll_interval is not None and self._polled_at is not None:
            late = now - self._polled_at - self.poll_interval
            if late > 0:
                self._stalls.append((now, late))
        self._polled_at = now

    def _stalled_since(self, since: float) -> float:
        """Seconds of late polls after ``since``."""
        return sum(min(late, at - since) for at, late in self._stalls if at > since)

    def _learn(self, rank: int, reading: Reading, saving: bool = False) -> bool:
        """Record a reading (``saving``: it is a checkpoint mark); True if the rank's
        heartbeat moved since the last poll."""
        previous = self._last.get(rank)
        if previous is not None and reading[0] <= previous[0]:
            return False
        was_saving = rank in self._save_started
        self._learn_save(rank, reading, saving)
        self._last[rank] = reading
        queued, queued_before = self._queued.get(rank), self._queued_at_move.get(rank)
        if queued is not None:
            self._queued_at_move[rank] = queued
        ran, ran_before = self._ran.get(rank), self._ran_at_move.get(rank)
        if ran is not None:
            self._ran_at_move[rank] = ran
        if previous is None:
            self.deadlines.observe(Phase.STARTUP, reading[0] - self.started)
            return False
        if was_saving:
            # The gap since the mark was (part of) a save, observed as such by ``_learn_save``:
            # not a step, neither its time nor its CPU (a save's serialising is no spin).
            return True
        self.deadlines.observe(Phase.STEP, reading[0] - previous[0])
        seconds = step_seconds(previous, reading)
        if seconds is not None:
            self._step_times[rank] = seconds
            advanced = (reading[1] or 0) - (previous[1] or 0)
            if queued is not None and queued_before is not None:
                self._queued_per_step[rank] = max(0.0, queued - queued_before) / advanced
            if ran is not None and ran_before is not None:
                steps = self._cpu_per_step.setdefault(rank, deque(maxlen=CPU_STEPS_KEPT))
                steps.append(max(0.0, ran - ran_before) / advanced)
        return True

    def _learn_save(self, rank: int, reading: Reading, saving: bool) -> bool:
        """Follow a rank's save through its readings; True when ``reading`` ends one (its
        duration is then observed). A mark read again with a newer mtime (a second save's mark
        after a save too short to see ended) starts the save afresh."""
        started = self._save_started.pop(rank, None)
        if saving:
            self._save_started[rank] = reading[0]
            if started is not None:
                logger.debug("watchdog: rank %d marked a save again", rank)
            return False
        if started is None:
            return False
        seconds = reading[0] - started
        logger.debug("watchdog: rank %d saved in %.3f s", rank, seconds)
        self.deadlines.observe(Phase.CHECKPOINT, seconds)
        return True

    def _waiting(
        self,
        rank: int,
        reading: Reading | None,
        now: float,
        checkpointing: bool,
        excused_at: float = -math.inf,
    ) -> Hung:
        """How long the rank has waited since its last progress (or since ``excused_at``,
        when later)."""
        if reading is None:
            phase, since = Phase.STARTUP, self.started
        else:
            phase, since = (Phase.CHECKPOINT if checkpointing else Phase.STEP), reading[0]
        since = max(since, excused_at)
        waited = now - since
        queued = self._queued.get(rank, 0.0) - self._queued_at_move.get(rank, 0.0)
        counted = waited - self._stalled_since(since) - max(0.0, queued)
        ran = self._ran.get(rank)
        steps = self._cpu_per_step.get(rank)
        return Hung(
            rank,
            phase,
            waited,
            self.deadlines.deadline(phase),
            max(0.0, counted),
            cpu=None if ran is None else max(0.0, ran - self._ran_at_move.get(rank, 0.0)),
            cpu_per_step=percentile(steps, 99.0) if steps else None,
        )


ARRIVALS_KEPT = 32
"""Steps of arrival times kept per rank: a few periods of the slowest rank are enough."""


def _remember_arrival(arrivals: dict[int, float], reading: Reading) -> None:
    """The first time a rank was seen at a step: a later rewrite of the same step (after a
    save) is not an arrival."""
    mtime, step = reading
    if step is None or step in arrivals:
        return
    arrivals[step] = mtime
    while len(arrivals) > ARRIVALS_KEPT:
        del arrivals[min(arrivals)]


def arrival_lags(arrivals: Mapping[int, Mapping[int, float]]) -> dict[int, float]:
    """How long after the first rank each rank arrived at the newest step they all reached.

    Ranks that train in lockstep (a collective every step) all step at the pace of the slowest,
    so their heartbeats move equally fast and the step time alone cannot tell the straggler:
    the heartbeat is beaten on arrival at the step's collective, and the straggler is the rank
    that keeps arriving last. Empty unless the ranks are in lockstep, none more than one step
    past the newest step they all reached (ranks that train independently drift apart, and
    their step times already differ); empty too when the heartbeat's half-second throttle made
    them record different steps.
    """
    if not arrivals or not all(arrivals.values()):
        return {}
    common = set.intersection(*(set(steps) for steps in arrivals.values()))
    if not common:
        return {}
    step = max(common)
    if max(max(steps) for steps in arrivals.values()) > step + 1:
        return {}
    first = min(steps[step] for steps in arrivals.values())
    return {rank: steps[step] - first for rank, steps in arrivals.items()}


def paced_step_times(
    step_times: Mapping[int, float],
    arrivals: Mapping[int, Mapping[int, float]],
    queued_per_step: Mapping[int, float] | None = None,
) -> dict[int, float]:
    """Each rank's step time plus its arrival lag, less the time per step it waited for a CPU:
    what the straggler rule compares.

    For ranks that train independently the lags are zero or absent and this is the step time
    itself; in lockstep the step times are equal and the lag is what sets the straggler apart
    (a rank that arrives half a period late scores 1.5). A rank that is late only because the
    machine did not run it (``queued_per_step``, from ``/proc/PID/schedstat``) is not a
    straggler: its node is busy, its GPU or its data are not slow.
    """
    lags = arrival_lags({rank: arrivals.get(rank, {}) for rank in step_times})
    queued = queued_per_step or {}
    return {
        rank: max(0.0, seconds + lags.get(rank, 0.0) - queued.get(rank, 0.0))
        for rank, seconds in step_times.items()
    }
