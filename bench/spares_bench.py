"""Hot spares on the local Slurm cluster: a crashed node -> first step at full size again.

One job of examples/train.py per mode (2 workers per node, ``--nodes 1:2``, session 2 s):

* ``spare``: ``--spares 1``, an array of three tasks: two train, the third's agent waits beside
  the full round with its standby workers warm;
* ``requeue``: no spare: the crashed slot comes back through Slurm (the node is declared down
  after ``SlurmdTimeout``, the task is requeued, waits ``cred_expire + 1 s`` and starts on a
  free node).

Once the job has trained at full size (world 4) for ``--settle`` seconds, the node of one
training slot crashes (``scripts/dev-cluster node-kill``: its slurmd, step daemons and tasks are
SIGKILLed at once). Measured: the crash -> rank 0's first step in a round at full size formed
after the crash (step lines stamped by this script as it sees them), and how long the job
trained at half size meanwhile. Then the job is cancelled and the node brought back.

Usage::

    scripts/dev-cluster --state-dir /tmp/dc up
    python bench/spares_bench.py --state-dir /tmp/dc [--mode spare --mode requeue]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic_bench import StepClock  # noqa: E402 (bench/ is on the path: run as a script)

from hpc_elastic import events  # noqa: E402
from hpc_elastic.ops import phases  # noqa: E402

TRAIN = REPO / "examples" / "train.py"
FULL = 4
"""World size at full size: 2 nodes x 2 workers."""


def cluster_env(state_dir: Path) -> dict[str, str]:
    lines = (state_dir / "env.sh").read_text().splitlines()
    exported = dict(line[7:].split("=", 1) for line in lines if line.startswith("export "))
    return {**os.environ, **exported, "PATH": f"{os.environ['PATH']}:/usr/sbin"}


def wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def rounds_after(job_dir: Path, since: float) -> list[tuple[float, int, list[str]]]:
    """(time, world size, member slots) of each round first seen after ``since``."""
    seen: dict[int, tuple[float, int, list[str]]] = {}
    for event in events.read(job_dir / "events.jsonl"):
        if event.kind == "round" and event.round is not None and event.round not in seen:
            members = [str(member) for member in event.details["members"]]
            seen[event.round] = (event.time, int(event.details["world_size"]), members)
    return [seen[number] for number in sorted(seen) if seen[number][0] > since]


def run(mode: str, args: argparse.Namespace) -> dict[str, object]:
    env = cluster_env(args.state_dir)
    work = Path(tempfile.mkdtemp(prefix=f"spares-bench-{mode}-"))
    log = work / "steps.log"
    dev_cluster = [str(REPO / "scripts" / "dev-cluster"), "--state-dir", str(args.state_dir)]
    submitted = subprocess.run(
        [
            sys.executable, "-m", "hpc_elastic", "submit", "--nodes=1:2",
            *(["--spares=1"] if mode == "spare" else []),
            "--nproc-per-node=2", "--partition=low", f"--zk={env['HPC_ELASTIC_ZK']}",
            "--session-timeout=2", "--last-call=2", "--signal=USR2@15",
            str(TRAIN), "--", "--steps=100000", "--checkpoint-every=5",
            "--sleep-per-step=0.2", f"--log-file={log}",
        ],
        cwd=work, env={**env, "PYTHONPATH": str(REPO)}, check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    job = re.search(r"Submitted batch job (\d+)", submitted)
    job_dir = re.search(r"Job directory: (\S+)", submitted)
    assert job is not None, submitted
    assert job_dir is not None, submitted
    directory = Path(job_dir.group(1))
    clock = StepClock(log)
    result: dict[str, object] = {"mode": mode, "job": job.group(1)}
    lost = ""
    try:

        def settled() -> bool:
            full = [t for t, _, world in clock.rows if world == FULL]
            return bool(full) and time.time() - full[0] > args.settle

        if not wait(settled, args.give_up):
            result["error"] = "never trained at full size"
            return result
        members = rounds_after(directory, 0.0)[-1][2]
        task = f"{job.group(1)}_{members[-1]}"
        lost = subprocess.run(
            ["squeue", "-h", "-j", task, "-o", "%N"], env=env, check=True, capture_output=True,
            text=True,
        ).stdout.strip()  # fmt: skip
        crashed = time.time()
        subprocess.run([*dev_cluster, "node-kill", lost], check=True, capture_output=True)

        def back_at_full_size() -> float | None:
            full = [t for t, world, _ in rounds_after(directory, crashed) if world == FULL]
            if not full:
                return None
            return next((t for t, _, world in clock.rows if world == FULL and t > full[0]), None)

        if not wait(lambda: back_at_full_size() is not None, args.give_up):
            result["error"] = f"not back at full size within {args.give_up:g} s"
            return result
        back = back_at_full_size()
        assert back is not None
        half = [t for t, _, world in clock.rows if crashed < t < back and world != FULL]
        result.update(
            crashed_node=lost,
            to_full_size_s=round(back - crashed, 1),
            steps_at_half_size=len(half),
            rounds=[(round(t - crashed, 1), world, slots) for t, world, slots in
                    rounds_after(directory, crashed)],
        )  # fmt: skip
        return result
    finally:
        clock.stop()
        subprocess.run(
            [sys.executable, "-m", "hpc_elastic", "cancel", job.group(1), "--log-dir",
             str(directory.parent)],
            cwd=work, env={**env, "PYTHONPATH": str(REPO)}, check=False, capture_output=True,
        )  # fmt: skip
        if lost:
            subprocess.run([*dev_cluster, "up"], check=False, capture_output=True)
        # Where the seconds went: the restart timeline (hpc-elastic events --phases).
        timeline = phases.table(phases.restarts(events.read(directory / "events.jsonl")))
        print("\n".join(f"    {row}" for row in timeline), file=sys.stderr, flush=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, required=True, help="a dev-cluster state dir")
    parser.add_argument("--mode", choices=("spare", "requeue"), action="append")
    parser.add_argument("--settle", type=float, default=20.0)
    parser.add_argument("--give-up", type=float, default=300.0)
    args = parser.parse_args()
    for mode in args.mode or ("spare", "requeue"):
        print(json.dumps(run(mode, args)), flush=True)


if __name__ == "__main__":
    main()
