"""Drain awareness on the real local Slurm: a node drained under a running slot is left at the
next committed checkpoint, the slot requeues and comes back on another node, and the reason
Slurm gives is in the job's events."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import Cluster, wait_until
from test_elastic_cluster import checkpoint_steps, story, submit_training, training_at

from hpc_elastic import events

pytestmark = pytest.mark.integration

REASON = "hpc-elastic test: disk swap"


def node_of(cluster: Cluster, task: str) -> str:
    """The node Slurm runs ``task`` (``123_1``) on, or "" while it does not run."""
    record = cluster.run(["scontrol", "-o", "show", "job", task], check=False).stdout
    fields = dict(word.split("=", 1) for word in record.split() if "=" in word)
    return fields.get("NodeList", "") if fields.get("JobState") == "RUNNING" else ""


def test_a_drained_nodes_slot_leaves_at_the_next_checkpoint_and_comes_back_elsewhere(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "steps.log"
    slow = tmp_path / "slow"
    slow.write_text("0 2")  # slow until the slot is back, so the job outlives the drain
    job, job_dir = submit_training(
        cluster, tmp_path, "2:3", 200, train_args=(f"--slow-file={slow}",)
    )
    assert training_at(job_dir, log, 6, 240), story(cluster, job_dir, log)
    # A checkpoint to wait beyond: with none committed yet, a drained slot leaves at once.
    assert wait_until(lambda: bool(checkpoint_steps(job_dir)), 120), story(cluster, job_dir, log)
    drained = node_of(cluster, f"{job}_1")
    assert drained, story(cluster, job_dir, log)
    cluster.run(["scontrol", "update", f"nodename={drained}", "state=drain", f"reason={REASON}"])
    try:

        def timeline() -> list[events.Event]:
            return list(events.read(job_dir / "events.jsonl"))

        def requeued() -> bool:
            return any(e.kind == "requeue" and e.slot == "1" for e in timeline())

        assert wait_until(requeued, 150, interval=0.5), story(cluster, job_dir, log)
        history = timeline()
        [said] = [event for event in history if event.kind == "drain"]
        assert said.slot == "1"
        assert (said.details["node"], said.details["reason"]) == (drained, REASON)
        assert said.details["action"] == "leaving at the next checkpoint"
        [left] = [event for event in history if event.kind == "requeue" and event.slot == "1"]
        assert left.details["cause"] == "drain", left.details
        assert drained in left.details["excluded"]
        # It waited for a checkpoint the job committed after the drain was seen.
        committed = [
            event
            for event in history
            if event.kind == "checkpoint" and said.time < event.time < left.time
        ]
        assert committed, [(e.kind, e.slot, e.time) for e in history]
        # Back on another node, and the job at full size again.
        assert wait_until(lambda: node_of(cluster, f"{job}_1") not in ("", drained), 120)
        assert training_at(job_dir, log, 6, 180), story(cluster, job_dir, log)
    finally:
        cluster.run(["scontrol", "update", f"nodename={drained}", "state=resume"], check=False)
    slow.unlink()
    assert wait_until(lambda: not cluster.squeue(), 300), story(cluster, job_dir, log)
    assert "failed" not in [event.kind for event in events.read(job_dir / "events.jsonl")]
