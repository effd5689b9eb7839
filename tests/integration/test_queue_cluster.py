"""A job of 16 slots on the real local Slurm: one squeue for the job, not one a slot.

Every slot's agent needs the job's slot count (the tasks that run or start) each time its
rendezvous decides, and in a job of ``BOARD_FROM`` slots or more only the lowest running slot
asks squeue for it; it posts the count in the job directory (``slots/queue.json``) and the
others read it there (docs/design.md, "One squeue a job"). The dev cluster's four nodes run
four of the sixteen tasks; the rest pend, as the tasks of a large job may.

squeue here is Slurm's own behind a shim first on the job's ``PATH`` (sbatch passes the
submitter's environment on) that notes which task asked, then runs it. Once the job has
trained longer than a board may be old, a worker is killed, so that every agent decides a new
round at once, and the test reads who asked squeue from the failure until the round after it
trains.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import Cluster, wait_until
from submit_output import submitted
from test_elastic_cluster import story

from hpc_elastic import events
from hpc_elastic.jobdir import JobDir
from hpc_elastic.slurm.queue import BOARD_FROM, BOARD_MAX_AGE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
SLOTS = BOARD_FROM
RUNNING = 4
"""A task a node on the dev cluster's four nodes; the other twelve pend."""


def squeue_shim(directory: Path, asked: Path) -> Path:
    """A ``squeue`` that appends the asking task's id to ``asked`` and runs Slurm's."""
    real = shutil.which("squeue")
    assert real is not None
    directory.mkdir()
    shim = directory / "squeue"
    shim.write_text(
        f'#!/bin/sh\necho "${{SLURM_ARRAY_TASK_ID:-none}}" >> {asked}\nexec {real} "$@"\n'
    )
    shim.chmod(0o755)
    return directory


def askers(asked: Path, since: int) -> list[str]:
    """The tasks that ran squeue, a line a call, from line ``since`` on."""
    lines = asked.read_text().splitlines() if asked.exists() else []
    return lines[since:]


def new_rounds(job_dir: Path, after: int) -> list[int]:
    """Round numbers past ``after`` that some agent trained in (a ``start`` event)."""
    return sorted(
        {
            event.round
            for event in events.read(job_dir / "events.jsonl")
            if event.kind == "start" and event.round is not None and event.round > after
        }
    )


def newest_round(job_dir: Path) -> int:
    numbers = [e.round for e in events.read(job_dir / "events.jsonl") if e.round is not None]
    return max(numbers, default=0)


def worker_of_slot(job_dir: Path, slot: str) -> int:
    """A running worker of ``slot``: a child of its agent (whose node id holds its pid) that
    writes somewhere, where a standby still writes to /dev/null."""
    started = [e for e in events.read(job_dir / "events.jsonl") if e.kind == "start"]
    agent = int(str([e for e in started if e.slot == slot][-1].details["node_id"]).split("-")[-2])
    children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    running = [int(pid) for pid in children if _stdout(int(pid)) != os.devnull]
    assert running, f"slot {slot}'s agent {agent} runs no worker: {children}"
    return running[0]


def _stdout(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def test_in_a_job_of_sixteen_slots_only_the_lowest_running_slot_asks_squeue(
    cluster: Cluster, tmp_path: Path
) -> None:
    asked = tmp_path / "asked"
    shims = squeue_shim(tmp_path / "shims", asked)
    log = tmp_path / "steps.log"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_elastic",
            "submit",
            f"--nodes=2:{SLOTS}",
            "--nproc-per-node=1",
            "--partition=low",
            f"--zk={cluster.zk_hosts}",
            "--last-call=2",
            str(TRAIN),
            "--",
            "--steps=100000",
            "--checkpoint-every=20",
            "--sleep-per-step=0.2",
            f"--log-file={log}",
        ],
        cwd=tmp_path,
        env={
            **cluster.env,
            "PYTHONPATH": str(REPO),
            "PATH": f"{shims}{os.pathsep}{cluster.env['PATH']}",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    job, job_dir = submitted(result.stdout)
    board = JobDir(job_dir).queue_board
    try:

        def trains_at_full_size() -> bool:
            text = log.read_text() if log.exists() else ""
            steps = [line for line in text.splitlines() if line.startswith("step=")]
            return bool(steps) and steps[-1].endswith(f" world={RUNNING}") and board.exists()

        assert wait_until(trains_at_full_size, 240, interval=0.5), story(cluster, job_dir, log)
        # As in any job that has trained a while: the board's first post is older than a
        # board may be, so only the posts since keep it fresh (the first answer's slot once
        # chose the held-task clock's 30 s before it knew it posts, and the board went stale).
        first_post = float(json.loads(board.read_bytes())["at"])
        assert wait_until(lambda: time.time() > first_post + BOARD_MAX_AGE + 2, 60)
        before, since = newest_round(job_dir), len(askers(asked, 0))
        os.kill(worker_of_slot(job_dir, "1"), signal.SIGKILL)
        assert wait_until(lambda: bool(new_rounds(job_dir, before)), 180, interval=0.5), story(
            cluster, job_dir, log
        )
        during = askers(asked, since)
        posted = board.read_text() if board.exists() else None
        assert set(during) <= {"0"}, (
            f"squeue asked by tasks {sorted(set(during))}: {during}; the board {posted} at "
            f"{time.time():.1f}"
        )
    finally:
        subprocess.run(
            [sys.executable, "-m", "hpc_elastic", "cancel", job, "--log-dir", str(job_dir.parent)],
            cwd=tmp_path,
            env={**cluster.env, "PYTHONPATH": str(REPO)},
            capture_output=True,
            timeout=60,
            check=False,
        )
    assert cluster.wait_queue_empty(120), cluster.squeue()
