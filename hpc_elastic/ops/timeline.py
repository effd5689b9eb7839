"""The job's story told from its events: one line per event, and the figures ``status`` shows."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from hpc_elastic.events import Event

FAILURE_KINDS = frozenset({"failure", "failed"})


@dataclass(frozen=True)
class Summary:
    """What the events say about a job, newest facts winning."""

    round: int | None = None
    world_size: int | None = None
    members: tuple[str, ...] = ()
    restarts_used: int = 0
    restarts: int = 0
    """Restarts of any cause (membership change, worker failure), counted once per round."""
    preemptions: int = 0
    requeues: int = 0
    """A slot's agent joining again after it stopped for preemption (or a ``requeue`` event)."""
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None
    last_failure: str | None = None
    outcome: str = "running"
    """running, succeeded or failed, as the agents last reported."""
    first_time: float | None = None
    last_time: float | None = None


def summarize(events: Iterable[Event]) -> Summary:
    round_number = world = None
    members: tuple[str, ...] = ()
    restarts_used = preemptions = requeues = 0
    restarted: set[int | None] = set()
    checkpoint_step: int | None = None
    checkpoint_time = failure = first = last = None
    outcome = "running"
    last_by_slot: dict[str, str] = {}
    for event in events:
        first = event.time if first is None else first
        last = event.time
        details = event.details
        if event.kind == "join" and last_by_slot.get(event.slot) == "preempt":
            requeues += 1
        if "node_id" in details:
            last_by_slot[event.slot] = event.kind
        if event.kind == "round":
            round_number = event.round
            world = details.get("world_size")
            members = tuple(details.get("members", ()))
            restarts_used = int(details.get("restarts_used", restarts_used))
            outcome = "running"
        elif event.kind == "restart":
            restarted.add(event.round)
        elif event.kind == "preempt":
            preemptions += 1
        elif event.kind == "requeue":
            requeues += 1
        elif event.kind == "checkpoint":
            checkpoint_step = details.get("step")
            checkpoint_time = event.time
        elif event.kind == "failure":
            failure = _failure_line(event)
        elif event.kind == "failed":
            failure = failure or str(details.get("reason", ""))
            outcome = "failed"
        elif event.kind == "done":
            outcome = "succeeded"
    return Summary(
        round=round_number,
        world_size=world,
        members=members,
        restarts_used=restarts_used,
        restarts=len(restarted),
        preemptions=preemptions,
        requeues=requeues,
        last_checkpoint_step=checkpoint_step,
        last_checkpoint_time=checkpoint_time,
        last_failure=failure,
        outcome=outcome,
        first_time=first,
        last_time=last,
    )


def _failure_line(event: Event) -> str:
    details = event.details
    cause = (
        f"signal {details['signal']}"
        if details.get("signal")
        else (f"exit code {details.get('exit_code')}")
    )
    message = str(details.get("message", "")).strip().splitlines()
    where = event.slot or event.node
    text = f"rank {details.get('rank')} on {where} ({cause}) in round {event.round}"
    return f"{text}: {message[-1]}" if message else text


def clock(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%H:%M:%S")


def describe(event: Event) -> str:
    """One human sentence for an event, without time or place."""
    d = event.details
    kind = event.kind
    if kind == "round":
        members = ", ".join(d.get("members", ()))
        return (
            f"round {event.round}: world size {d.get('world_size')} ({members}), "
            f"restarts used {d.get('restarts_used', 0)}"
        )
    if kind == "join":
        return f"agent joined ({d.get('nproc')} workers on {d.get('host')})"
    if kind == "start":
        return f"workers started, ranks {d.get('ranks')}"
    if kind == "restart":
        return f"workers stopped: {d.get('reason')}"
    if kind == "failure":
        return f"worker failure: {_failure_line(event)}"
    if kind == "failed":
        return f"job failed: {d.get('reason')}"
    if kind == "checkpoint":
        return f"checkpoint step {d.get('step')} committed"
    if kind == "preempt":
        return "preempted: workers saved and stopped, waiting for requeue"
    if kind == "leave":
        return f"agent left (exit code {d.get('exit_code')})"
    if kind == "done":
        return "all workers finished"
    if kind in ("node_lost", "node_arrived"):
        nodes = ", ".join(str(node) for node in d.get("nodes", ()))
        return f"{'lost' if kind == 'node_lost' else 'new'} nodes: {nodes}"
    if kind == "churn":
        return f"simulated churn: {d.get('action')} {d.get('target', '')}".rstrip()
    extra = " ".join(f"{key}={value}" for key, value in d.items() if key != "node_id")
    return f"{kind} {extra}".rstrip()


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
    where = ",".join(sorted(set(places), key=lambda place: (len(place), place)))
    return f"{clock(event.time)}  {where:<17} {describe(event)}"
