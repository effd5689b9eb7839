"""DDP on a small model with synthetic data, resumable at any step and any world size.

Run it alone (``python examples/train.py``) or under a launcher
(``torchrun --nproc-per-node=2 examples/train.py``, or the hpc-elastic agent). It resumes from
the newest checkpoint by itself, keeps the global batch constant as the world size changes,
stops cleanly on SIGTERM/SIGUSR1/SIGUSR2, and logs every loss with its exact ``repr`` so two
runs can be compared bit for bit.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import os
import random
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import hpc_elastic.train as elastic


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps in total")
    parser.add_argument("--batch-size", type=int, default=48, help="global batch size")
    parser.add_argument("--micro-batch-size", type=int, default=48, help="largest micro-batch")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=256, help="width of the model")
    parser.add_argument("--dataset-size", type=int, default=4800)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument(
        "--data",
        choices=["sampler", "shards"],
        default="sampler",
        help="an ElasticSampler over the dataset, or the dataset cut into ElasticShards",
    )
    parser.add_argument("--shards", type=int, default=16, help="with --data shards: how many")
    parser.add_argument("--lanes", type=int, default=12, help="with --data shards: read lanes")
    parser.add_argument(
        "--loader",
        choices=["torch", "stateful"],
        default="torch",
        help="torch's DataLoader, or torchdata's StatefulDataLoader (its state is checkpointed)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="default: the job's")
    parser.add_argument("--log-file", type=Path, default=None, help="append step lines here too")
    parser.add_argument("--log-indices", type=Path, default=None, help="append sample indices")
    parser.add_argument("--sleep-per-step", type=float, default=0.0, help="seconds, for tests")
    parser.add_argument("--stop-after-steps", type=int, default=None, help="save and stop early")
    parser.add_argument(
        "--crash-mid-step",
        type=int,
        default=None,
        metavar="STEP",
        help="for tests: with STEP's micro-batches drawn but not trained, save, then SIGKILL",
    )
    parser.add_argument(
        "--slow-file",
        type=Path,
        default=None,
        help="for tests: while this file holds 'RANK SECONDS', that rank sleeps longer per step",
    )
    return parser.parse_args()


def setup_distributed() -> torch.device:
    """Join the launcher's process group: gloo on CPU, NCCL with one GPU per LOCAL_RANK."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def synthetic_dataset(size: int, seed: int) -> TensorDataset:
    """A noisy linear regression problem, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 32, generator=generator)
    targets = inputs @ torch.randn(32, 1, generator=generator)
    targets += 0.1 * torch.randn(size, 1, generator=generator)
    return TensorDataset(inputs, targets, torch.arange(size))


class DatasetSlices:
    """``read(shard, start, stop)`` for ElasticShards: rows of the dataset, shard after shard.
    A class at module level, so that loader workers started with spawn can unpickle it."""

    def __init__(self, dataset: TensorDataset, firsts: dict[str, int]) -> None:
        self.dataset = dataset
        self.firsts = firsts

    def __call__(self, shard: str, start: int, stop: int) -> list[tuple[torch.Tensor, ...]]:
        first = self.firsts[shard]
        return [self.dataset[first + offset] for offset in range(start, stop)]


def shard_lengths(size: int, count: int) -> list[int]:
    """``count`` shards of uneven lengths (a few samples more or less each) covering ``size``."""
    cuts = [0, *(round(i * size / count) + (i * 7) % 5 - 2 for i in range(1, count)), size]
    return [high - low for low, high in itertools.pairwise(cuts)]


def build_loader(
    args: argparse.Namespace, dataset: TensorDataset, plan: elastic.BatchPlan
) -> tuple[Any, elastic.ElasticSampler | None]:
    """The loader the flags ask for, and its ElasticSampler when there is one."""
    make = elastic.stateful_loader if args.loader == "stateful" else DataLoader
    # A generator of the loader's own: creating an iterator draws a seed from it, and from the
    # global RNG (dropout's) without one; a resumed run creates one iterator more.
    generator = torch.Generator().manual_seed(args.seed)
    if args.data == "shards":
        lengths = shard_lengths(len(dataset), args.shards)
        names = [f"shard-{i:03d}" for i in range(args.shards)]
        firsts = dict(zip(names, np.cumsum([0, *lengths[:-1]]).tolist(), strict=True))
        shards = elastic.ElasticShards(
            names, lengths, DatasetSlices(dataset, firsts), plan=plan, lanes=args.lanes
        )
        micro, workers = plan.micro_batch_size, args.num_workers
        return make(shards, batch_size=micro, num_workers=workers, generator=generator), None
    sampler = elastic.ElasticSampler(dataset, args.batch_size, seed=args.seed)
    loader = make(
        dataset,
        batch_size=plan.micro_batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        generator=generator,
    )
    return loader, sampler


def build_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))


def replicate(model: nn.Module) -> DistributedDataParallel:
    """DDP whose gradient buckets stay the same at every step, so a resume stays bitwise exact.

    By default DDP reduces the first step after its construction with every gradient in one
    bucket, then rebuilds its buckets in the order backward produced the gradients. An
    all-reduce over three or more ranks sums each element in an order that depends on its place
    in the bucket (two ranks sum the same either way), so the first step after a resume came out
    a last bit off the uninterrupted run's. ``find_unused_parameters=True`` keeps the first
    layout for good, at the cost of one walk of the autograd graph per step (and a warning at
    the first step saying so).
    """
    return DistributedDataParallel(model, find_unused_parameters=True)


def seed_everything(seed: int) -> None:
    """Per-rank streams, so ranks drop out different units; a resume restores them instead."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def weights_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def log_line(text: str, log_file: Path | None) -> None:
    print(text, flush=True)
    if log_file is not None:
        with open(log_file, "a") as file:
            file.write(text + "\n")


