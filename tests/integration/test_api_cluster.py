"""The Python API on the real local Slurm + ZooKeeper cluster: submit, follow, chain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cluster import Cluster

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]

STAGE = """
import os, pathlib, sys, time
time.sleep(float(sys.argv[2]))  # the stage's work: how long it runs is the scenario
if os.environ["RANK"] == "0":
  with open(sys.argv[1], "a") as order:
    order.write(os.environ["HPC_ELASTIC_RUN_ID"] + "\\n")
"""

DRIVER = """
import sys

import hpc_elastic

zk, order = sys.argv[1], sys.argv[2]
first = hpc_elastic.submit("stage.py", order, "6", nodes=1, zk=zk, prewarm=False)
second = hpc_elastic.submit("stage.py", order, "0", nodes="1:2", zk=zk, prewarm=False,
                            last_call=1, after=first.job_id)
print("WAITING", second.state(), flush=True)
print("FIRST", first.run_id, first.wait(timeout=180, poll=0.5).state, flush=True)
print("SECOND", second.run_id, second.wait(timeout=180, poll=0.5).state, flush=True)
print("JOBS", " ".join(job.run_id for job in hpc_elastic.jobs()), flush=True)
"""


def test_a_chained_job_starts_after_the_first_one_ended(cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "stage.py").write_text(STAGE)
    (tmp_path / "driver.py").write_text(DRIVER)
    order = tmp_path / "order"
    result = subprocess.run(
        [sys.executable, "driver.py", cluster.zk_hosts, str(order)],
        cwd=tmp_path,
        # an index of this test's own: jobs() lists every indexed job, whatever its log dir
        env={**cluster.env, "PYTHONPATH": str(REPO), "HPC_ELASTIC_INDEX": str(tmp_path / "index")},
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    said = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert said["WAITING"] == "pending"
    first, first_state = said["FIRST"].split()
    second, second_state = said["SECOND"].split()
    assert (first_state, second_state) == ("succeeded", "succeeded")
    assert order.read_text().split() == [first, second]  # the 6 s stage still finished first
    assert said["JOBS"].split() == [first, second]
