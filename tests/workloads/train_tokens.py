"""A tiny next-token model over token shards, for tests/train/test_data_elastic.py.

``ElasticShards.tokens`` over every ``*.bin`` of ``--shards-dir`` (uint16, ``--length`` tokens
a sample), read through torchdata's ``StatefulDataLoader`` with ``--workers`` workers, DDP on
gloo under torchrun. Every rank appends one line per optimizer step to ``--read-log``:
``STEP RANK WORLD id:first_token,...``, the ids ``with_ids`` gave and the first token of each
sample, so the test can check what was read against what the files hold.
"""

from __future__ import annotations

import argparse
import gc
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hpc_elastic.train as elastic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards-dir", type=Path, required=True)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lanes", type=int, default=12)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--stop-after-steps", type=int, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--read-log", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(args)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = elastic.plan(args.batch_size, world, args.micro_batch_size)
    shards = elastic.ElasticShards.tokens(
        elastic.shard_paths(args.shards_dir, "*.bin"),
        args.length,
        plan=plan,
        lanes=args.lanes,
        with_ids=True,
    )
    loader = elastic.stateful_loader(
        shards, batch_size=plan.micro_batch_size, num_workers=args.workers
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Embedding(1 << 16, 8), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = elastic.TrainState(model, optimizer, loader=loader)
    checkpoints = elastic.Checkpointer.at(args.checkpoint_dir)
    checkpoints.load(state)
    last = state.step + args.stop_after_steps
    while state.step < last:
        for micro_batches in elastic.group(loader, plan.accumulation_steps):
            optimizer.zero_grad()
            for index, (_, tokens) in enumerate(micro_batches):
                syncing = index == len(micro_batches) - 1
                with nullcontext() if syncing else model.no_sync():
                    output = model(tokens).mean()
                    (output**2 / len(micro_batches)).backward()
            optimizer.step()
            read = [
                f"{int(i)}:{int(t[0])}"
                for ids, tokens in micro_batches
                for i, t in zip(ids, tokens, strict=True)
            ]
            with args.read_log.open("a") as log:
                log.write(f"{state.step + 1} {rank} {world} {','.join(read)}\n")
            state.finish_step()
            if state.step % 3 == 0 or state.step == last:
                checkpoints.save(state)
            if state.step == last:
                break
    if rank == 0:
        print(f"done at step {state.step} on {world} ranks, pid {os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
