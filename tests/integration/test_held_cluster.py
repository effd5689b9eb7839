"""Tasks Slurm holds for too many requeues (``JobHoldMaxRequeue``), on the real local cluster.

Slurm 22.05 holds a batch task once it was requeued "due to node failure" more than
``MAX_BATCH_REQUEUE`` (5, built in) times; an ``scontrol requeue`` never counts. The count
moves when a crashed node's slurmd comes back and registers without the task it was running
(``Batch JobId=... missing from batch node``), which Slurm only believes of a task older than
``BatchStartTimeout`` + 5 s: the test lowers ``BatchStartTimeout`` to 1 s for its duration
(``Cluster.slurm_conf_lines``), then crashes the node under a running task and restarts it
(``dev-cluster node-kill``/``node-start``) five times. docs/unattended.md, "held slots".

One job of three slots: slot 0 is never touched, so it is the lowest running slot, the one
that releases or reports holds. Slots 1 and 2 are crashed side by side until both are held.
Slot 1's hold is its first: slot 0 releases it, and slot 1 runs again. Slot 2 was, by its hold
record, released once already with no progress since (the job never checkpoints), so the
no-progress breaker keeps it held, and its ``held`` alert is posted to ``--notify`` once.
Writing that record stands for a first round of five crashes and a release, which would double
the test's minute of crashes and show nothing more. The job then finishes, and the end of the
job cancels the held task.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, wait_until
from submit_output import submitted

from hpc_elastic import events
from hpc_elastic.errors import SlurmError
from hpc_elastic.jobdir import JobDir
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.departure import parse_duration
from hpc_elastic.slurm.holds import HoldRecord
from hpc_elastic.slurm.ledger import save_json
from hpc_elastic.slurm.queue import CHURN_HOLD

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
COUNTED_REQUEUES = 5
"""Slurm 22.05's ``MAX_BATCH_REQUEUE``: the 5th requeue for a node failure holds the task."""
OLD_ENOUGH_S = 8.0
"""A task must run longer than BatchStartTimeout (1 s here) + MessageTimeout (5 s) before a
returning slurmd's registration counts it missing; 2 s more for the one-second clock of Slurm."""
ENDED = frozenset({"FAILED", "COMPLETED", "CANCELLED", "NODE_FAIL", "BOOT_FAIL", "TIMEOUT"})
"""States a crashed task must never reach: it is requeued, then held."""
WAITS_FOR_FINISH = """\
import pathlib, time
while not pathlib.Path({finish!r}).exists():
    time.sleep(0.2)
print("trained")
"""
"""The job's script: it trains until the test creates ``finish``, and never checkpoints (no
progress). The path is written in: the job runs a snapshot of the script, elsewhere."""


class Alerts(ThreadingHTTPServer):
    """The ``--notify`` webhook: a real HTTP server on 127.0.0.1 that keeps every body."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Hook)
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            return [body for body in self.bodies if body["kind"] == kind]


class _Hook(BaseHTTPRequestHandler):
    server: Alerts

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def alerts() -> Iterator[Alerts]:
    server = Alerts()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def task(cluster: Cluster, job_task: str) -> dict[str, str]:
    """``scontrol -o show job`` of one array task, through the product's own parser."""
    return commands.scontrol_show_job(job_task, cluster.env, timeout=10)


def crash_under(cluster: Cluster, job_task: str, shown: dict[str, str]) -> None:
    """Crash the node the task runs on and bring it back at once; then wait (briefly) for
    Slurm to requeue the task, so one incarnation is not crashed twice: until the requeue is
    handled, the task still reads RUNNING on the node that just came back."""
    cluster.node_kill(shown["BatchHost"])
    cluster.node_start(shown["BatchHost"])
    before = int(shown["Restarts"])
    wait_until(lambda: int(task(cluster, job_task)["Restarts"]) > before, 10, 0.2)


