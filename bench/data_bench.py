"""The cost of keeping the data position: per optimizer step and per checkpoint.

    python bench/data_bench.py                          # defaults: 2 loader workers, 64 shards
    python bench/data_bench.py --workers 0 --steps 400  # the loader in the main process
    torchrun --nproc-per-node=2 bench/data_bench.py     # the per-save gather over real ranks

The same loop three ways, taking turns so the machine's load slows all of them alike:
``ElasticShards`` read through torchdata's ``StatefulDataLoader`` (``--workers`` workers),
``--accumulation`` micro-batches per optimizer step, with no training work at all (so the
bookkeeping is not hidden behind a model):

- ``plain``: the loop draws the micro-batches of each step and does nothing else;
- ``tracked``: the same with ``TrainState(loader=...)`` and ``finish_step()`` at every step
  (the position moves on, the loader's state is taken at the step boundary);
- ``logged``: ``tracked`` with the per-step sample log on (``log_samples`` and one line per
  step).

Per checkpoint: ``Checkpointer.save`` of the same small model with and without the loader
(``TrainState(model)`` against ``TrainState(model, loader=...)``): the gather of every rank's
loader state, the check of the workers' reports, and the bytes the data adds to ``state.pt``.

Prints median microseconds per step and milliseconds per save over ``--repeats`` runs, and the
data state's size. Results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hpc_elastic.train as elastic


def read(shard: str, start: int, stop: int) -> list[torch.Tensor]:
    """Small fixed samples: the bench measures the bookkeeping, not the reading."""
    return [torch.full((16,), int(shard) * 100_000 + offset) for offset in range(start, stop)]


def build(args: argparse.Namespace) -> tuple[Any, elastic.BatchPlan]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = elastic.plan(args.batch, world, args.batch // world // args.accumulation)
    names = [str(i) for i in range(args.shards)]
    lengths = [args.shard_length] * args.shards
    shards = elastic.ElasticShards(names, lengths, read, plan=plan, lanes=args.lanes)
    loader = elastic.stateful_loader(
        shards,
        batch_size=plan.micro_batch_size,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(0),
    )
    return loader, plan


def loop(args: argparse.Namespace, mode: str) -> float:
    """Seconds per optimizer step of ``args.steps`` steps in ``mode``."""
    loader, plan = build(args)
    previous = os.environ.pop("HPC_ELASTIC_SAMPLE_LOG", None)
    where = tempfile.mkdtemp(prefix="data-bench-")
    if mode == "logged":
        os.environ["HPC_ELASTIC_SAMPLE_LOG"] = where
    try:
        state = elastic.TrainState(nn.Linear(1, 1), loader=loader) if mode != "plain" else None
        batches = elastic.group(loader, plan.accumulation_steps)
        next(batches)  # the workers' start-up is not a step
        started = time.perf_counter()
        for _ in range(args.steps):
            step = next(batches)
            if state is not None:
                if mode == "logged":
                    for batch in step:
                        state.log_samples(batch[:, 0])
                state.finish_step()
        elapsed: float = time.perf_counter() - started
        return elapsed / int(args.steps)
    finally:
        del batches
        shutil.rmtree(where, ignore_errors=True)
        os.environ.pop("HPC_ELASTIC_SAMPLE_LOG", None)
        if previous is not None:
            os.environ["HPC_ELASTIC_SAMPLE_LOG"] = previous


def saves(args: argparse.Namespace, with_loader: bool) -> tuple[float, int]:
    """Seconds per synchronous save, and the size of ``state.pt``."""
    loader, plan = build(args)
    model = nn.Linear(64, 64)
    state = elastic.TrainState(model, loader=loader if with_loader else None)
    batches = elastic.group(loader, plan.accumulation_steps)
    next(batches)
    state.finish_step()
    run = os.environ.get("TORCHELASTIC_RUN_ID") or str(os.getpid())  # the same on every rank
    directory = Path(tempfile.gettempdir()) / f"data-bench-{run}-{int(with_loader)}"
    checkpoints = elastic.Checkpointer(directory, keep=1)
    try:
        started = time.perf_counter()
        path = None
        for _ in range(args.saves):
            state.step += 1
            path = checkpoints.save(state)
        seconds = (time.perf_counter() - started) / args.saves
        size = (path / "state.pt").stat().st_size if path is not None else 0
        return seconds, size
    finally:
        del batches
        if dist.is_initialized():
            dist.barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)


def interleaved(actions: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    found: dict[str, list[float]] = {name: [] for name in actions}
    for _ in range(repeats):
        for name, action in actions.items():
            found[name].append(action())
    return {name: statistics.median(values) for name, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--shard-length", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--lanes", type=int, default=12)
    parser.add_argument("--accumulation", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    leader = not dist.is_initialized() or dist.get_rank() == 0

    modes = ("plain", "tracked", "logged")
    per_step = interleaved(
        {mode: functools.partial(loop, args, mode) for mode in modes}, args.repeats
    )
    per_save = interleaved(
        {
            "without the loader": lambda: saves(args, False)[0],
            "with the loader": lambda: saves(args, True)[0],
        },
        args.repeats,
    )
    sizes = {name: saves(args, flag)[1] for name, flag in (("without", False), ("with", True))}
    if leader:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(
            f"{world} ranks, {args.workers} loader workers, {args.accumulation} micro-batches/step"
        )
        for mode, seconds in per_step.items():
            extra = seconds - per_step["plain"]
            print(f"step  {mode:<8} {seconds * 1e6:9.1f} us  (+{extra * 1e6:8.1f} us)")
        for name, seconds in per_save.items():
            print(f"save  {name:<19} {seconds * 1e3:8.2f} ms")
        print(f"state.pt {sizes['without']} bytes without the loader, {sizes['with']} with")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
