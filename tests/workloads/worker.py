"""A torch-free stand-in for a training script: fast to start, scripted by environment variables.

FAKE_WORKER_OUT      directory: each rank writes ``env_<round>_<rank>.json`` there at start
FAKE_WORKER_SECONDS  how long to "train" (default 0.5), beating the heartbeat every 0.1 s
FAKE_WORKER_FAIL     "<round>:<rank>:<code>[:<seconds>]": that rank of that round exits with that
                     code (after that many seconds, default at once)
FAKE_WORKER_STOP     "<round>:<rank>": that rank of that round stops beating (a hang)
FAKE_WORKER_SAVE_SECONDS  how long the step boundary takes to come (default 0.5); when set,
                     SIGTERM saves too and the save checks the agent's lease first, as the
                     training helpers' ``should_stop`` and ``save`` do
On SIGUSR1/SIGUSR2/SIGINT it "saves" (writes ``saved_<rank>``) and exits 75; it counts the stop
signals it got in ``signals_<rank>`` (a second SIGINT would make torch code raise mid-save).
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
signals = 0


def on_signal(signum: int, frame: FrameType | None) -> None:
    global stop, signals  # noqa: PLW0603
    stop = True
    signals += 1


def lease_stale(env: os._Environ[str]) -> bool:
    """The training helpers' lease rule (``hpc_elastic.train.lease``) in the standard library
    only: a worker that imported hpc-elastic would no longer be a script that never imports
    torch (tests/agent/test_standby.py)."""
    path, timeout = env.get("HPC_ELASTIC_LEASE_FILE"), env.get("HPC_ELASTIC_LEASE_TIMEOUT")
    if not path or not timeout:
        return False
    try:
        return time.time() - os.stat(path).st_mtime > float(timeout)
    except FileNotFoundError:
        return True


def matches(spec: str, round_: str, rank: str) -> list[str] | None:
    parts = spec.split(":")
    return parts[2:] if parts[:2] == [round_, rank] else None


def main() -> int:
    env = os.environ
    saving = env.get("FAKE_WORKER_SAVE_SECONDS")
    stops = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
    for signum in (*stops, signal.SIGTERM) if saving else stops:
        signal.signal(signum, on_signal)
    rank, round_ = env["RANK"], env["HPC_ELASTIC_ROUND"]
    out = Path(env["FAKE_WORKER_OUT"])
    # Written aside, then renamed: the tests poll for this file, and a reader that found it
    # half written read '' and failed with a JSONDecodeError (seen in test_agent.py).
    written = out / f"env_{round_}_{rank}.json"
    (out / f"{written.name}.tmp").write_text(json.dumps(dict(env)))
    (out / f"{written.name}.tmp").replace(written)
    print(f"rank {rank} of {env['WORLD_SIZE']} starting round {round_}", flush=True)
    fail = matches(env.get("FAKE_WORKER_FAIL", ""), round_, rank)
    if fail is not None:
        time.sleep(float(fail[1]) if len(fail) > 1 else 0.0)  # fail after that much "work"
        print(f"Traceback (most recent call last):\nValueError: rank {rank} fails", file=sys.stderr)
        return int(fail[0])
    hang = matches(env.get("FAKE_WORKER_STOP", ""), round_, rank) is not None
    heartbeat = Path(env["HPC_ELASTIC_HEARTBEAT_FILE"])
    deadline = time.monotonic() + float(env.get("FAKE_WORKER_SECONDS", "0.5"))
    step = 0
    while time.monotonic() < deadline:
        if stop:
            # Long enough for a second, wrongly forwarded signal to arrive.
            time.sleep(float(saving or "0.5"))
            if saving and lease_stale(env):
                return 77  # FENCED_EXIT_CODE, before the save, as ``should_stop`` does
            (out / f"signals_{rank}").write_text(str(signals))
            (out / f"saved_{rank}").write_text(str(step))
            return 75
        if not hang or step == 0:
            heartbeat.write_text(str(step))
        step += 1
        time.sleep(0.1)  # a step's work
    return 0


if __name__ == "__main__":
    sys.exit(main())
