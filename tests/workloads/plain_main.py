"""A plain torchrun script, not ours: the process group starts inside ``main()``.

The same loop as plain_module.py (and the same ``progress`` and ``marks`` files), written the
other common way: arguments parsed in ``main()``, which starts the group. Nothing of
hpc_elastic is imported.
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def mark(out: Path, rank: object, what: str) -> None:
    with (out / "marks").open("a") as marks:
        marks.write(f"{time.time():.6f} {os.getpid()} {rank} {what}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    mark(args.out, os.environ.get("RANK"), "started")
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mark(args.out, rank, "grouped")
    ckpt = args.out / "ckpt"
    step = int(ckpt.read_text()) if ckpt.exists() else 0
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    while step < args.steps:
        total = torch.ones(1)
        dist.all_reduce(total)
        step += 1
        if rank == 0:
            (args.out / "ckpt.tmp").write_text(str(step))
            os.replace(args.out / "ckpt.tmp", ckpt)
            with (args.out / "progress").open("a") as progress:
                progress.write(f"{time.time():.3f} {step} {world} {restarts} {os.getpid()}\n")
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
