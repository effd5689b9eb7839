"""Goodput: how much of a job's wall time trained the model, and where the rest went.

Computed from the events the agents and workers already record (``events.py``), so
``status``, ``--json`` and the soak report the same figures. The wall time (first event to
the last, or to ``now`` while the job runs) splits exactly into productive time plus time
lost by cause::

    waiting for nodes  before the first round, after a preemption, or until a new node arrived
    rendezvous         from the end of a round to the next, with the same nodes
    start-up           from a round's start to its ranks' first heartbeat ('first_heartbeat')
    checkpoint         writing checkpoints (the 'seconds' of each 'checkpoint' event)
    restart            work done after a round's last checkpoint and thrown away by its end

Events this reads, beyond the ones every agent writes (``round``, ``restart``, ``failure``,
``done``, ``failed``, ``preempt``, ``leave``, ``node_arrived``, ``checkpoint`` with ``step``):
``first_heartbeat`` or ``training`` (round r; every local rank has beaten its heartbeat), a
``step`` detail on the events that end a round (the highest step reached), a ``seconds``
detail on ``checkpoint``.
Where they are missing the figures stay consistent: start-up and checkpoint time count as
productive, and no steps count as redone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hpc_elastic.events import Event, Kind

logger = logging.getLogger(__name__)

WAITING = "waiting for nodes"
RENDEZVOUS = "rendezvous"
STARTUP = "start-up"
CHECKPOINT = "checkpoint"
RESTART = "restart"
CAUSES = (WAITING, RENDEZVOUS, STARTUP, CHECKPOINT, RESTART)

_ROUND_ENDS = frozenset({"restart", "failure", "done", "failed"})
"""Events that end a round for every member, tagged with the round's number."""
_TRAINING = frozenset({Kind.TRAINING, Kind.FIRST_HEARTBEAT})
"""Events that say a node's ranks began training in a round: the agent writes
``first_heartbeat`` once every local rank has beaten (the soak found that nothing writes
``training``, so every start-up counted as productive time)."""
_SLOT_GONE = frozenset({"preempt", "leave"})
"""An agent exiting: the round is over once one has, and its slot must come back."""


@dataclass(frozen=True)
class Goodput:
    wall: float = 0.0
    productive: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    steps_redone: int = 0

    @property
    def ratio(self) -> float:
        """Productive time over wall time, 0 for a job with no time yet."""
        return self.productive / self.wall if self.wall > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        """For ``--json``: plain numbers, seconds rounded to milliseconds."""
        return {
            "goodput": round(self.ratio, 4),
            "wall_s": round(self.wall, 3),
            "productive_s": round(self.productive, 3),
            "lost_s": {cause: round(seconds, 3) for cause, seconds in self.lost.items()},
            "steps_redone": self.steps_redone,
        }


def describe(figures: Goodput) -> str:
    """One line for a report: ``goodput`` and its ``breakdown``."""
    if figures.wall <= 0:
        return "goodput: no time recorded yet"
    return f"goodput {breakdown(figures)}"


def breakdown(figures: Goodput) -> str:
    """The ratio, then each cause that cost time, largest first (``status``'s Goodput row)."""
    if figures.wall <= 0:
        return "no time recorded yet"
    causes = sorted(
        ((seconds, cause) for cause, seconds in figures.lost.items() if seconds >= 0.5),
        reverse=True,
    )
    lost = ", ".join(f"{cause} {_duration(seconds)}" for seconds, cause in causes)
    line = f"{figures.ratio:.0%} ({_duration(figures.productive)} of {_duration(figures.wall)})"
    line += f"; lost: {lost}" if lost else ""
    return line + (f"; {figures.steps_redone} steps redone" if figures.steps_redone else "")


def _duration(seconds: float) -> str:
    if seconds < 600:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class _Round:
    number: int
    begin: float
    training: float
    stop: float
    ended_by: str
    """restart, failure, done, failed, preempt, leave, or running (not ended yet)."""
    checkpoints: tuple[Event, ...]
    reached: int | None
    """The highest step any event of the round reported, if any did."""
    arrivals: bool


