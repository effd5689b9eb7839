"""Checkpoint cost against plain torch.save/torch.load, and the cost of one should_stop() call.

    python bench/checkpoint_bench.py                 # save/load of a ~100 MB model state
    torchrun --nproc-per-node=2 bench/checkpoint_bench.py --should-stop   # per-call agreement cost
    python bench/checkpoint_bench.py --stall         # training-step stall, checkpoint every 10
    torchrun --nproc-per-node=2 bench/checkpoint_bench.py --restore [--s3-endpoint URL]
                                                     # restore time per tier
    python bench/checkpoint_bench.py --loss-of-work  # steps redone per preemption, same overhead

The stall run trains the same model in one loop per mode (no checkpoints, synchronous,
asynchronous in a thread, and the same asynchronous copy handed to a worker process through
shared memory, and asynchronous with the node-local tier, writing the shared tier every 5th
save), taking turns between modes so the machine's load slows all of them alike. On one
machine the "local" and the "shared" tier are the same disk: the local tier's gain (node
disk against a parallel filesystem or S3) does not show there.

The restore run saves one checkpoint per repeat and times ``load`` from each tier: every rank
reading its own local copy, one rank's copy gone so that rank receives a peer's bytes over the
process group, the shared directory, and (with ``--s3-endpoint``, any S3-compatible server)
object storage. A restore lasts until the slowest rank has its state, so the time is the
maximum over ranks, between two barriers.

The loss-of-work run measures, per mode (synchronous, asynchronous, asynchronous with the
local tier), what one save stalls the loop (the stall loop's excess over no checkpoints,
divided by its saves) and how long its commit stays in flight (save, then wait), and computes
from them (``loss_of_work``, a pure rule) the checkpoint interval at which each mode costs the
same overhead (``--overhead``, 5 %), and the steps a preemption at a random moment redoes at
that interval.

Prints median seconds over ``--repeats`` runs; results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
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
from hpc_elastic.train import local_tier


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


def bench_model(megabytes: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, megabytes * 2**20 // (4 * (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> None:
    device = next(model.parameters()).device
    optimizer.zero_grad()
    model(torch.randn(batch, 1024, device=device)).square().mean().backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()  # a step ends when its kernels do, as with a loss.item()


def process_writer(buffers: dict[str, torch.Tensor], jobs: Any, done: Any) -> None:
    """The worker process: writes the shared-memory snapshot on request, fsynced."""
    torch.set_num_threads(1)
    while (path := jobs.get()) is not None:
        fsynced_torch_save(buffers, Path(path))
        done.put(path)


class ProcessSaver:
    """Asynchronous save through a process: copy into shared memory, a worker writes it.

    The best case for a process: the shared buffers are allocated once, so a save costs one
    copy on the training thread and nothing crosses the pipe but a file name.
    """

    def __init__(self, model: nn.Module, directory: Path) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.model = model
        self.buffers = {
            k: v.detach().to("cpu", copy=True).share_memory_()
            for k, v in model.state_dict().items()
        }
        self.jobs, self.done = context.Queue(), context.Queue()
        self.worker = context.Process(
            target=process_writer, args=(self.buffers, self.jobs, self.done)
        )
        self.worker.start()
        self.directory, self.in_flight = directory, False

    def save(self, step: int) -> None:
        self.wait()
        with torch.no_grad():
            for name, value in self.model.state_dict().items():
                self.buffers[name].copy_(value)
        self.jobs.put(str(self.directory / f"process-{step}.pt"))
        self.in_flight = True

    def wait(self) -> None:
        if self.in_flight:
            self.done.get()
            self.in_flight = False

    def close(self) -> None:
        self.wait()
        self.jobs.put(None)
        self.worker.join()


def bench_stall(
    megabytes: int, steps: int, every: int, repeats: int, *, device: str, batch: int
) -> None:
    """Seconds per training step in each mode; the stall is the excess over no checkpoints."""
    model, optimizer = bench_model(megabytes)
    model.to(device)
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as scratch:
        results = stall_loops(
            model,
            optimizer,
            Path(scratch),
            steps=steps,
            every=every,
            repeats=repeats,
            batch=batch,
        )
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    base = results["no checkpoints"][0]
    print(
        f"model state {size:.0f} MiB on {device}, batch {batch}, {steps} steps, checkpoint "
        f"every {every}, median of {repeats}"
    )
    print("mode                   s/step   stall   CPU s/step")
    for name, (wall, cpu) in results.items():
        print(f"{name:22s} {wall / steps:.4f} {wall / base - 1:+7.1%} {cpu / steps:.4f}")


def stall_loops(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scratch: Path,
    *,
    steps: int,
    every: int,
    repeats: int,
    batch: int,
) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of one loop of ``steps`` steps per mode, taking turns."""
    state = elastic.TrainState(model, optimizer)
    savers = product_savers(state, scratch)
    process = ProcessSaver(model, scratch)

    def loop(save: Callable[[], object] | None, finish: Callable[[], object]) -> None:
        for step in range(1, steps + 1):
            training_step(model, optimizer, batch)
            state.finish_step()
            if save is not None and step % every == 0:
                save()
        finish()

    modes: dict[str, Callable[[], object]] = {"no checkpoints": lambda: loop(None, lambda: None)}

    def saving(saver: elastic.Checkpointer) -> Callable[[], object]:
        return lambda: loop(lambda: saver.save(state), saver.wait)

    for name, saver in savers.items():
        modes[name] = saving(saver)
    modes["async, process"] = lambda: loop(lambda: process.save(state.step), process.wait)
    for action in modes.values():  # warm-up: first allocations, first files
        action()
    results = interleaved_medians(modes, repeats)
    process.close()
    return results