def crash_until_held(cluster: Cluster, tasks: list[str], deadline_s: float) -> dict[str, str]:
    """Crash the node under each of ``tasks`` whenever it has run long enough, and restart the
    node at once, until Slurm has requeued each task COUNTED_REQUEUES times for it (its
    ``Restarts``: no agent requeues itself here). Slurm's requeue delay (``BeginTime``, the
    credential lifetime + 1 s) is waited out, not skipped: a task started at once on the node
    that just lost it is refused there ("Job 9 already killed, do not launch batch job") and
    ends FAILED, never to be held. Returns what scontrol said of each task after its last crash."""
    last: dict[str, str] = {}
    deadline = time.monotonic() + deadline_s
    while len(last) < len(tasks):
        assert time.monotonic() < deadline, f"not held in {deadline_s} s: {last}"
        for job_task in tasks:
            if job_task in last:
                continue
            shown = task(cluster, job_task)
            assert shown["JobState"] not in ENDED, f"{job_task} ended instead: {shown}"
            # Read here, not right after the crash: the returning slurmd's registration, which
            # requeues the task, may be handled a moment after the node answers again.
            if int(shown["Restarts"]) >= COUNTED_REQUEUES:
                last[job_task] = f"{shown['JobState']} {shown['Reason']} {shown['Priority']}"
                continue
            running = shown["JobState"] == "RUNNING"
            if running and (parse_duration(shown["RunTime"]) or 0.0) >= OLD_ENOUGH_S:
                crash_under(cluster, job_task, shown)
        time.sleep(0.5)
    return last


def test_a_held_task_is_released_and_one_held_again_without_progress_is_alerted_once(
    cluster: Cluster, tmp_path: Path, alerts: Alerts
) -> None:
    script, finish = tmp_path / "train.py", tmp_path / "finish"
    script.write_text(WAITS_FOR_FINISH.format(finish=str(finish)))
    with cluster.slurm_conf_lines("BatchStartTimeout=1"):
        result = subprocess.run(
            [
                sys.executable, "-m", "hpc_elastic", "submit", "--nodes=1:3", "--partition=low",
                f"--zk={cluster.zk_hosts}", "--no-prewarm", "--exclude-after=100",
                f"--notify={alerts.url}", str(script),
            ],
            cwd=tmp_path, env={**cluster.env, "PYTHONPATH": str(REPO)},
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        job, job_dir = submitted(result.stdout)
        history = job_dir / "events.jsonl"
        # Slot 2 was released once, and the job made no progress since (it never checkpoints).
        save_json(JobDir(job_dir).hold_record(2), asdict(HoldRecord(releases=1)))
        first, second = f"{job}_1", f"{job}_2"

        def all_running() -> bool:
            try:
                return all(task(cluster, f"{job}_{i}")["JobState"] == "RUNNING" for i in range(3))
            except SlurmError:
                return False  # Not yet split into tasks.

        assert wait_until(all_running, 60, interval=0.5), cluster.squeue()
        after_crashes = crash_until_held(cluster, [first, second], deadline_s=180)

    def said(kind: str, slot_task: int | None = None) -> list[events.Event]:
        return [
            event
            for event in events.read(history)
            if event.kind == kind and (slot_task is None or event.details.get("task") == slot_task)
        ]

    # Slot 2: held by Slurm for its node failures, kept held by the breaker, alerted once.
    held = task(cluster, second)
    assert (held["JobState"], held["Reason"], held["Priority"]) == (
        "REQUEUE_HOLD",
        CHURN_HOLD,
        "0",
    ), held
    assert wait_until(lambda: len(alerts.of_kind("held")) >= 1, 90, interval=0.5), alerts.bodies
    # Slot 1: held the same way (``after_crashes``), released by slot 0, running again.
    assert wait_until(lambda: bool(said("released", 1)), 90, interval=0.5), after_crashes

    def first_back() -> bool:
        released = [e.time for e in said("released", 1)]
        restarted = [e for e in events.read(history) if e.kind == "start" and e.slot == "1"]
        return any(event.time > released[0] for event in restarted)

    assert wait_until(first_back, 120, interval=1.0), [e.kind for e in events.read(history)]
    finish.touch()
    assert wait_until(lambda: bool(alerts.of_kind("finished")), 120, interval=0.5), alerts.bodies
    assert wait_until(lambda: not cluster.squeue(), 60), cluster.squeue()

    released = said("released", 1)
    assert len(released) == 1, released
    assert released[0].details["slurm_job"] == first
    assert released[0].slot == "0", "the lowest running slot releases"
    assert said("released", 2) == [], "the breaker keeps a hold without progress"
    assert [e.details["reason"] for e in said("held")] == [CHURN_HOLD], said("held")
    assert said("held")[0].details["task"] == 2
    posted = alerts.of_kind("held")
    assert len(posted) == 1, posted
    assert posted[0]["details"]["task"] == 2
    assert posted[0]["details"]["reason"] == CHURN_HOLD
    assert "REQUEUE_HOLD" in posted[0]["message"]
    assert (posted[0]["job"], posted[0]["slot"]) == (job_dir.name, "0"), "the reporting slot's"
    assert [body["job"] for body in alerts.of_kind("finished")] == [job_dir.name]
    assert len(said("done")) >= 1
    assert any(2 in e.details["tasks"] for e in said("cancel_pending")), (
        "the held task is cancelled"
    )
