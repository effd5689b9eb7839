"""Elastic vs plain on Slurm: one scenario of busy nodes and a preemption, on the local cluster.

The same events, at the same seconds after submission, for both modes:

* t=0: three of the four nodes are busy (a ``high`` job); the job is submitted;
* t=``--release``: that job ends;
* t=``--preempt``: a ``high`` job takes two nodes for ``--high-for`` seconds;
* the job trains ``--steps`` steps of examples/train.py (2 workers per node) to the end.

``elastic`` is ``hpc-elastic submit --nodes 1:4``; ``plain`` is one ``sbatch -N4`` running
torchrun on every node (c10d rendezvous), which waits for all four nodes and is killed and
requeued whole on preemption. Measured (rank 0's step lines, timestamped by this script):

* grow: a slot's agent joining (Slurm started it) -> first step at the larger world size;
* shrink: the preemption (high job submitted; Slurm signals at once) -> first step at the
  smaller world size;
* goodput: seconds spent on steps that were kept (a step redone after a rollback counts once,
  its last run) / wall time from submission to the last step.

Usage::

    scripts/dev-cluster --state-dir /tmp/dc up
    python bench/elastic_bench.py --state-dir /tmp/dc --mode elastic
    python bench/elastic_bench.py --state-dir /tmp/dc --mode plain
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpc_elastic import events  # noqa: E402

TRAIN = REPO / "examples" / "train.py"
STEP = re.compile(r"^step=(\d+) .* world=(\d+)$")

PLAIN_SCRIPT = """#!/bin/bash
#SBATCH --partition=low
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --signal=B:USR1@15
#SBATCH --output={out}/slurm-%j.out
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1
# submitit's way: on the warning signal, requeue the whole job (a job that merely exits during
# GraceTime is not requeued by PreemptMode=REQUEUE).
trap 'scontrol requeue "$SLURM_JOB_ID"' USR1
srun {python} -m torch.distributed.run --nnodes=4 --nproc-per-node=2 \\
  --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{port} \\
  --rdzv-id="$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}" \\
  {train} {args} &
wait
wait
"""


def slurm(env: dict[str, str], *argv: str) -> str:
    return subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout


class StepClock:
    """Tails rank 0's step log and stamps each line with the time this script saw it."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.rows: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tail, daemon=True)
        self._thread.start()

    def _tail(self) -> None:
        offset = 0
        while not self._stop.wait(0.05):
            if not self.log.exists():
                continue
            with open(self.log) as file:
                file.seek(offset)
                chunk = file.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offset += len(complete)
            now = time.time()
            for line in complete.splitlines():
                match = STEP.match(line)
                if match:
                    self.rows.append((now, int(match.group(1)), int(match.group(2))))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def goodput(rows: list[tuple[float, int, int]], start: float) -> float:
    """Kept training seconds / wall seconds; a step's credit is the gap to the step before."""
    credit: dict[int, float] = {}
    for (t0, s0, _), (t1, s1, _) in itertools.pairwise(rows):
        if s1 <= s0:
            credit = {step: seconds for step, seconds in credit.items() if step < s1}
        elif s1 == s0 + 1 and t1 - t0 < 10:
            credit[s1] = t1 - t0
    return sum(credit.values()) / (rows[-1][0] - start)


