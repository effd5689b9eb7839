"""``hpc-elastic zk start`` on the local Slurm cluster: the command -> an ensemble that serves.

Each run starts an ensemble through the real CLI, in a state directory of its own, and times:

* ``queued``: ``zk start`` called -> sbatch answered (the line ``Submitted Slurm job``);
* ``serving``: ``zk start`` called -> it returned, i.e. the servers picked and published their
  ports, found each other, elected a leader and wrote the connect-string file;
* ``stop``: ``zk stop`` called -> it returned, with every server stopped, the job gone from
  the queue and nothing left.

The queue wait is part of ``serving``: run it on an idle partition (the dev cluster's
``service`` partition, ``scripts/dev-cluster up --service-nodes 3``) to see the ensemble's own
start. Each run prints one JSON line; the last line is the summary (min, median, max).

Usage::

    scripts/dev-cluster --state-dir /tmp/dc --service-nodes 3 up
    python bench/zk_start_bench.py --state-dir /tmp/dc --partition service --servers 3 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cluster_env(state_dir: Path, zk_state: Path) -> dict[str, str]:
    """The dev cluster's environment (its env.sh), a private hpc-elastic state directory and
    no ZooKeeper named anywhere."""
    exported = dict(
        line.removeprefix("export ").split("=", 1)
        for line in (state_dir / "env.sh").read_text().splitlines()
        if line.startswith("export ")
    )
    env = {**os.environ, "SLURM_CONF": exported["SLURM_CONF"], "PYTHONPATH": str(REPO)}
    env["HPC_ELASTIC_STATE_DIR"] = str(zk_state)
    env.pop("HPC_ELASTIC_ZK", None)
    return env


def one_run(env: dict[str, str], partition: str, servers: int) -> dict[str, float]:
    argv = [sys.executable, "-m", "hpc_elastic", "zk"]
    start = time.monotonic()
    process = subprocess.Popen(
        [*argv, "start", "--servers", str(servers), "--partition", partition],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    queued = None
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("Submitted Slurm job") and queued is None:
            queued = time.monotonic() - start
    process.wait()
    serving = time.monotonic() - start
    if process.returncode != 0:
        raise SystemExit(f"zk start failed: {process.stderr.read() if process.stderr else ''}")
    stop_start = time.monotonic()
    stopped = subprocess.run(
        [*argv, "stop", "--force"], env=env, capture_output=True, text=True, check=False
    )
    if stopped.returncode != 0:
        raise SystemExit(f"zk stop failed: {stopped.stderr}")
    return {
        "queued_s": round(queued or 0.0, 3),
        "serving_s": round(serving, 3),
        "stop_s": round(time.monotonic() - stop_start, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, required=True, help="the dev cluster's")
    parser.add_argument("--partition", default="service")
    parser.add_argument("--servers", type=int, default=3, choices=(1, 3, 5))
    parser.add_argument("--runs", type=int, default=5)
    arguments = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="zk-start-bench-") as scratch:
        for run in range(arguments.runs):
            env = cluster_env(arguments.state_dir, Path(scratch) / f"state-{run}")
            result = one_run(env, arguments.partition, arguments.servers)
            results.append(result)
            print(json.dumps({"run": run, "servers": arguments.servers, **result}), flush=True)
    summary = {
        key: {
            "min": min(result[key] for result in results),
            "median": statistics.median(result[key] for result in results),
            "max": max(result[key] for result in results),
        }
        for key in ("queued_s", "serving_s", "stop_s")
    }
    print(json.dumps({"servers": arguments.servers, "runs": arguments.runs, **summary}))


if __name__ == "__main__":
    main()
