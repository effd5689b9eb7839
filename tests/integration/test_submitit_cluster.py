"""The submitit plugin end to end on the real local Slurm + ZooKeeper cluster: a user's
submitit script, switched by ``cluster="hpcelastic"``, runs a function as an elastic job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import Cluster, wait_until
from test_submitit_plugin import install_entry_points

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]

USER_CODE = """
import submitit

def where(label):
    env = submitit.JobEnvironment()
    return (label, env.cluster, env.global_rank, env.num_tasks, env.job_id)
"""

DRIVER = """
import sys

import submitit
import usercode

import hpc_elastic

executor = submitit.AutoExecutor(sys.argv[1], cluster="hpcelastic")
executor.update_parameters(nodes=2, timeout_min=10, hpcelastic_min_nodes=1,
                           hpcelastic_last_call=1, hpcelastic_zk=sys.argv[2])
job = executor.submit(usercode.where, "hello")
print("JOB", job.job_id, flush=True)
print("RESULT", repr(job.result()), flush=True)
print("DONE", job.done(), flush=True)
# rank 0's result may land while the agents are still saying goodbye: wait for the job's end
final = hpc_elastic.Job.find(str(job.paths.folder)).wait(timeout=120, poll=0.5)
print("FINAL", job.state, final.state, flush=True)
"""


def test_a_submitit_script_runs_a_function_as_an_elastic_job(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "usercode.py").write_text(USER_CODE)
    (tmp_path / "driver.py").write_text(DRIVER)
    site = install_entry_points(tmp_path / "site")
    path = os.pathsep.join([str(REPO), str(tmp_path), str(site)])
    result = subprocess.run(
        [sys.executable, "driver.py", str(tmp_path / "runs"), cluster.zk_hosts],
        cwd=tmp_path, env={**cluster.env, "PYTHONPATH": path},
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    job_id = lines["JOB"]
    label, cluster_name, rank, world, seen_id = eval(lines["RESULT"])  # the repr our driver printed
    assert (label, cluster_name, rank) == ("hello", "hpcelastic", 0)
    assert world in (1, 2)
    assert seen_id.startswith(f"{job_id}_")
    assert lines["DONE"] == "True"
    assert lines["FINAL"] == "SUCCEEDED succeeded"


COUNTER = """
import pathlib
import time

import submitit


class Counter(submitit.helpers.Checkpointable):
    def __init__(self, folder):
        self.step = 0
        self.folder = pathlib.Path(folder)

    def __call__(self, until):
        # Rank 0's counts only: its state is the one checkpointed and requeued, and the
        # other rank, started a little earlier, may be a step or more ahead of it.
        rank0 = submitit.JobEnvironment().global_rank == 0
        if rank0:
            with (self.folder / "starts").open("a") as starts:
                starts.write(f"{self.step}\\n")
        while self.step < until:
            self.step += 1
            if rank0:
                (self.folder / "progress").write_text(str(self.step))
            time.sleep(0.1)  # a step's work, so the preemption lands mid-run
        return self.step
"""

PREEMPTED_DRIVER = """
import sys

import submitit
import counter

executor = submitit.AutoExecutor(sys.argv[1], cluster="hpcelastic")
executor.update_parameters(nodes=2, hpcelastic_min_nodes=1, hpcelastic_last_call=1,
                           hpcelastic_zk=sys.argv[2], hpcelastic_prewarm=False)
job = executor.submit(counter.Counter(sys.argv[3]), 200)
print("JOB", job.job_id, flush=True)
print("RESULT", job.result(), flush=True)
"""


def test_a_preempted_checkpointable_requeues_with_the_state_it_returned(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "counter.py").write_text(COUNTER)
    (tmp_path / "driver.py").write_text(PREEMPTED_DRIVER)
    site = install_entry_points(tmp_path / "site")
    path = os.pathsep.join([str(REPO), str(tmp_path), str(site)])
    progress = tmp_path / "progress"
    driver = subprocess.Popen(
        [sys.executable, "driver.py", str(tmp_path / "runs"), cluster.zk_hosts, str(tmp_path)],
        cwd=tmp_path, env={**cluster.env, "PYTHONPATH": path},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        counted = wait_until(
            lambda: progress.exists() and int(progress.read_text() or 0) >= 20, 120
        )
        assert counted, (
            progress.read_text() if progress.exists() else "no progress file",
            cluster.run(["squeue", "-h", "-o", "%i %T %r %N"], check=False).stdout,
        )
        high = cluster.run(
            ["sbatch", "--parsable", "-p", "high", "-N4", "-o", "/dev/null", "--wrap",
             "srun sleep 8"]
        ).stdout.strip()  # fmt: skip
        output, _ = driver.communicate(timeout=240)
    finally:
        driver.kill()
    assert driver.returncode == 0, output
    assert "RESULT 200" in output, output
    starts = [int(line) for line in (tmp_path / "starts").read_text().split()]
    assert starts[0] == 0
    assert len(starts) >= 2, starts
    assert starts[-1] >= 20, starts  # the requeued rank 0 counted on from its checkpoint
    assert high
