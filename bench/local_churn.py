"""Local mode under churn: how fast the embedded rendezvous re-forms after a node is killed or
comes back. Runs ``hpc-elastic run`` with a torch-free stepper and reads its events.

    .venv/bin/python bench/local_churn.py [--seconds 60]

Prints, for kills and for additions, the delay from the churn event to the next completed
round (median, min, max). Results go to docs/benchmarks.md, never into tests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STEPPER = """\
import os, time
from hpc_elastic.train.heartbeat import write
step = 0
while True:
    time.sleep(0.05)
    step += 1
    write(os.environ["HPC_ELASTIC_HEARTBEAT_FILE"], step)
"""


def delays(events: list[dict[str, object]], action: str) -> list[float]:
    """Seconds from each churn ``action`` to the first round event after it."""
    found = []
    rounds = [float(str(e["time"])) for e in events if e["kind"] == "round"]
    for event in events:
        details = event.get("details")
        if event["kind"] == "churn" and isinstance(details, dict) and details["action"] == action:
            at = float(str(event["time"]))
            later = [time for time in rounds if time > at]
            if later:
                found.append(later[0] - at)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        (work / "stepper.py").write_text(STEPPER)
        command = [
            sys.executable,
            "-m",
            "hpc_elastic",
            "run",
            "--nodes=2:3",
            "--simulate-churn",
            "--churn-every=4:6",
            "--churn-downtime=2",
            "stepper.py",
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        run = subprocess.Popen(command, cwd=work, env=env, stderr=subprocess.DEVNULL)
        time.sleep(args.seconds)
        run.send_signal(signal.SIGINT)
        run.wait(60)
        events_file = next(work.glob("hpc-elastic-runs/*/events.jsonl"))
        events = [json.loads(line) for line in events_file.read_text().splitlines()]
    for action in ("kill", "add"):
        found = delays(events, action)
        if found:
            print(
                f"{action}: {len(found)} events, next round after median "
                f"{statistics.median(found):.2f} s (min {min(found):.2f}, max {max(found):.2f})"
            )


if __name__ == "__main__":
    main()
