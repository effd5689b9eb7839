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

``--recovery`` measures instead what the ensemble costs a job's recovery: the worker SIGKILL
and node (agent) SIGKILL rows of bench/agent_bench.py (4 agents x 1 worker on this machine,
its gloo workload and probes, ``--prewarm torch`` as ``submit`` does by default), each
against the dev cluster's own standalone ZooKeeper (its env.sh) and against an ensemble that
``zk start`` starts for the run, side by side in one table::

    python bench/zk_start_bench.py --state-dir /tmp/dc --recovery --servers 3 --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


RECOVERY_ROWS = 2
"""agent_bench's first scenarios: worker SIGKILL (all 4 ranks), node SIGKILL (3 of 4 nodes)."""


def dev_cluster_zk(state_dir: Path) -> str:
    """The dev cluster's own ZooKeeper (its env.sh's ``HPC_ELASTIC_ZK``)."""
    for line in (state_dir / "env.sh").read_text().splitlines():
        if line.startswith("export HPC_ELASTIC_ZK="):
            return line.split("=", 1)[1].strip()
    raise SystemExit(f"{state_dir / 'env.sh'} names no HPC_ELASTIC_ZK; run dev-cluster up again")


def start_ensemble(env: dict[str, str], partition: str, servers: int) -> str:
    """``zk start``; its connect string."""
    argv = [sys.executable, "-m", "hpc_elastic", "zk"]
    started = subprocess.run(
        [*argv, "start", "--servers", str(servers), "--partition", partition],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if started.returncode != 0:
        raise SystemExit(f"zk start failed: {started.stderr}")
    shown = subprocess.run(
        [*argv, "status", "--json"], env=env, capture_output=True, text=True, check=True
    )
    return str(json.loads(shown.stdout)["connect"])


def launch(out: Path, *, bench: Any, zk: str, nodes: str, count: int, prewarm: bool) -> Any:
    """agent_bench's agents (its ``ours``) on ``zk``, writing to ``out``."""
    return bench.ours(zk, nodes, out, prewarm=prewarm, count=count)


def recovery(arguments: argparse.Namespace) -> None:
    """The two columns of agent_bench's recovery rows (module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import agent_bench  # noqa: PLC0415 (a sibling script, found through sys.path)

    with tempfile.TemporaryDirectory(prefix="zk-start-bench-") as scratch:
        env = cluster_env(arguments.state_dir, Path(scratch) / "state")
        try:
            connect = start_ensemble(env, arguments.partition, arguments.servers)
            columns = {
                "the dev cluster's ZooKeeper (1 server)": dev_cluster_zk(arguments.state_dir),
                f"zk start ensemble ({arguments.servers} servers)": connect,
            }
            rows = []
            for scenario, nodes, count, probe in agent_bench.SCENARIOS[:RECOVERY_ROWS]:
                cells = []
                for column, zk in columns.items():
                    print(f"{scenario}: {column} at {zk}", flush=True)
                    start = functools.partial(
                        launch,
                        bench=agent_bench,
                        zk=zk,
                        nodes=nodes,
                        count=count,
                        prewarm=arguments.prewarm,
                    )
                    results = [
                        agent_bench.measure(f"try {n + 1}", start, probe, arguments.give_up)
                        for n in range(arguments.repeats)
                    ]
                    cells.append(agent_bench.cell(results))
                rows.append(f"| {scenario} | {' | '.join(cells)} |")
        finally:
            subprocess.run(
                [sys.executable, "-m", "hpc_elastic", "zk", "stop", "--force"],
                env=env,
                capture_output=True,
                check=False,
            )
    print(f"| scenario | {' | '.join(columns)} |")
    print(f"|---|{'---|' * len(columns)}")
    print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, required=True, help="the dev cluster's")
    parser.add_argument("--partition", default="service")
    parser.add_argument("--servers", type=int, default=3, choices=(1, 3, 5))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--recovery",
        action="store_true",
        help="A job's recovery on a zk start ensemble beside the dev cluster's ZooKeeper.",
    )
    parser.add_argument("--repeats", type=int, default=3, help="With --recovery: tries a cell.")
    parser.add_argument("--give-up", type=float, default=60.0, help="With --recovery.")
    parser.add_argument(
        "--prewarm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --recovery: the agents' --prewarm torch (submit's default).",
    )
    arguments = parser.parse_args()
    if arguments.recovery:
        recovery(arguments)
        return
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