def goodput(events: Iterable[Event], now: float | None = None) -> Goodput:
    """The figures for one job's events; ``now`` extends a running job's wall time."""
    timeline = sorted(events, key=lambda event: event.time)
    if not timeline:
        return Goodput()
    start = timeline[0].time
    end = max(timeline[-1].time, now if now is not None and _running(timeline) else 0.0)
    rounds = _rounds(timeline, end)
    lost = dict.fromkeys(CAUSES, 0.0)
    productive = 0.0
    redone = 0
    previous_stop, previous_end = start, "start"
    for this in rounds:
        lost[_gap_cause(previous_end, this)] += max(0.0, this.begin - previous_stop)
        lost[STARTUP] += this.training - this.begin
        kept, checkpointing, thrown = _split_training(this)
        productive += kept
        lost[CHECKPOINT] += checkpointing
        lost[RESTART] += thrown
        redone += _steps_redone(this, timeline)
        previous_stop, previous_end = this.stop, this.ended_by
    trailing = max(0.0, end - previous_stop)
    lost[WAITING if previous_end in _SLOT_GONE or not rounds else RENDEZVOUS] += trailing
    result = Goodput(end - start, productive, lost, redone)
    logger.debug("goodput: %s", result)
    return result


def _running(timeline: Sequence[Event]) -> bool:
    return timeline[-1].kind not in ("done", "failed")


def _rounds(timeline: Sequence[Event], end: float) -> list[_Round]:
    """Each round from its first ``round`` event to whatever ended it first."""
    begins: dict[int, float] = {}
    for event in timeline:
        if event.kind == Kind.ROUND and event.round is not None:
            begins.setdefault(event.round, event.time)
    numbers = sorted(begins, key=begins.__getitem__)
    rounds = []
    for index, number in enumerate(numbers):
        begin = begins[number]
        limit = begins[numbers[index + 1]] if index + 1 < len(numbers) else end
        inside = [event for event in timeline if begin <= event.time <= limit]
        stop, ended_by = _end_of(number, inside, limit)
        trainings = [e.time for e in inside if e.kind in _TRAINING and e.round == number]
        training = min(max(trainings, default=begin), stop)
        rounds.append(
            _Round(
                number=number,
                begin=begin,
                training=training,
                stop=stop,
                ended_by=ended_by,
                checkpoints=tuple(
                    e for e in inside if e.kind == Kind.CHECKPOINT and training <= e.time <= stop
                ),
                reached=_highest_step(inside, stop),
                arrivals=any(e.kind == Kind.NODE_ARRIVED and e.round == number for e in inside),
            )
        )
    return rounds


def _end_of(number: int, inside: Sequence[Event], limit: float) -> tuple[float, str]:
    for event in inside:
        # 'failed' (the job gave up) is written without a round number.
        if event.kind in _ROUND_ENDS and event.round in (number, None):
            return event.time, event.kind
        if event.kind in _SLOT_GONE:
            return event.time, event.kind
    return limit, "running"


def _highest_step(inside: Sequence[Event], stop: float) -> int | None:
    steps = [
        int(event.details["step"])
        for event in inside
        if event.time <= stop and isinstance(event.details.get("step"), int)
    ]
    return max(steps, default=None)


def _gap_cause(previous_end: str, this: _Round) -> str:
    """Waiting for nodes: the job's first rendezvous, a round after a slot left (it must
    come back through Slurm's queue), or one that a new node had to arrive for."""
    if previous_end in ("start", *_SLOT_GONE) or this.arrivals:
        return WAITING
    return RENDEZVOUS


def _split_training(this: _Round) -> tuple[float, float, float]:
    """(productive, checkpointing, thrown away) of a round's training time.

    A round that ended by a restart, a failure or an exit loses what came after its last
    checkpoint; a round that succeeded, or still runs, keeps everything.
    """
    training = this.stop - this.training
    thrown = 0.0
    if this.ended_by not in ("done", "running"):
        kept_until = max((event.time for event in this.checkpoints), default=this.training)
        thrown = this.stop - kept_until
    # Clamped so the three always add up to the round's training time.
    checkpointing = min(training - thrown, sum(_seconds(event) for event in this.checkpoints))
    return training - thrown - checkpointing, checkpointing, thrown


def _seconds(event: Event) -> float:
    value = event.details.get("seconds")
    return float(value) if isinstance(value, int | float) and value > 0 else 0.0


def _steps_redone(this: _Round, timeline: Sequence[Event]) -> int:
    """Steps reached in a round that ended badly, beyond the checkpoint the next resumes from."""
    if this.ended_by in ("done", "running") or this.reached is None:
        return 0
    committed = [
        int(event.details["step"])
        for event in timeline
        if event.kind == Kind.CHECKPOINT
        and event.time <= this.stop
        and isinstance(event.details.get("step"), int)
    ]
    return max(0, this.reached - max(committed, default=0))
