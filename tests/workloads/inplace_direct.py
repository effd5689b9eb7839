"""``InPlace`` without an agent: the test writes the assignment files (tests/agent/test_inplace.py).

``--scenario blocked`` (3 ranks): rank 2 exits; in the next step rank 1 receives from it (that
fails at once, the peer's connection is closed) while rank 0 receives from rank 1, a live peer
that has just abandoned the step. Rank 0 must not stay blocked until the collective timeout:
once rank 1 leaves its broken group, rank 0's receive fails too, and both take up round 2.

``--scenario checkpoint`` (2 ranks): a ``Checkpointer`` built in round 1 saves step 1; the
test hands round 2 with the ranks swapped; the same checkpointer saves step 2, which must be
fenced by round 2 and written by round 2's rank 0 (round 1's rank 1).

Each process appends JSON lines ``{"event": ..., "pid": ..., "rank": ..., "round": ...}`` to
``<out>/log_<pid>``; the test waits for them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_elastic.train import Checkpointer, InPlace, TrainState

COLLECTIVE_TIMEOUT = 600.0
"""The old group's collective timeout: far beyond the test's deadline, so a rank that stays
blocked on its live peer fails the test rather than recovering on the timeout."""


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def note(out: Path, event: str, ip: InPlace, **more: object) -> None:
    record = {"event": event, "pid": os.getpid(), "rank": dist.get_rank(), "round": ip.round}
    with (out / f"log_{os.getpid()}").open("a") as log:
        log.write(json.dumps({**record, **more}) + "\n")


def blocked(out: Path) -> None:
    counter = Counter()
    with InPlace(counter, backend="gloo", init_timeout=COLLECTIVE_TIMEOUT) as ip:
        dist.barrier()
        if dist.get_rank() == 2:
            os._exit(0)  # the node that leaves
        while ip.round == 1:
            with ip.step():
                if ip.round != 1:
                    break  # the boundary took up round 2
                buffer = torch.zeros(1)
                try:
                    dist.recv(buffer, src=dist.get_rank() + 1)  # rank 1 from 2, rank 0 from 1
                except RuntimeError as error:
                    note(out, "failed", ip, error=str(error)[:200])
                    raise
        with ip.step():
            total = torch.ones(1)
            dist.all_reduce(total)  # the new group works
        note(out, "reformed", ip, world=dist.get_world_size(), total=float(total.item()))
    dist.destroy_process_group()


def checkpoint(out: Path) -> None:
    model = torch.nn.Linear(2, 2)
    state = TrainState(model)
    ckpt = Checkpointer(out / "checkpoints")  # built once, in round 1
    with InPlace(state, backend="gloo") as ip:
        state.finish_step()
        written = ckpt.save(state)
        note(out, "saved", ip, step=state.step, path=str(written))
        while ip.round == 1:
            with ip.step():
                time.sleep(0.05)  # nothing to compute: wait at the step boundary for round 2
        state.finish_step()
        written = ckpt.save(state)
        note(out, "saved", ip, step=state.step, path=str(written), world=dist.get_world_size())
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", choices=("blocked", "checkpoint"), required=True)
    args = parser.parse_args()
    {"blocked": blocked, "checkpoint": checkpoint}[args.scenario](args.out)


if __name__ == "__main__":
    main()