def product_savers(state: elastic.TrainState, scratch: Path) -> dict[str, elastic.Checkpointer]:
    """The product's modes; the local tier writes the shared one every 5th save."""
    return {
        "synchronous": elastic.Checkpointer(scratch / "sync", keep=2, round=None),
        "async, thread": elastic.Checkpointer(
            scratch / "async", keep=2, round=None, asynchronous=True
        ),
        "async, writer process": elastic.Checkpointer(
            scratch / "async-process", keep=2, round=None, asynchronous=True, writer="process"
        ),
        "async + local tier": elastic.Checkpointer(
            scratch / "shared",
            keep=2,
            round=None,
            asynchronous=True,
            local_directory=scratch / "local",
            persist_every=PERSIST_EVERY,
        ),
    }


PERSIST_EVERY = 5


def loss_of_work(
    stall: float, commit: float, step_time: float, overhead: float, persist_every: int = 1
) -> tuple[int, float, float]:
    """The interval (steps) at which saving costs ``overhead`` of the step time, and the mean
    steps a preemption at a random moment redoes then: ``(interval, kept, new_nodes)``.

    ``stall`` is what one save holds the loop up (seconds), ``commit`` how long it stays in
    flight after the loop goes on (0 for a synchronous save, whose commit is the stall).
    The interval must also let the commit end before the next save, or that save waits.
    A preemption lands anywhere in an interval, so it redoes half an interval on average,
    plus the in-flight commit: a checkpoint counts only once committed. ``kept``: the newest
    checkpoint's tier survives (local disk or a peer's copy); ``new_nodes``: a requeue on
    all-new nodes, which finds only the shared tier, written every ``persist_every`` saves.
    """
    interval = max(1, math.ceil(max(stall / (overhead * step_time), commit / step_time)))
    in_flight = commit / step_time
    return interval, interval / 2 + in_flight, persist_every * interval / 2 + in_flight


def save_timings(saver: elastic.Checkpointer, state: elastic.TrainState) -> tuple[float, float]:
    """(stall, in flight): seconds ``save`` holds the loop, then until its commit ends."""
    state.step += 1
    start = time.perf_counter()
    saver.save(state)
    returned = time.perf_counter()
    saver.wait()
    return returned - start, time.perf_counter() - returned


def bench_loss_of_work(
    megabytes: int, steps: int, repeats: int, *, device: str, batch: int, overhead: float
) -> None:
    """Each mode's measured stall per save and commit time, and the loss they imply.

    The stall is timed directly (``save`` until it returns), not as a loop's excess over a
    loop without checkpoints: on a loaded machine that difference is lost in the noise. So
    it leaves out what a background commit slows the loop down by (the ``--stall`` run shows
    that); the step time is the median of single steps, for the same reason.
    """
    model, optimizer = bench_model(megabytes)
    model.to(device)
    state = elastic.TrainState(model, optimizer)
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        training_step(model, optimizer, batch)
        step_times.append(time.perf_counter() - start)
    step_time = statistics.median(step_times)
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as scratch:
        savers = product_savers(state, Path(scratch))
        for saver in savers.values():  # warm-up: first allocations, first files
            save_timings(saver, state)
        timings: dict[str, list[tuple[float, float]]] = {name: [] for name in savers}
        for _ in range(repeats):
            for name, saver in savers.items():  # taking turns, as interleaved_medians
                training_step(model, optimizer, batch)
                timings[name].append(save_timings(saver, state))
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(
        f"model state {size:.0f} MiB on {device}, batch {batch}, {step_time:.4f} s/step "
        f"(median of {steps}); saves: median of {repeats}; overhead {overhead:.0%}"
    )
    print("mode                   stall/save  commit  interval  redone (kept)  redone (new nodes)")
    for name, values in timings.items():
        stall = statistics.median(value[0] for value in values)
        commit = statistics.median(value[1] for value in values)
        persist = PERSIST_EVERY if "local" in name else 1
        interval, kept, new_nodes = loss_of_work(stall, commit, step_time, overhead, persist)
        print(
            f"{name:22s} {stall:9.3f}s {commit:6.3f}s {interval:9d} {kept:14.1f} {new_nodes:19.1f}"
        )


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


