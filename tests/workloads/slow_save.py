"""A torch-free training script whose checkpoint saves are slow: it beats its heartbeat every
``--step-seconds`` and, every ``--every`` steps, marks the heartbeat as saving (as the training
helpers' ``saving()`` does), sleeps ``--save-seconds`` and writes the step back. Exits 0 after
``--steps`` steps, 75 at once on SIGUSR1/SIGUSR2/SIGTERM (no save: none is needed here).
With ``--hang-at-save=N`` the N-th save (from 1) never ends: a save that hangs."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def write(path: Path, text: str) -> None:
    """Replace the heartbeat atomically, as train/heartbeat.py does."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(text + "\n")
    os.replace(scratch, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--step-seconds", type=float, default=0.6)
    parser.add_argument("--save-seconds", type=float, default=8.0)
    parser.add_argument("--hang-at-save", type=int, default=0)
    args = parser.parse_args()
    for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(signum, lambda *_: sys.exit(75))
    heartbeat = Path(os.environ["HPC_ELASTIC_HEARTBEAT_FILE"])
    for step in range(1, args.steps + 1):
        time.sleep(args.step_seconds)
        write(heartbeat, str(step))
        if step % args.every == 0:
            write(heartbeat, f"{step} checkpoint")
            hangs = step // args.every == args.hang_at_save
            time.sleep(3600.0 if hangs else args.save_seconds)
            write(heartbeat, str(step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
