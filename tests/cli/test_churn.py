"""The churn schedule of ``hpc-elastic run --simulate-churn``, driven by a fake clock."""

from __future__ import annotations

import random

from hpc_elastic.local import Churn, ChurnSchedule

NODES = ["node0", "node1", "node2"]


def schedule(seed: int = 0, min_nodes: int = 1) -> ChurnSchedule:
    return ChurnSchedule(Churn(every=(20.0, 40.0), downtime=10.0), min_nodes, random.Random(seed))


def test_nothing_is_killed_before_the_first_round_forms() -> None:
    plan = schedule()
    assert not plan.kill_due(10_000.0)
    plan.training_started(100.0)
    assert plan.next_kill is not None
    assert 120.0 <= plan.next_kill <= 140.0
    assert not plan.kill_due(119.9)


def test_a_killed_node_comes_back_after_the_downtime_once() -> None:
    plan = schedule()
    plan.training_started(0.0)
    now = plan.next_kill or 0.0
    victim = plan.victim(now, NODES)
    assert victim in NODES
    assert plan.returning(now + 9.9) == []
    assert plan.returning(now + 10.0) == [victim]
    assert plan.returning(now + 11.0) == []


def test_never_below_min_nodes_but_the_next_kill_is_still_scheduled() -> None:
    plan = schedule(min_nodes=2)
    plan.training_started(0.0)
    first = plan.next_kill or 0.0
    assert plan.victim(first, ["node0", "node1"]) is None
    assert plan.next_kill is not None
    assert plan.next_kill > first


def test_the_same_seed_gives_the_same_schedule() -> None:
    def run(seed: int) -> list[tuple[float, str | None]]:
        plan = schedule(seed)
        plan.training_started(0.0)
        picks = []
        for _ in range(20):
            now = plan.next_kill or 0.0
            picks.append((now, plan.victim(now, NODES)))
        return picks

    assert run(7) == run(7)
    assert run(7) != run(8)
