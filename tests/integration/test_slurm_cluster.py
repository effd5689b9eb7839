"""The Slurm layer against the real local cluster: what it sends is what Slurm accepts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cluster import REPO, Cluster, wait_until

from hpc_elastic.errors import SlurmError
from hpc_elastic.slurm import commands

pytestmark = pytest.mark.integration

# exec: with proctrack/linuxproc, a child of a killed batch shell escapes Slurm and lingers.
SLEEPER = "#!/bin/bash\n#SBATCH --output=/dev/null\nexec sleep 300\n"


def _state(cluster: Cluster, job_id: str) -> str:
    return commands.scontrol_show_job(job_id, env=cluster.env)["JobState"]


def test_submit_inspect_update_and_cancel(cluster: Cluster) -> None:
    job_id = commands.sbatch(SLEEPER, ["-N1", "--begin=now+600"], env=cluster.env)

    [status] = commands.squeue([job_id], env=cluster.env)
    assert (status.job_id, status.state, status.reason) == (job_id, "PENDING", "BeginTime")

    commands.update_job(job_id, env=cluster.env, ExcNodeList="n3")
    assert commands.scontrol_show_job(job_id, env=cluster.env)["ExcNodeList"] == "n3"

    commands.cancel(job_id, env=cluster.env)
    assert wait_until(lambda: _state(cluster, job_id) == "CANCELLED", 15)


def test_requeue_restarts_a_running_job(cluster: Cluster) -> None:
    job_id = commands.sbatch(SLEEPER, ["-N1"], env=cluster.env)
    assert wait_until(lambda: _state(cluster, job_id) == "RUNNING", 30)

    commands.requeue(job_id, env=cluster.env)

    assert wait_until(
        lambda: commands.scontrol_show_job(job_id, env=cluster.env)["Restarts"] == "1", 15
    )
    commands.cancel(job_id, env=cluster.env)


def test_unknown_partition_is_one_sentence(cluster: Cluster) -> None:
    with pytest.raises(SlurmError, match=r"^Slurm has no partition 'nope'; run `sinfo`"):
        commands.sbatch(SLEEPER, ["-p", "nope"], env=cluster.env)


def test_the_partitions_are_listed_and_an_unknown_job_has_no_tasks(cluster: Cluster) -> None:
    assert commands.partitions(env=cluster.env) == ["low", "high"]
    assert commands.squeue(["999999"], env=cluster.env) == []


def test_context_read_inside_a_real_step(cluster: Cluster) -> None:
    probe = (
        "import dataclasses, json, os; from hpc_elastic.slurm.env import SlurmContext; "
        "c = SlurmContext.from_env(os.environ); "
        "print(json.dumps(dataclasses.asdict(c)))"
    )
    result = subprocess.run(
        ["srun", "-N2", sys.executable, "-c", probe],
        env={**cluster.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    contexts = sorted(
        (json.loads(line) for line in result.stdout.splitlines()), key=lambda c: c["node_id"]
    )
    assert [(c["node_name"], c["node_id"], c["step_id"]) for c in contexts] == [
        ("n1", 0, "0"),
        ("n2", 1, "0"),
    ]
    assert contexts[0]["nodelist"] == "n[1-2]"
    assert contexts[0]["num_nodes"] == 2


def test_unknown_job_is_one_sentence(cluster: Cluster) -> None:
    with pytest.raises(SlurmError) as caught:
        commands.requeue("999999", env=cluster.env)
    assert str(caught.value) == (
        "`scontrol requeue 999999` failed: Invalid job id specified for job 999999; "
        "check the job id with `squeue` and that slurmctld is up with `scontrol ping`."
    )
