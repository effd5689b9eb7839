#!/bin/bash
# Rendered by hpc-elastic 0.1.0 for run train-20261129-101500-beef from:
#   hpc-elastic submit --nodes 1:4 train.py
#SBATCH --job-name=train
#SBATCH --array=0-3
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --output=/scratch/runs/train-20261129-101500-beef/slurm-%A_%a.out
#SBATCH --requeue
#SBATCH --signal=USR2@90

# No `set -u`: module systems and venv activation scripts read unset variables.
set -eo pipefail

# One agent per array task; its slot is the task id.
exec srun --ntasks=1 \
  /opt/venv/bin/python -m hpc_elastic agent \
    --run-id train-20261129-101500-beef \
    --job-dir /scratch/runs/train-20261129-101500-beef \
    --nodes 1:4 \
    --nproc-per-node 1 \
    --zk 127.0.0.1:2181 \
    --zk-auth-file /scratch/runs/train-20261129-101500-beef/secret \
    --max-restarts 3 \
    --preempt-signal USR2 \
    --grace 90 \
    --slot "$SLURM_ARRAY_TASK_ID" \
  -- apptainer exec --nv --bind /scratch/runs/train-20261129-101500-beef:/scratch/runs/train-20261129-101500-beef,/home/ada:/home/ada,/datasets:/datasets /images/pytorch-24.sif /opt/conda/bin/python -u /home/ada/train.py
