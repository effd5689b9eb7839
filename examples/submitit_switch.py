"""A submitit script switched to an elastic hpc-elastic job by changing one line.

Before, this ran ``train`` on 4 fixed Slurm nodes with ``submitit.AutoExecutor(folder)``. The
line marked SWITCH names the ``hpcelastic`` cluster instead: the job is now an array of 4
one-node slots that trains while at least 1 runs, survives preemption and node loss, and
``job.result()`` is rank 0's return value. Everything else stays: the ``slurm_*`` parameters
are simply ignored by the other cluster, and the ``hpcelastic_*`` ones by plain Slurm, so the
script runs either way.

    python examples/submitit_switch.py runs/      # needs Slurm and ZooKeeper ($HPC_ELASTIC_ZK)
"""

from __future__ import annotations

import sys
from typing import Any

import submitit


def train(learning_rate: float) -> dict[str, Any]:
    """Runs on every rank; ``submitit.JobEnvironment()`` says which one this is."""
    env = submitit.JobEnvironment()
    return {"rank": env.global_rank, "world_size": env.num_tasks, "lr": learning_rate}


def submit(folder: str) -> Any:
    """The user's submitit code; only the SWITCH line differs from the plain Slurm version."""
    # executor = submitit.AutoExecutor(folder)                    # before: plain Slurm
    executor = submitit.AutoExecutor(folder, cluster="hpcelastic")  # SWITCH: elastic
    executor.update_parameters(
        nodes=4,
        timeout_min=60,
        gpus_per_node=8,
        slurm_partition="low",
        hpcelastic_min_nodes=1,
        hpcelastic_partition="low",
    )
    return executor.submit(train, 3e-4)


if __name__ == "__main__":
    job = submit(sys.argv[1] if len(sys.argv) > 1 else "submitit-runs")
    print(f"Submitted {job.job_id}; rank 0 returned {job.result()}")
