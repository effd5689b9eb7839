"""The job's story told from its events: one line per event, and the figures ``status`` shows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from hpc_elastic.contract import UNREACHABLE_EXIT_CODE
from hpc_elastic.decoding import shown
from hpc_elastic.errors import one_line
from hpc_elastic.events import (
    NAMES_SHOWN,
    CheckpointDetails,
    ChurnDetails,
    Event,
    FailedDetails,
    FailureDetails,
    HangDetails,
    JoinDetails,
    Kind,
    NodesDetails,
    RoundDetails,
    StartDetails,
    StopDetails,
)

FAILURE_KINDS = frozenset({Kind.FAILURE, Kind.FAILED})


@dataclass(frozen=True)
class Summary:
    """What the events say about a job, newest facts winning."""

    round: int | None = None
    world_size: int | None = None
    members: tuple[str, ...] = ()
    """The first members' slots, as the round's event lists them."""
    member_count: int = 0
    restarts_used: int = 0
    restarts: int = 0
    """Restarts of any cause (membership change, worker failure), counted once per round."""
    preemptions: int = 0
    """Rounds ended by a preemption: Slurm preempting three slots of one round is one."""
    requeues: int = 0
    """Slots sent back to the queue: a ``requeue`` event, or a slot's agent joining again after
    it stopped for preemption when no ``requeue`` event said so (one requeue, never two)."""
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None
    last_failure: str | None = None
    outcome: str = "running"
    """running, succeeded or failed, as the agents last reported."""
    first_time: float | None = None
    last_time: float | None = None


def _requeued(event: Event, awaiting: set[str]) -> bool:
    """Whether ``event`` is a new requeue of its slot: every ``requeue`` event is one, and so
    is an agent joining after its slot's preemption unless a ``requeue`` event already told."""
    was_awaiting = event.slot in awaiting
    awaiting.discard(event.slot)
    return event.kind == "requeue" or was_awaiting


def summarize(events: Iterable[Event]) -> Summary:
    round_number: int | None = None
    world: int | None = None
    members: tuple[str, ...] = ()
    member_count = restarts_used = requeues = 0
    restarted: set[int | None] = set()
    preempted: set[object] = set()
    awaiting_requeue: set[str] = set()
    """Slots that stopped for preemption and were not yet counted as requeued."""
    checkpoint_step: int | None = None
    checkpoint_time = failure = first = last = None
    outcome = "running"
    for event in events:
        first = event.time if first is None else first
        last = event.time
        details = event.details
        if event.kind in (Kind.REQUEUE, Kind.JOIN) and _requeued(event, awaiting_requeue):
            requeues += 1
        if event.kind == Kind.ROUND:
            formed = RoundDetails.from_details(details)
            round_number = event.round
            world = formed.world_size
            members, member_count = formed.members, formed.count
            restarts_used = formed.restarts_used
            outcome = "running"
        elif event.kind == Kind.RESTART:
            restarted.add(event.round)
        elif event.kind == Kind.PREEMPT:
            awaiting_requeue.add(event.slot)
            # Without a round (a hand-written or old event) each preempt event stands alone.
            preempted.add(event.round if event.round is not None else ("event", len(preempted)))
        elif event.kind == Kind.CHECKPOINT:
            checkpoint_step = CheckpointDetails.from_details(details).step
            checkpoint_time = event.time
        elif event.kind == Kind.FAILURE:
            failure = _failure_line(event)
        elif event.kind == Kind.FAILED:
            failure = failure or FailedDetails.from_details(details).reason
            outcome = "failed"
        elif event.kind == Kind.ERROR:
            error = StopDetails.from_details(details)
            if error.exit_code == UNREACHABLE_EXIT_CODE:
                failure = error.reason  # ZooKeeper out of reach: the slot is gone
        elif event.kind == Kind.DONE:
            outcome = "succeeded"
    return Summary(
        round=round_number,
        world_size=world,
        members=members,
        member_count=member_count,
        restarts_used=restarts_used,
        restarts=len(restarted),
        preemptions=len(preempted),
        requeues=requeues,
        last_checkpoint_step=checkpoint_step,
        last_checkpoint_time=checkpoint_time,
        last_failure=failure,
        outcome=outcome,
        first_time=first,
        last_time=last,
    )


def _failure_line(event: Event) -> str:
    """A failure in one line: a hang's verdict as the sentence it is (the stack dump stays in
    the message and the rank's log), any other failure by its rank, cause and last line."""
    failure = FailureDetails.from_details(event.details)
    if failure.sentence:
        return f"{failure.sentence} (round {event.round})"
    cause = f"signal {failure.signal}" if failure.signal else f"exit code {failure.exit_code}"
    message = failure.message.strip().splitlines()
    where = event.slot or event.node
    text = f"rank {failure.rank} on {where} ({cause}) in round {event.round}"
    return f"{text}: {message[-1]}" if message else text


def _failure_or_hang(event: Event) -> str:
    if event.kind == Kind.HANG:
        return _hang_line(event)
    hung = FailureDetails.from_details(event.details).hung
    return f"{'hang' if hung else 'worker failure'}: {_failure_line(event)}"


def _hang_line(event: Event) -> str:
    """One agent's evidence of a hang: each of its ranks, then what was made of it."""
    hang = HangDetails.from_details(event.details)
    seen = "; ".join(f"rank {rank}: {line}" for rank, line in sorted(hang.evidence.items()))
    if hang.verdict == "culprit":
        verdict = f"rank {hang.rank} on node '{hang.culprit_slot}' blamed"
    elif hang.verdict == "dismissed":
        verdict = f"dismissed: {hang.sentence}"
    else:
        verdict = "nobody blamed (ambiguous)"
    return f"hang evidence ({seen or 'no rank of its own'}) -> {verdict}"


