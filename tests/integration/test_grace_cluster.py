"""The save check on the real local Slurm: a partition with GraceTime=5 and saves that take
8 s, measured by the agents from the heartbeat, produce one ``grace`` warning with the figures,
in the events and in ``status``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import REPO, Cluster, wait_until
from submit_output import submitted

from hpc_elastic import events

pytestmark = pytest.mark.integration

SLOW_SAVE = REPO / "tests" / "workloads" / "slow_save.py"
GRACE5 = ("Nodes=n[1-4]", "GraceTime=5", "PreemptMode=REQUEUE", "PriorityTier=1", "State=UP")


def hpc_elastic(cluster: Cluster, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", *args],
        cwd=cwd,
        env={**cluster.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def grace5(cluster: Cluster) -> Iterator[str]:
    """A partition over the four nodes whose preempted jobs get 5 s (made for the test)."""
    cluster.run(["scontrol", "create", "PartitionName=grace5", *GRACE5])
    try:
        yield "grace5"
    finally:
        cluster.run(["scontrol", "delete", "PartitionName=grace5"], check=False)


def test_saves_longer_than_the_partitions_gracetime_are_warned_of_once_with_the_figures(
    cluster: Cluster, grace5: str, tmp_path: Path
) -> None:
    result = hpc_elastic(
        cluster,
        tmp_path,
        "submit",
        "--nodes=1:2",
        f"--partition={grace5}",
        f"--zk={cluster.zk_hosts}",
        "--no-prewarm",
        "--no-snapshot",
        "--signal=USR2@60",
        str(SLOW_SAVE),
        "--",
        "--steps=20",
        "--every=5",
        "--save-seconds=8",
    )
    assert result.returncode == 0, result.stderr
    _, job_dir = submitted(result.stdout)

    def warnings() -> list[events.Event]:
        return [e for e in events.read(job_dir / "events.jsonl") if e.kind == "grace"]

    assert wait_until(lambda: bool(warnings()), 240, interval=0.5), list(
        events.read(job_dir / "events.jsonl")
    )
    [said] = warnings()
    assert said.details["grace_s"] == 5.0
    assert 8.0 <= said.details["save_s"] < 30.0
    assert said.details["where"] == "partition 'grace5'"
    assert said.details["lead_s"] == 60.0
    assert "outgrow the GraceTime of 5 s of partition 'grace5'" in said.details["message"]
    shown = hpc_elastic(cluster, tmp_path, "status", str(job_dir))
    assert "Saves" in shown.stdout, shown.stdout
    assert "outgrow the GraceTime of 5 s" in " ".join(shown.stdout.split()), shown.stdout
    assert wait_until(lambda: not cluster.squeue(), 240), cluster.squeue()
    assert len(warnings()) == 1, "one warning per job"


SLOW_SHARED = REPO / "tests" / "workloads" / "slow_shared.py"


def hold_every_node(cluster: Cluster) -> str:
    """A ``high`` job on all four nodes: Slurm preempts every slot of a ``grace5`` job for it."""
    job = cluster.run(
        ["sbatch", "--parsable", "--partition=high", "--nodes=4", "--output=/dev/null",
         "--wrap=srun sleep 600"]
    ).stdout.strip()  # fmt: skip
    assert wait_until(lambda: (job, "RUNNING") in cluster.squeue(), 60), cluster.squeue()
    return job


def test_with_grace_action_local_a_preemption_saves_locally_and_the_next_start_resumes_there(
    cluster: Cluster, grace5: str, tmp_path: Path
) -> None:
    """Saves to the shared tier take 8 s (``slow_shared.py``), GraceTime is 5 s: the agents warn
    and publish local-first; a preemption's save then goes to the node-local tier only, in
    time, and the slots leave by themselves (the agents requeue them). Slurm holds them off
    while the high job runs; the next start resumes at the stop's step from the local copies
    and writes that step to the shared tier before training on."""
    log = tmp_path / "steps.log"
    result = hpc_elastic(
        cluster,
        tmp_path,
        "submit",
        "--nodes=1:2",
        f"--partition={grace5}",
        f"--zk={cluster.zk_hosts}",
        "--no-prewarm",
        "--no-snapshot",
        "--signal=USR2@60",
        "--grace-action=local",
        f"--local-checkpoint-dir={tmp_path / 'node-local'}",  # the nodes share this disk
        str(SLOW_SHARED),
        "--",
        "--every=40",  # 12 s of steps after a save: a preemption lands between saves
        "--shared-seconds=8",
        f"--log-file={log}",
    )
    assert result.returncode == 0, result.stderr
    job, job_dir = submitted(result.stdout)
    history = job_dir / "events.jsonl"

    def said(kind: str) -> list[events.Event]:
        return [event for event in events.read(history) if event.kind == kind]

    assert wait_until(lambda: bool(said("grace")), 240, interval=0.5), list(events.read(history))
    assert said("grace")[0].details["action"] == "local"
    assert (job_dir / "slots" / "local-first").exists()
    high = hold_every_node(cluster)
    try:

        def stop_saves() -> list[events.Event]:
            return [e for e in said("checkpoint") if e.details.get("shared") == "deferred"]

        assert wait_until(lambda: len(said("requeue")) >= 2, 120, interval=0.5), [
            (e.kind, e.details) for e in events.read(history)
        ]
        [stopped] = {e.details["step"] for e in stop_saves()}
        assert {e.details["cause"] for e in said("requeue")} == {"preemption"}
    finally:
        cluster.run(["scancel", high], check=False)

    def resumed() -> list[str]:
        return [line for line in log.read_text().splitlines() if not line.startswith("start=0 ")]

    assert wait_until(lambda: bool(resumed()), 180, interval=0.5), list(events.read(history))
    assert all(line.startswith(f"start={stopped} ") for line in resumed()), resumed()
    loaded = said("checkpoint_loaded")
    assert loaded[0].details["step"] == stopped
    assert loaded[0].details["tier"] == "local"
    replicated = [e for e in said("checkpoint") if e.details.get("replicated") == "local"]
    assert [e.details["step"] for e in replicated] == [stopped]
    assert (job_dir / "checkpoints" / f"step-{stopped:08d}").is_dir()
    hpc_elastic(cluster, tmp_path, "cancel", job, "--log-dir", str(job_dir.parent))
    assert wait_until(lambda: not cluster.squeue(), 120), cluster.squeue()
