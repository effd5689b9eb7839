"""A torch-free stand-in for a training script: fast to start, scripted by environment variables.

FAKE_WORKER_OUT      directory: each rank writes ``env_<round>_<rank>.json`` there at start
FAKE_WORKER_SECONDS  how long to "train" (default 0.5), beating the heartbeat every 0.1 s
FAKE_WORKER_FAIL     "<round>:<rank>:<code>": that rank of that round exits with that code
FAKE_WORKER_STOP     "<round>:<rank>": that rank of that round stops beating (a hang)
On SIGUSR1/SIGUSR2 it "saves" (writes ``saved_<rank>``) and exits 75.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

stop = False


def on_signal(signum: int, frame: FrameType | None) -> None:
    global stop  # noqa: PLW0603
    stop = True


def matches(spec: str, round_: str, rank: str) -> list[str] | None:
    parts = spec.split(":")
    return parts[2:] if parts[:2] == [round_, rank] else None


def main() -> int:
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, on_signal)
    env = os.environ
    rank, round_ = env["RANK"], env["HPC_ELASTIC_ROUND"]
    out = Path(env["FAKE_WORKER_OUT"])
    (out / f"env_{round_}_{rank}.json").write_text(json.dumps(dict(env)))
    print(f"rank {rank} of {env['WORLD_SIZE']} starting round {round_}", flush=True)
    fail = matches(env.get("FAKE_WORKER_FAIL", ""), round_, rank)
    if fail is not None:
        print(f"Traceback (most recent call last):\nValueError: rank {rank} fails", file=sys.stderr)
        return int(fail[0])
    hang = matches(env.get("FAKE_WORKER_STOP", ""), round_, rank) is not None
    heartbeat = Path(env["HPC_ELASTIC_HEARTBEAT_FILE"])
    deadline = time.monotonic() + float(env.get("FAKE_WORKER_SECONDS", "0.5"))
    step = 0
    while time.monotonic() < deadline:
        if stop:
            (out / f"saved_{rank}").write_text(str(step))
            return 75
        if not hang or step == 0:
            heartbeat.write_text(str(step))
        step += 1
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