def main() -> None:
    args = parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    elastic.install_signal_handlers()
    device = setup_distributed()
    train(args, device)
    if dist.is_initialized():
        leave_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = elastic.plan(args.batch_size, world, args.micro_batch_size)

    model = build_model(args.hidden, args.seed).to(device)
    seed_everything(args.seed + 1 + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    dataset = synthetic_dataset(args.dataset_size, args.seed)
    loader, sampler = build_loader(args, dataset, plan)
    replicated = replicate(model) if dist.is_initialized() else model
    state = elastic.TrainState(replicated, optimizer, scheduler, sampler, loader=loader)
    checkpoints = elastic.Checkpointer.at(args.checkpoint_dir)
    checkpoints.load(state)
    last_step = args.steps
    if args.stop_after_steps is not None:
        last_step = min(last_step, state.step + args.stop_after_steps)

    while state.step < last_step:
        for micro_batches in elastic.group(loader, plan.accumulation_steps):
            if state.step + 1 == args.crash_mid_step:
                crash_mid_step(checkpoints, state)
            loss = train_step(state.model, optimizer, micro_batches, device)
            scheduler.step()
            trained = [i for _, _, batch in micro_batches for i in batch.tolist()]
            state.log_samples(trained)  # the sample log, when $HPC_ELASTIC_SAMPLE_LOG asks
            if args.log_indices is not None:
                indices = ",".join(map(str, trained))
                attempt = os.environ.get("HPC_ELASTIC_ROUND", "0")
                with open(args.log_indices, "a") as file:
                    file.write(
                        f"step={state.step + 1} rank={rank} world={world} round={attempt} "
                        f"{indices}\n"
                    )
            state.finish_step()
            if rank == 0:
                log_line(f"step={state.step} loss={loss!r} world={world}", args.log_file)
            time.sleep(args.sleep_per_step + slowdown(args.slow_file, rank))
            stop = elastic.should_stop(state.step)
            if state.step == last_step:
                elastic.finish()  # the loop is over: the agent stops timing this rank
            if stop or state.step % args.checkpoint_every == 0 or state.step == last_step:
                checkpoints.save(state)
            if stop:
                elastic.exit_preempted()
            if state.step == last_step:
                break

    checkpoints.wait()  # with HPC_ELASTIC_CHECKPOINT_ASYNC=1 the last save may still commit
    if rank == 0:
        log_line(f"done step={state.step} weights_sha256={weights_hash(model)}", args.log_file)


def leave_process_group() -> None:
    """Only once DDP is gone (``train`` returned): if its Reducer held the last reference to
    the gloo group, the group's destructor would run under the GIL and deadlock with gloo's
    own threads. The barrier keeps rank 0, which hosts the store, up until all ranks are done."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def crash_mid_step(checkpoints: elastic.Checkpointer, state: elastic.TrainState) -> None:
    """A kill in the middle of an accumulation step, after a save there: the loader has
    handed out this step's micro-batches, yet the checkpoint must resume at its first sample."""
    checkpoints.save(state)
    checkpoints.wait()
    os.kill(os.getpid(), signal.SIGKILL)


def slowdown(slow_file: Path | None, rank: int) -> float:
    """Extra seconds this rank sleeps per step: a straggler planted by a test
    (tests/integration/test_soak.py) for as long as it keeps the file. Slept before the step's
    collective (``should_stop``), so the other ranks wait there for it, as they would for a slow
    GPU."""
    if slow_file is None:
        return 0.0
    try:
        slow_rank, seconds = slow_file.read_text().split()
    except (OSError, ValueError):  # no file (yet, or any more): not slow
        return 0.0
    return float(seconds) if int(slow_rank) == rank else 0.0


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[list[torch.Tensor]],
    device: torch.device,
) -> float:
    """One optimizer step over the micro-batches; returns the global mean loss."""
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for index, (inputs, targets, _) in enumerate(micro_batches):
        accumulating = index < len(micro_batches) - 1
        with (
            model.no_sync()
            if isinstance(model, DistributedDataParallel) and accumulating
            else nullcontext()
        ):
            loss = nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
            torch.autograd.backward(loss / len(micro_batches))
        total += loss.detach() / len(micro_batches)
    optimizer.step()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return float(total.item())


if __name__ == "__main__":
    main()
