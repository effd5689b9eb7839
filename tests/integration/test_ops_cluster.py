"""status, events and logs against a real elastic job on the local Slurm + ZooKeeper cluster."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, free_port, wait_until
from test_local_run import STEPPER, hpc_elastic

pytestmark = pytest.mark.integration


def status(cluster: Cluster, project: Path, job: str) -> dict[str, Any]:
    result = hpc_elastic("status", "--json", job, cwd=project, env=cluster.env)
    assert result.returncode == 0, result.stderr
    view: dict[str, Any] = json.loads(result.stdout)
    return view


def test_status_events_and_logs_of_a_running_elastic_job(cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "stepper.py").write_text(STEPPER)
    submitted = hpc_elastic(
        "submit",
        "--nodes=1:2",
        f"--zk={cluster.zk_hosts}",
        "--last-call=1",
        "stepper.py",
        "--",
        "300",
        cwd=tmp_path,
        env=cluster.env,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"Submitted batch job (\d+)", submitted.stdout)
    assert job_id is not None
    job = job_id.group(1)

    def training_on_two_nodes() -> bool:
        view = status(cluster, tmp_path, job)
        return bool(view["state"] == "running" and view["world_size"] == 2)

    assert wait_until(training_on_two_nodes, 90), status(cluster, tmp_path, job)
    view = status(cluster, tmp_path, job)
    assert view["mode"] == "slurm"
    assert view["job_id"] == job
    running = [slot for slot in view["slots"] if slot["slurm_state"] == "RUNNING"]
    assert len(running) == 2
    assert {slot["node"] for slot in running} <= set(cluster.nodes)
    assert view["round"] >= 1
    assert view["max_restarts"] == 3
    assert view["code"]["dir"] == f"{view['job_dir']}/code"  # the slots run the snapshot
    assert (view["code"]["git"], view["code"]["commit"]) == (False, None)
    assert view["goodput"]["wall_s"] > 0

    table = hpc_elastic("status", job, cwd=tmp_path, env=cluster.env)
    assert "RUNNING" in table.stdout
    assert f"Slurm job {job}" in table.stdout

    copy = tmp_path / "dead-zk"
    job_dir = Path(view["job_dir"])
    shutil.copytree(job_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "logs"))
    record = json.loads((copy / "job.json").read_text())
    record["spec"]["zk"] = f"127.0.0.1:{free_port()}"
    (copy / "job.json").write_text(json.dumps(record))
    unreachable = hpc_elastic("status", str(copy), cwd=tmp_path, env=cluster.env, timeout=90)
    assert unreachable.returncode == 0
    warnings = [line for line in unreachable.stderr.splitlines() if line]
    assert len(warnings) == 1, unreachable.stderr
    assert warnings[0].startswith("warning: ZooKeeper at '127.0.0.1:")

    assert wait_until(lambda: status(cluster, tmp_path, job)["state"] == "succeeded", 120)
    done = status(cluster, tmp_path, job)
    assert done["last_checkpoint_step"] == 300
    assert done["world_size"] == 2

    timeline = hpc_elastic("events", job, cwd=tmp_path, env=cluster.env).stdout
    # Round 1 may be superseded before anyone runs it, when the second slot joins at once.
    assert re.search(r"round \d+: world size 2", timeline), timeline
    assert "all workers finished" in timeline

    logs = hpc_elastic("logs", job, "--rank", "0", cwd=tmp_path, env=cluster.env).stdout
    assert "rank 0 done at step 300" in logs
    assert cluster.wait_queue_empty(60)
