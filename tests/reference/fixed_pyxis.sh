#!/bin/bash
# Rendered by hpc-elastic 0.1.0 for run train-20261129-101500-beef from:
#   hpc-elastic submit --nodes 1:4 train.py
#SBATCH --job-name=train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --no-kill
#SBATCH --output=/scratch/runs/train-20261129-101500-beef/slurm-%j.out
#SBATCH --requeue
#SBATCH --signal=USR2@90

# No `set -u`: module systems and venv activation scripts read unset variables.
set -eo pipefail

# One agent per node, each in a step of its own.
# With pyxis each step runs in the image: the agent and its workers.
steps=()
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  srun --nodes=1 --ntasks=1 --nodelist="$node" \
    --container-image='nvcr.io#nvidia/pytorch:24.05-py3' \
    --container-mounts=/scratch/runs/train-20261129-101500-beef:/scratch/runs/train-20261129-101500-beef,/home/ada:/home/ada,/datasets:/data:ro \
    python3 -m hpc_elastic agent \
      --run-id train-20261129-101500-beef \
      --job-dir /scratch/runs/train-20261129-101500-beef \
      --nodes 1:2 \
      --nproc-per-node 1 \
      --zk 127.0.0.1:2181 \
      --zk-auth-file /scratch/runs/train-20261129-101500-beef/secret \
      --max-restarts 3 \
      --preempt-signal USR2 \
      --grace 90 \
      --prewarm torch \
      --slot "$node" \
    -- python3 -u /home/ada/train.py &
  steps+=($!)
done
# The job succeeded if any agent did (they finish together); else report the first failure.
codes=()
for step in "${steps[@]}"; do
  wait "$step" && codes+=(0) || codes+=($?)
done
for code in "${codes[@]}"; do
  [ "$code" -eq 0 ] && exit 0
done
exit "${codes[0]}"
