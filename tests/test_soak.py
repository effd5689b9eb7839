"""Soak: one elastic job under random churn (preemptions, node losses and returns) to the end.

CI runs a short soak (about three minutes); ``HPC_ELASTIC_SOAK_SECONDS=600`` runs the long
one by hand. Either prints its figures, which docs/reliability.md records.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from cluster import Cluster, wait_until
from faults import Run, committed, submit

pytestmark = pytest.mark.integration
SECONDS = int(os.environ.get("HPC_ELASTIC_SOAK_SECONDS", "100"))
LONG = SECONDS > 300
STEP_SECONDS = 0.3


def preempt(run: Run, rng: random.Random) -> str:
    """A high-partition job takes three nodes for a while, then leaves: one slot goes and comes."""
    hold = rng.randint(8, 20)
    run.cluster.run(
        [
            "sbatch",
            "--partition=high",
            "--nodes=3",
            "--output=/dev/null",
            f"--wrap=srun sleep {hold}",
        ]
    )
    return f"preemption for {hold} s"


def lose_node(run: Run, rng: random.Random) -> str:
    """A node of the job crashes and comes back a few seconds later."""
    node = run.node(rng.randint(0, 1)) or run.node(0)
    if not node:
        return "no node to lose"
    run.cluster.node_kill(node)
    time.sleep(rng.uniform(3, 8))
    run.cluster.node_start(node)
    return f"{node} lost and back"


@pytest.mark.timeout(SECONDS * 3 + 300)
def test_a_job_under_random_churn_finishes_correctly(cluster: Cluster, tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("HPC_ELASTIC_SOAK_SEED", "0")))
    steps = int(SECONDS / STEP_SECONDS)
    run = submit(cluster, tmp_path, tmp_path / "checkpoints", train_args=(f"--steps={steps}",))
    started = time.monotonic()
    assert wait_until(lambda: run.last_step() > 0, 120), "training never started"
    churn = []
    quiet = (20, 60) if LONG else (10, 25)
    newest = ""
    while cluster.squeue() and time.monotonic() - started < SECONDS:
        time.sleep(rng.uniform(*quiet))
        if not cluster.squeue():
            break
        churn.append(rng.choice((preempt, lose_node))(run, rng))
        now = max(committed(run.checkpoint_dir), default="")
        assert now >= newest, f"newest checkpoint went back from {newest} to {now}"
        newest = now
    assert cluster.wait_queue_empty(SECONDS * 2 + 120), cluster.squeue()
    wall = time.monotonic() - started

    lines = run.steps()
    kinds = run.kinds()
    assert {step for step, _, _ in lines} == set(range(1, steps + 1)), "a step is missing"
    assert f"done step={steps} " in run.log.read_text()
    assert max(committed(run.checkpoint_dir)) == f"step-{steps:08d}"
    rounds = {event.round for event in run.events() if event.kind == "round"}
    print(
        f"soak {SECONDS} s: wall {wall:.0f} s, churn {len(churn)} ({'; '.join(churn)}), "
        f"{len(kinds)} events, {len(rounds)} rounds, {kinds.count('requeue')} requeues, "
        f"goodput {steps / len(lines):.2f} (steps kept / steps run), "
        f"{steps * STEP_SECONDS / wall:.2f} (training time / wall)"
    )
