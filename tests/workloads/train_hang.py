"""A small DDP job on gloo in which one rank hangs on purpose
(tests/agent/test_hang_attribution.py).

Every rank steps in lockstep: a forward and a backward through DDP (its gradient all-reduce),
a short sleep, then ``elastic.should_stop`` (a marked all_reduce that beats the heartbeat).
Each step appends "<step> <rank> <pid> <round>" to ``<out>/trace``, so that the test knows
every worker's pid and how far the job got.

    --hang spin:R:S   rank R spins for ever in its own loop at step S (before any failure)
    --hang skip:R:S   at step S rank R joins an all_reduce of a pair group its partner never
                      joins, while every other rank waits in the world's all_reduce for R:
                      every rank waits in a collective its peers never join (before any
                      failure only)
    (a frozen rank needs no flag: the test SIGSTOPs it)
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hpc_elastic.train as elastic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--hang", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    first_round = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"  # no hang after a failure
    how, hang_rank, hang_step = args.hang.split(":") if args.hang else ("", "-1", "-1")
    hang_rank_, hang_step_ = int(hang_rank), int(hang_step)
    # Every rank takes part in making the pair group, as torch requires.
    pair = dist.new_group([hang_rank_, (hang_rank_ + 1) % world]) if how == "skip" else None
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(8, 16)
    trace = args.out / "trace"
    for step in range(1, args.steps + 1):
        with trace.open("a") as file:
            file.write(f"{step} {rank} {os.getpid()} {os.environ.get('HPC_ELASTIC_ROUND')}\n")
        if first_round and step == hang_step_:
            if how == "spin" and rank == hang_rank_:
                while True:  # the hang: a loop that never ends, in no collective
                    pass
            if how == "skip":
                flag = torch.ones(1)
                if rank == hang_rank_:
                    with elastic.collective("pair_all_reduce"):
                        dist.all_reduce(flag, group=pair)  # the partner never joins
                else:
                    with elastic.collective("all_reduce"):
                        dist.all_reduce(flag)  # rank hang_rank_ never joins
        optimizer.zero_grad()
        model(inputs).sum().backward()
        optimizer.step()
        time.sleep(args.sleep)
        if elastic.should_stop(step):
            break
    elastic.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
