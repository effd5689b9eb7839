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
