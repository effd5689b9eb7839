"""One tracker directory per run, continued across requeues: ``<logdir>/<HPC_ELASTIC_RUN_ID>``.

Every worker of an hpc-elastic job gets ``HPC_ELASTIC_RUN_ID``, the same in every round and
after every requeue, so a requeued job writes on into the same directory instead of starting a
new run at step 0. With TensorBoard installed the writer is one line::

    writer = torch.utils.tensorboard.SummaryWriter(run_directory(logdir))

and ``wandb.init()`` needs nothing at all: the agent sets ``WANDB_RUN_ID`` and
``WANDB_RESUME=allow`` unless you did. TensorBoard is not installed in this project's
environment, so this example writes the same scalars as JSON lines (rank 0 only), which a test
can read back.

    HPC_ELASTIC_RUN_ID=demo python examples/tracker_run.py tb-logs 10
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def run_directory(logdir: Path) -> Path:
    """``logdir/<run id>``: one per job, the same after a requeue; ``local`` outside a job."""
    return logdir / os.environ.get("HPC_ELASTIC_RUN_ID", "local")


def log_scalar(directory: Path, tag: str, value: float, step: int) -> None:
    """What ``SummaryWriter.add_scalar`` records, as one JSON line."""
    directory.mkdir(parents=True, exist_ok=True)
    line = {"tag": tag, "value": value, "step": step, "time": time.time()}
    with (directory / "scalars.jsonl").open("a") as scalars:
        scalars.write(json.dumps(line) + "\n")


def main(logdir: Path, steps: int, start: int = 0) -> None:
    if os.environ.get("RANK", "0") != "0":
        return  # one writer per run
    directory = run_directory(logdir)
    for step in range(start, steps):
        log_scalar(directory, "loss", 1.0 / (step + 1), step)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
