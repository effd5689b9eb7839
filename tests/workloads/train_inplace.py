"""A data-parallel training loop that recovers in place (``hpc_elastic.train.InPlace``).

A linear model with SGD and momentum; each step every rank computes the gradient of its own
batch (drawn from the step and the rank, so a run's arithmetic does not depend on which
process holds a rank), the gradients are summed with an all-reduce, then the optimizer steps:
the state changes only after the step's last collective, the contract of ``InPlace``.

Each rank appends ``<time> <step> <round> <rank> <world> <pid> <slot> <received>`` to
``<out>/trace`` after each step; rank 0 writes the final parameters, as hex, to
``<out>/final``; each process appends ``<time> <pid>`` to ``<out>/started`` when its script
begins. Tests and the benchmark read them.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_elastic import logs
from hpc_elastic.contract import SLOT_ENV
from hpc_elastic.train import InPlace
from hpc_elastic.train.heartbeat import Heartbeat


class State:
    """The model, its optimizer and the step: what a newcomer receives from a survivor."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 4)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def train_step(state: State) -> None:
    """One step; nothing of ``state`` changes before the all-reduce has returned."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = torch.Generator().manual_seed(state.step * 1000 + rank)
    inputs = torch.randn(16, 8, generator=batch)
    targets = torch.randn(16, 4, generator=batch)
    state.optimizer.zero_grad()
    torch.autograd.backward(torch.nn.functional.mse_loss(state.model(inputs), targets))
    for parameter in state.model.parameters():
        assert parameter.grad is not None
        dist.all_reduce(parameter.grad)
        parameter.grad /= world
    state.optimizer.step()
    state.step += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sleep", type=float, default=0.05)
    args = parser.parse_args()
    logs.configure_from_env()  # HPC_ELASTIC_LOG=debug shows InPlace's steps in the rank's log
    with (args.out / "started").open("a") as started:  # when each process reached its script
        started.write(f"{time.time():.6f} {os.getpid()}\n")
    state = State()
    # The agent's hang watch reads it, and its standbys refill once every rank beat: without
    # beats they would refill 30 s in, importing torch just when a restart needs the CPU.
    heartbeat = Heartbeat(min_interval=0.0)
    with InPlace(state, backend="gloo") as ip:
        # Nobody held a state: this is the first round, or every rank was restarted. A real
        # loop loads its checkpoint here; this one starts from its seed.
        received = ip.received
        while state.step < args.steps:
            before = state.step
            with ip.step():
                received = received or ip.received  # a newcomer learns it at its first boundary
                train_step(state)
            if state.step == before:
                continue  # a peer died in the step: the group re-formed, run the step again
            with (args.out / "trace").open("a") as trace:
                trace.write(
                    f"{time.time():.6f} {state.step} {ip.round} {dist.get_rank()} "
                    f"{dist.get_world_size()} {os.getpid()} {os.environ.get(SLOT_ENV, '')} "
                    f"{int(received)}\n"
                )
            heartbeat.beat(state.step)
            time.sleep(args.sleep)
        heartbeat.finish()  # the barrier and the teardown are not training: do not time them
        if dist.get_rank() == 0:
            flat = torch.cat([p.detach().reshape(-1) for p in state.model.parameters()])
            (args.out / "final").write_text(flat.numpy().tobytes().hex())
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