def listed(names: Sequence[str], count: int) -> str:
    """The first ``NAMES_SHOWN`` of ``names``, and how many of ``count`` are not shown:
    "0, 1, 2 and 4,093 more". A round of thousands of members is one line, not thousands."""
    shown = ", ".join(names[:NAMES_SHOWN])
    more = count - min(len(names), NAMES_SHOWN)
    if more <= 0:
        return shown
    return f"{shown} and {more:,} more" if shown else f"{more:,} members"


def clock(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%H:%M:%S")


def describe(event: Event) -> str:
    """One human sentence for an event, without time or place."""
    d = event.details
    kind = event.kind
    if kind == Kind.ROUND:
        formed = RoundDetails.from_details(d)
        return (
            f"round {event.round}: world size {formed.world_size} "
            f"({listed(formed.members, formed.count)}), restarts used {formed.restarts_used}"
        )
    if kind == Kind.JOIN:
        joined = JoinDetails.from_details(d)
        return f"agent joined ({joined.nproc} workers on {joined.host})"
    if kind == Kind.START:
        return f"workers started, ranks {list(StartDetails.from_details(d).ranks)}"
    if kind == Kind.RESTART:
        return f"workers stopped: {StopDetails.from_details(d).reason}"
    if kind in (Kind.FAILURE, Kind.HANG):
        return _failure_or_hang(event)
    if kind == Kind.FAILED:
        return f"job failed: {FailedDetails.from_details(d).reason}"
    if kind == Kind.CHECKPOINT:
        return f"checkpoint step {CheckpointDetails.from_details(d).step} committed"
    if kind == Kind.PREEMPT:
        return "preempted: workers saved and stopped, waiting for requeue"
    if kind == Kind.LEAVE:
        return f"agent left (exit code {StopDetails.from_details(d).exit_code})"
    if kind == Kind.DONE:
        return "all workers finished"
    if kind in (Kind.NODE_LOST, Kind.NODE_ARRIVED):
        named = NodesDetails.from_details(d).nodes
        nodes = listed(named, len(named))
        return f"{'lost' if kind == Kind.NODE_LOST else 'new'} nodes: {nodes}"
    if kind == Kind.CHURN:
        churn = ChurnDetails.from_details(d)
        return f"simulated churn: {churn.action} {churn.target}".rstrip()
    extra = " ".join(f"{key}={_value(value)}" for key, value in d.items() if key != "node_id")
    return f"{kind} {extra}".rstrip()


def _value(value: object) -> str:
    """A detail of a kind no reader looks into, as a person reads it: text (escaped onto one
    line) and numbers as they are, anything else (a list, an object) quoted; all cut short."""
    if isinstance(value, str):
        return one_line(value if len(value) <= VALUE_WIDTH else value[: VALUE_WIDTH - 3] + "...")
    if isinstance(value, int | float) or value is None:
        return str(value)
    return shown(value, VALUE_WIDTH)


VALUE_WIDTH = 120
"""The most of one detail a timeline line shows: the whole value is in ``events --json``."""


def line(event: Event) -> str:
    """``12:03:04  n2    round 3: world size ...`` for ``hpc-elastic events``."""
    place = event.slot or event.node
    return f"{clock(event.time)}  {place:<8} {describe(event)}"


SAME_MOMENT = 5.0
"""Seconds within which the agents' reports of one thing (a round, a restart) are one line."""


def compact(history: Iterable[Event]) -> list[tuple[Event, list[str]]]:
    """Each event once, with every place that reported it: three agents seeing round 4
    make one line, ``node0,node1,node2``."""
    merged: list[tuple[Event, list[str]]] = []
    open_lines: dict[tuple[str, int | None, str], int] = {}
    for event in history:
        key = (event.kind, event.round, describe(event))
        index = open_lines.get(key)
        if index is not None and event.time - merged[index][0].time <= SAME_MOMENT:
            merged[index][1].append(event.slot or event.node)
            continue
        open_lines[key] = len(merged)
        merged.append((event, [event.slot or event.node]))
    return merged


def compact_line(event: Event, places: list[str]) -> str:
    return f"{clock(event.time)}  {places_of(places):<17} {describe(event)}"


def _run(first: int, last: int) -> str:
    """Slots ``first`` to ``last``: a range from three on (``0-4095``), else each (``0,1``)."""
    if last - first >= 2:
        return f"{first}-{last}"
    return ",".join(str(number) for number in range(first, last + 1))


def slot_number(place: str) -> int | None:
    """The array task id ``place`` is, as Slurm writes one (``7``, never ``07``); None if it
    is another name (a local node's, the churn runner's)."""
    if place.isascii() and place.isdigit() and place == str(int(place)):
        return int(place)
    return None


def places_of(places: Iterable[str]) -> str:
    """Where a happening was reported: slots as ranges (``0-4095``: 4,096 agents reporting
    one round is a line, not 20 KB of slot numbers), other names listed, the first
    ``NAMES_SHOWN`` of them and how many more."""
    named = sorted(set(places), key=lambda place: (len(place), place))
    numbers = sorted(number for place in named if (number := slot_number(place)) is not None)
    others = [place for place in named if slot_number(place) is None]
    runs: list[list[int]] = []
    for number in numbers:
        if runs and runs[-1][1] == number - 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    shown = [*(_run(first, last) for first, last in runs), *others]
    where = ",".join(shown[:NAMES_SHOWN])
    more = len(shown) - NAMES_SHOWN
    return f"{where} and {more:,} more" if more > 0 else where
