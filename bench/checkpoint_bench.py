"""Checkpoint cost against plain torch.save/torch.load, and the cost of one should_stop() call.

    python bench/checkpoint_bench.py                 # save/load of a ~100 MB model state
    torchrun --nproc-per-node=2 bench/checkpoint_bench.py --should-stop   # per-call agreement cost

Prints median seconds over ``--repeats`` runs; results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import hpc_elastic.train as elastic


def interleaved_medians(
    actions: dict[str, Callable[[], object]], repeats: int
) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds per action, taking turns so load slows all of them alike.

    CPU time is the steadier figure on a shared machine; wall time adds waiting for the disk.
    """
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in actions}
    for _ in range(repeats):
        for name, action in actions.items():
            wall, cpu = time.perf_counter(), time.process_time()
            action()
            timings[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: (
            statistics.median(wall for wall, _ in values),
            statistics.median(cpu for _, cpu in values),
        )
        for name, values in timings.items()
    }


def fsynced_torch_save(payload: object, path: Path) -> None:
    with open(path, "wb") as file:
        torch.save(payload, file)
        file.flush()
        os.fsync(file.fileno())


def bench_checkpoint(megabytes: int, repeats: int) -> None:
    width = 1024
    layers = megabytes * 2**20 // (4 * (width * width + width))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    state = elastic.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as scratch:
        plain = Path(scratch) / "plain.pt"
        checkpointer = elastic.Checkpointer(Path(scratch) / "checkpoints", keep=2)
        checkpointer.save(state)
        torch.save(state.state_dict(), plain)
        results = interleaved_medians(
            {
                "torch.save": lambda: torch.save(state.state_dict(), plain),
                "torch.save + fsync": lambda: fsynced_torch_save(state.state_dict(), plain),
                "Checkpointer.save": lambda: checkpointer.save(state),
                "torch.load": lambda: torch.load(plain, weights_only=True),
                "Checkpointer.load": lambda: checkpointer.load(state),
            },
            repeats,
        )
    print(f"model state {size:.0f} MiB, median of {repeats}: wall s, CPU s")
    for name, (wall, cpu) in results.items():
        print(f"{name:20s} {wall:.3f} {cpu:.3f}")
    for ours, plain_name in (
        ("Checkpointer.save", "torch.save"),
        ("Checkpointer.load", "torch.load"),
    ):
        wall = results[ours][0] / results[plain_name][0] - 1
        cpu = results[ours][1] / results[plain_name][1] - 1
        print(f"{ours} vs {plain_name}: wall {wall:+.0%}, CPU {cpu:+.0%}")


def bench_should_stop(calls: int) -> None:
    dist.init_process_group("gloo")
    elastic.should_stop(0)
    dist.barrier()
    start = time.perf_counter()
    for step in range(calls):
        elastic.should_stop(step)
    per_call = (time.perf_counter() - start) / calls
    if dist.get_rank() == 0:
        print(f"should_stop(): {per_call * 1e6:.0f} us per call, world {dist.get_world_size()}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--should-stop", action="store_true")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.should_stop:
        bench_should_stop(args.calls)
    else:
        bench_checkpoint(args.megabytes, args.repeats)


if __name__ == "__main__":
    main()
