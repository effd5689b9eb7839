"""Guaranteed MIN, scavenged growth on a real Slurm with QoS preemption (``dev-cluster --qos``):
the slots above MIN run under a preemptible QoS, a job of a higher QoS takes their nodes, and
the job trains on at MIN, never stopping, then finishes and ends the growth array's tasks too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import Cluster, wait_until
from submit_output import submitted
from test_elastic_cluster import kinds, rounds, story, training_at

from hpc_elastic import events

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"


def hpc_elastic(cluster: Cluster, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", *args],
        cwd=cwd,
        env={**cluster.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def hold_with_qos(cluster: Cluster, qos: str, nodes: int) -> str:
    """A plain job of QoS ``qos`` that needs ``nodes`` nodes; returns once it runs."""
    job = cluster.run(
        [
            "sbatch",
            "--parsable",
            f"--qos={qos}",
            f"--nodes={nodes}",
            "--output=/dev/null",
            "--wrap=srun sleep 600",
        ]
    ).stdout.strip()
    assert wait_until(lambda: (job, "RUNNING") in cluster.squeue(), 120), cluster.squeue()
    return job


def test_growth_slots_lose_their_nodes_to_a_higher_qos_and_the_job_trains_on_at_min(
    qos_cluster: Cluster, tmp_path: Path
) -> None:
    cluster = qos_cluster
    log = tmp_path / "steps.log"
    slow = tmp_path / "slow"
    slow.write_text("0 1")  # slow until the shrink is seen, so the job outlives it
    result = hpc_elastic(
        cluster,
        tmp_path,
        "submit",
        "--nodes=2:4",
        "--nproc-per-node=1",
        "--grow-qos=scavenger",
        f"--zk={cluster.zk_hosts}",
        "--last-call=2",
        "--signal=USR2@15",
        str(TRAIN),
        "--",
        "--steps=150",
        "--checkpoint-every=5",
        "--sleep-per-step=0.2",
        f"--log-file={log}",
        f"--slow-file={slow}",
    )
    assert result.returncode == 0, result.stderr
    core, job_dir = submitted(result.stdout)
    grow = json.loads((job_dir / "job.json").read_text())["grow_job_id"]
    assert f"as Slurm job {grow}." in result.stdout
    assert training_at(job_dir, log, 4, 240), story(cluster, job_dir, log)

    shown = hpc_elastic(cluster, tmp_path, "status", "--json", str(job_dir))
    slots = {slot["slot"]: slot["qos"] for slot in json.loads(shown.stdout)["slots"]}
    assert slots == {"0": "-", "1": "-", "2": "scavenger", "3": "scavenger"}, shown.stdout

    high = hold_with_qos(cluster, "high", 2)
    assert training_at(job_dir, log, 2, 150), story(cluster, job_dir, log)
    requeued = {
        event.slot: event.details.get("cause")
        for event in events.read(job_dir / "events.jsonl")
        if event.kind == "requeue"
    }
    assert requeued == {"2": "preemption", "3": "preemption"}, requeued
    slow.unlink()
    # The job finishes at MIN while the growth slots wait behind the high job; the end of
    # the job cancels them, in the other array.
    assert wait_until(lambda: {job for job, _ in cluster.squeue()} == {high}, 300), story(
        cluster, job_dir, log
    )
    cluster.run(["scancel", high])
    for task in (0, 1):
        record = cluster.run(["scontrol", "-o", "show", "job", f"{core}_{task}"]).stdout
        assert "JobState=COMPLETED" in record, record
    history = kinds(job_dir)
    assert history.count("done") == 2, history
    assert "failed" not in history
    assert rounds(job_dir)[-1] == 2
    cancelled = [
        event.details.get("tasks")
        for event in events.read(job_dir / "events.jsonl")
        if event.kind == "cancel_pending"
    ]
    assert [2, 3] in [sorted(tasks) for tasks in cancelled if isinstance(tasks, list)], cancelled