def _found(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    if match is None:
        raise SystemExit(f"submit printed no match for {pattern!r}: {text}")
    return match.group(1)


def first_step_at(rows: list[tuple[float, int, int]], world: int, after: float) -> float | None:
    return next((t for t, _, w in rows if w == world and t > after), None)


def run(args: argparse.Namespace) -> dict[str, object]:
    env_lines = (args.state_dir / "env.sh").read_text().splitlines()
    exported = dict(line[7:].split("=", 1) for line in env_lines if line.startswith("export "))
    env = {**os.environ, **exported, "PATH": f"{os.environ['PATH']}:/usr/sbin"}
    work = Path(tempfile.mkdtemp(prefix=f"elastic-bench-{args.mode}-"))
    log = work / "steps.log"
    train_args = [
        f"--steps={args.steps}",
        "--checkpoint-every=5",
        f"--sleep-per-step={args.sleep_per_step}",
        f"--log-file={log}",
    ]
    holder = slurm(
        env,
        "sbatch",
        "--parsable",
        "-p",
        "high",
        "-N3",
        "-o",
        "/dev/null",
        "--wrap=srun sleep 3600",
    ).strip()
    while "RUNNING" not in slurm(env, "squeue", "-h", "-j", holder, "-o", "%T"):
        time.sleep(0.2)
    clock = StepClock(log)
    start = time.time()
    if args.mode == "elastic":
        submitted = subprocess.run(
            [
                sys.executable,
                "-m",
                "hpc_elastic",
                "submit",
                "--nodes=1:4",
                "--nproc-per-node=2",
                "--partition=low",
                f"--zk={exported['HPC_ELASTIC_ZK']}",
                "--last-call=2",
                "--signal=USR2@15",
                str(TRAIN),
                "--",
                *train_args,
            ],
            cwd=work,
            env={**env, "PYTHONPATH": str(REPO)},
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        job = _found(r"Submitted batch job (\d+)", submitted)
        job_dir = Path(_found(r"Job directory: (\S+)", submitted))
    else:
        script = PLAIN_SCRIPT.format(
            out=work,
            python=sys.executable,
            port=29500 + os.getpid() % 1000,
            train=TRAIN,
            args=" ".join([*train_args, f"--checkpoint-dir={work}/checkpoints"]),
        )
        job = subprocess.run(
            ["sbatch", "--parsable"],
            input=script,
            env={**env, "PYTHONPATH": str(REPO)},
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        job_dir = None
    time.sleep(max(0.0, start + args.release - time.time()))
    slurm(env, "scancel", holder)
    time.sleep(max(0.0, start + args.preempt - time.time()))
    preempted_at = time.time()
    slurm(
        env, "sbatch", "-p", "high", "-N2", "-o", "/dev/null", f"--wrap=srun sleep {args.high_for}"
    )
    deadline = time.time() + args.give_up
    while slurm(env, "squeue", "-h", "-o", "%i") and time.time() < deadline:
        time.sleep(1)
    clock.stop()
    left = slurm(env, "squeue", "-h", "-o", "%i")
    if left:
        slurm(env, "scancel", "--user", str(os.getuid()))
    rows = clock.rows
    result: dict[str, object] = {
        "mode": args.mode,
        "job": job,
        "finished": bool(rows) and rows[-1][1] == args.steps and not left,
        "wall_s": round(rows[-1][0] - start, 1) if rows else None,
        "goodput": round(goodput(rows, start), 3) if len(rows) > 1 else 0.0,
        "first_step_s": round(rows[0][0] - start, 1) if rows else None,
    }
    smaller = first_step_at(rows, 4, preempted_at)
    result["shrink_s"] = round(smaller - preempted_at, 1) if smaller else None
    if job_dir is not None:
        joins = [e.time for e in events.read(job_dir / "events.jsonl") if e.kind == "join"]
        grows = []
        for joined in joins[1:]:
            bigger = first_step_at(rows, 8, joined)
            if bigger is not None:
                grows.append(round(bigger - joined, 1))
        result["grow_s"] = sorted(set(grows))
    if args.keep:
        result["work_dir"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, required=True, help="a dev-cluster state dir")
    parser.add_argument("--mode", choices=("elastic", "plain"), required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sleep-per-step", type=float, default=0.2)
    parser.add_argument("--release", type=float, default=30.0)
    parser.add_argument("--preempt", type=float, default=150.0)
    parser.add_argument("--high-for", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="keep the logs and the job dir")
    parser.add_argument("--give-up", type=float, default=600.0)
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
