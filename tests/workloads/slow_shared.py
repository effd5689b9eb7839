"""A training loop with the real helpers whose shared checkpoint tier is slow: every write to
the job's checkpoint directory takes ``--shared-seconds`` longer (a parallel file system under
load), while the node-local tier (``--local-checkpoint-dir``) stays fast. Saves every
``--every`` steps and at a stop; each rank appends ``start=STEP`` to ``--log-file`` when it has
loaded, so a test reads where every incarnation resumed. For ``--grace-action local``."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hpc_elastic.train as elastic
from hpc_elastic import contract
from hpc_elastic.train.checkpoint import Checkpointer

SHARED_SECONDS = [0.0]
"""Set from ``--shared-seconds``: a frozen dataclass cannot carry it as a field of its own."""


class SlowShared(Checkpointer):
    """Shared-tier writes take ``SHARED_SECONDS`` longer. The local tier's writes go through
    a plain ``Checkpointer`` (``_local``), so they stay as fast as the disk."""

    def _write_payload(self, payload: dict[str, Any], step: int) -> Path:
        time.sleep(SHARED_SECONDS[0])
        return super()._write_payload(payload, step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=0.3)
    parser.add_argument("--shared-seconds", type=float, default=8.0)
    parser.add_argument("--log-file", type=Path, required=True)
    args = parser.parse_args()
    SHARED_SECONDS[0] = args.shared_seconds
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    state = elastic.TrainState(model)
    saver = SlowShared(Path(os.environ[contract.CHECKPOINT_DIR_ENV]))
    saver.load(state)
    with args.log_file.open("a") as log:
        log.write(f"start={state.step} rank={rank}\n")
    while state.step < args.steps:
        time.sleep(args.step_seconds)
        with torch.no_grad():
            model.weight.fill_(float(state.step + 1))
        state.finish_step()
        stop = elastic.should_stop(state.step)
        if state.step == args.steps:
            elastic.finish()
        if stop or state.step % args.every == 0:
            saver.save(state)
        if stop:
            elastic.exit_preempted()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
