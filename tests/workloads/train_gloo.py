"""A tiny torchrun-style training script: a gloo all_reduce per step, resumable by step.

Rank 0 commits the next step to ``<out>/ckpt`` after every step (write + rename) and appends
``<time> <step> <world> <restart count> <pid>`` to ``<out>/progress``, which tests and benchmarks
read to see when training moved again and at which world size.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_elastic import events
from hpc_elastic.train.heartbeat import Heartbeat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--fail", action="store_true", help="raise at the first step")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    # The restart timeline, as the training helpers record it.
    events.emit(events.Kind.WORKER_READY)
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = args.out / "ckpt"
    step = int(ckpt.read_text()) if ckpt.exists() else 0
    heartbeat = Heartbeat(min_interval=0.0)
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    first_done = False
    while step < args.steps:
        if args.fail:
            raise ValueError(f"rank {rank} refuses to train at step {step}")
        total = torch.ones(1)
        dist.all_reduce(total)
        if int(total.item()) != world:
            raise RuntimeError(f"all_reduce gave {total.item()} for world {world}")
        step += 1
        if not first_done:
            first_done = True
            events.emit(events.Kind.FIRST_STEP, step=step)
        if rank == 0:
            (args.out / "ckpt.tmp").write_text(str(step))
            os.replace(args.out / "ckpt.tmp", ckpt)
            with (args.out / "progress").open("a") as progress:
                progress.write(f"{time.time():.3f} {step} {world} {restarts} {os.getpid()}\n")
        heartbeat.beat(step)
        time.sleep(args.sleep)  # --sleep: a step's work, as the test asks
    heartbeat.finish()  # The barrier and the teardown are not training: do not time them.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
