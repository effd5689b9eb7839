"""A plain torchrun script, not ours: the process group starts at module level.

Nothing of hpc_elastic is imported: this is what a user brings. ``import torch``, then
``init_process_group("gloo")`` on the module's first lines, then an all-reduce per step with a
short sleep. Rank 0 commits the next step to ``<out>/ckpt`` after every step and appends
``<time> <step> <world> <restart count> <pid>`` to ``<out>/progress`` (the format of
train_gloo.py, which the benchmark and the tests read). Each process appends
``<time> <pid> <rank> started|grouped`` to ``<out>/marks`` when its script begins and once
its process group is up, so that a test can put the script's own moments beside the agent's.
"""

import argparse
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()
OUT: Path = args.out
with (OUT / "marks").open("a") as marks:
    marks.write(f"{time.time():.6f} {os.getpid()} {os.environ.get('RANK')} started\n")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

with (OUT / "marks").open("a") as marks:
    marks.write(f"{time.time():.6f} {os.getpid()} {os.environ.get('RANK')} imported\n")

dist.init_process_group("gloo")

with (OUT / "marks").open("a") as marks:
    marks.write(f"{time.time():.6f} {os.getpid()} {dist.get_rank()} grouped\n")
STEPS: int = args.steps
rank, world = dist.get_rank(), dist.get_world_size()
ckpt = OUT / "ckpt"
step = int(ckpt.read_text()) if ckpt.exists() else 0
restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
while step < STEPS:
    total = torch.ones(1)
    dist.all_reduce(total)
    step += 1
    if rank == 0:
        (OUT / "ckpt.tmp").write_text(str(step))
        os.replace(OUT / "ckpt.tmp", ckpt)
        with (OUT / "progress").open("a") as progress:
            progress.write(f"{time.time():.3f} {step} {world} {restarts} {os.getpid()}\n")
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
