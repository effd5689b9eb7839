#!/bin/bash
# Rendered by hpc-elastic 0.1.0 for run train-20261129-101500-beef from:
#   hpc-elastic submit --nodes 1:4 train.py
#SBATCH --job-name=train
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --no-kill
#SBATCH --output=/scratch/runs/train-20261129-101500-beef/slurm-%j.out
#SBATCH --partition=gpu
#SBATCH --account=proj42
#SBATCH --qos=high
#SBATCH --time=1-00:00:00
#SBATCH --mem=480G
#SBATCH --constraint=a100&ib
#SBATCH --exclude=n[1-3]
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --no-requeue
#SBATCH --signal=USR1@120
#SBATCH --reservation=big
#SBATCH --mail-type=END

# No `set -u`: module systems and venv activation scripts read unset variables.
set -eo pipefail

eval 'module load cuda/12.4'
eval 'source /opt/venv/bin/activate'

export OMP_NUM_THREADS=8
export NCCL_DEBUG=WARN

# One agent per node, each in a step of its own.
steps=()
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  srun --nodes=1 --ntasks=1 --nodelist="$node" \
    /opt/venv/bin/python -m hpc_elastic agent \
      --run-id train-20261129-101500-beef \
      --job-dir /scratch/runs/train-20261129-101500-beef \
      --nodes 1:4 \
      --nproc-per-node 8 \
      --zk zk1:2181,zk2:2181/hpc \
      --zk-auth-file /scratch/runs/train-20261129-101500-beef/secret \
      --max-restarts 5 \
      --preempt-signal USR1 \
      --grace 120 \
      --hang-timeout 300 \
      --last-call 5 \
      --session-timeout 10 \
      --min-wait 600 \
      --prewarm torch \
      --slot "$node" \
    -- /opt/venv/bin/python -u /home/ada/train.py --epochs 10 --note 'it'"'"'s fine' &
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