def bench_restore(megabytes: int, repeats: int, s3_endpoint: str | None) -> None:
    """Median seconds to restore from each tier, slowest rank, on the ranks torchrun started."""
    dist.init_process_group("gloo")
    model, optimizer = bench_model(megabytes)
    state = elastic.TrainState(model, optimizer)
    first = dist.get_rank() == 0
    box: list[Any] = [tempfile.mkdtemp(dir=Path.cwd()) if first else None, time.time_ns()]
    dist.broadcast_object_list(box, src=0)  # one scratch directory and bucket for every rank
    scratch, bucket = Path(box[0]), f"restore-{box[1]}"
    tiered = elastic.Checkpointer(
        scratch / "shared", keep=1, round=None, local_directory=scratch / "local"
    )
    shared = elastic.Checkpointer(scratch / "shared", keep=1, round=None)

    def save_then_lose_rank_1_copy() -> None:
        tiered.save(state)
        if dist.get_rank() == 1:  # rank 1's node was replaced: its disk is empty
            shutil.rmtree(local_tier.rank_directory(scratch / "local"))

    tiers: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "local": (lambda: tiered.save(state), lambda: tiered.load(state)),
        "peer": (save_then_lose_rank_1_copy, lambda: tiered.load(state)),
        "shared": (lambda: shared.save(state), lambda: shared.load(state)),
    }
    if s3_endpoint is not None:
        tiers["S3"] = s3_tier(s3_endpoint, bucket, state)
    timings: dict[str, list[float]] = {name: [] for name in tiers}
    for _ in range(repeats):
        for name, (prepare, restore) in tiers.items():  # taking turns, as interleaved_medians
            state.step += 1
            prepare()
            timings[name].append(slowest_rank(restore))
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    if dist.get_rank() == 0:
        print(
            f"restore of a {size:.0f} MiB model state (and its optimizer), "
            f"world {dist.get_world_size()}, median of {repeats}, slowest rank"
        )
        for name, values in timings.items():
            print(f"{name:8s} {statistics.median(values):.3f} s")
        shutil.rmtree(scratch)
    dist.barrier()
    dist.destroy_process_group()


def s3_tier(
    endpoint: str, bucket: str, state: elastic.TrainState
) -> tuple[Callable[[], object], Callable[[], object]]:
    """Save and load against an S3-compatible server, with the credentials of a test server
    unless the environment has its own."""
    from hpc_elastic.train.storage import ObjectStore  # noqa: PLC0415 (only with --s3-endpoint)

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(name, value)
    if dist.get_rank() == 0:
        ObjectStore(f"s3://{bucket}").fs.mkdir(bucket)
    dist.barrier()
    checkpointer = elastic.Checkpointer.at(f"s3://{bucket}/run", keep=1)
    return (lambda: checkpointer.save(state), lambda: checkpointer.load(state))


def slowest_rank(action: Callable[[], object]) -> float:
    """Wall seconds of ``action`` on the slowest rank: a restore ends when every rank has it."""
    dist.barrier()
    start = time.perf_counter()
    action()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--should-stop", action="store_true")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--stall", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--restore", action="store_true")
    parser.add_argument("--s3-endpoint", default=None)
    parser.add_argument("--loss-of-work", action="store_true")
    parser.add_argument("--overhead", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.should_stop:
        bench_should_stop(args.calls)
    elif args.loss_of_work:
        bench_loss_of_work(
            args.megabytes,
            args.steps,
            args.repeats,
            device=args.device,
            batch=args.batch,
            overhead=args.overhead,
        )
    elif args.restore:
        bench_restore(args.megabytes, args.repeats, args.s3_endpoint)
    elif args.stall:
        bench_stall(
            args.megabytes,
            args.steps,
            args.every,
            args.repeats,
            device=args.device,
            batch=args.batch,
        )
    else:
        bench_checkpoint(args.megabytes, args.repeats)


if __name__ == "__main__":
    main()
