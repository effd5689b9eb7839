"""Goodput from recorded events: productive time, steps redone, time lost by cause."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpc_elastic import events
from hpc_elastic.events import Event, kind_of
from hpc_elastic.ops.goodput import (
    CHECKPOINT,
    RENDEZVOUS,
    RESTART,
    STARTUP,
    WAITING,
    describe,
    goodput,
)


def at(time: float, kind: str, round: int | None = None, slot: str = "0", **details: Any) -> Event:
    return Event(
        kind=kind_of(kind), job="llm", slot=slot, node="n", round=round, details=details, time=time
    )


WEEKEND = [
    at(0, "join"),
    at(1, "join", slot="1"),
    at(10, "round", 1, world_size=2),
    at(10.4, "round", 1, slot="1", world_size=2),
    at(11, "training", 1),
    at(12, "training", 1, slot="1"),
    at(50, "checkpoint", 1, step=100, seconds=3.0),
    at(70, "failure", 1, step=150, rank=3),
    at(70.5, "restart", 1, step=150),
    at(75, "round", 2, world_size=2),
    at(78, "training", 2),
    at(100, "checkpoint", 2, step=200, seconds=2.0),
    at(110, "preempt", step=230, exit_code=75),
    at(111, "preempt", slot="1", step=230, exit_code=75),
    at(200, "join"),
    at(210, "round", 3, world_size=2),
    at(210, "node_arrived", 3, nodes=["2"]),
    at(215, "training", 3),
    at(300, "checkpoint", 3, step=400, seconds=5.0),
    at(320, "done", 3),
]
"""A failure, a preemption with a requeue, and success; each figure is worked out by hand
in the test below."""


def test_a_weekend_of_failure_preemption_and_success_adds_up_by_cause() -> None:
    figures = goodput(WEEKEND)
    assert figures.wall == 320
    assert figures.lost == {
        WAITING: 10 + 100,  # the first rendezvous, then the requeue after the preemption
        RENDEZVOUS: 5,  # after the failure, same nodes
        STARTUP: 2 + 3 + 5,  # round to the last rank's first heartbeat
        CHECKPOINT: 3 + 2 + 5,
        RESTART: (70 - 50) + (110 - 100),  # after each round's last checkpoint
    }
    assert figures.productive == 35 + 20 + 100
    assert figures.productive + sum(figures.lost.values()) == figures.wall
    assert figures.steps_redone == (150 - 100) + (230 - 200)
    assert figures.ratio == pytest.approx(155 / 320)


def test_figures_read_back_from_a_recorded_events_file_are_the_same(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    for event in reversed(WEEKEND):
        events.append(path, event)
    assert goodput(events.read(path)) == goodput(WEEKEND)


def test_a_running_job_counts_until_now_and_a_finished_one_does_not() -> None:
    running = WEEKEND[:12]  # up to round 2's checkpoint
    figures = goodput(running, now=105.0)
    assert figures.wall == 105
    assert figures.productive == (50 - 12 - 3) + (105 - 78 - 2)
    assert figures.lost[RESTART] == 70 - 50
    assert goodput(WEEKEND, now=1000.0).wall == 320


def test_without_training_events_or_checkpoint_durations_that_time_counts_as_productive() -> None:
    plain = [
        at(0, "join"),
        at(4, "round", 1, world_size=1),
        at(10, "checkpoint", 1, step=10),
        at(20, "done", 1),
    ]
    figures = goodput(plain)
    assert figures.productive == 16
    assert figures.lost == {WAITING: 4, RENDEZVOUS: 0, STARTUP: 0, CHECKPOINT: 0, RESTART: 0}
    assert figures.steps_redone == 0


def test_the_agents_first_heartbeat_event_ends_a_rounds_start_up() -> None:
    """What the agent really writes once every local rank has beaten (found by the soak:
    nothing writes 'training', so a 95-s start-up on the loaded machine counted as training)."""
    started = [
        at(0, "round", 1, world_size=2),
        at(0.1, "round", 1, slot="1", world_size=2),
        at(90, "first_heartbeat", 1),
        at(95, "first_heartbeat", 1, slot="1"),
        at(200, "done", 1),
    ]
    figures = goodput(started)
    assert figures.lost[STARTUP] == 95
    assert figures.productive == 105


def test_a_job_that_gave_up_loses_everything_after_its_last_checkpoint() -> None:
    gave_up = [
        at(0, "round", 1, world_size=1),
        at(1, "training", 1),
        at(5, "checkpoint", 1, step=50, seconds=1.0),
        at(9, "failed", step=90, reason="restarted 5 times since step 50 without progress"),
    ]
    figures = goodput(gave_up)
    assert figures.productive == 3
    assert figures.lost[RESTART] == 4
    assert figures.steps_redone == 40
    assert figures.productive + sum(figures.lost.values()) == figures.wall


def test_no_events_is_no_time_and_no_goodput() -> None:
    figures = goodput([])
    assert (figures.wall, figures.ratio, figures.steps_redone) == (0.0, 0.0, 0)
    assert figures.as_dict()["lost_s"] == dict.fromkeys(
        [WAITING, RENDEZVOUS, STARTUP, CHECKPOINT, RESTART], 0.0
    )


def test_status_gets_one_line_with_the_costliest_causes_first() -> None:
    assert describe(goodput(WEEKEND)) == (
        "goodput 48% (155 s of 320 s); lost: waiting for nodes 110 s, restart 30 s, "
        "start-up 10 s, checkpoint 10 s, rendezvous 5 s; 80 steps redone"
    )
    assert describe(goodput([])) == "goodput: no time recorded yet"
