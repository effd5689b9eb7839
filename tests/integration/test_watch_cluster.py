"""``hpc-elastic watch`` on the real local Slurm, posting to a real local HTTP endpoint: a job
whose every slot is held is alerted once however often the watcher runs, and once more when
it runs again."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cluster import REPO, Cluster, wait_until
from submit_output import submitted

pytestmark = pytest.mark.integration

SLOW_SAVE = REPO / "tests" / "workloads" / "slow_save.py"


class Hook:
    """A webhook on 127.0.0.1 that keeps every JSON body it is sent."""

    def __init__(self) -> None:
        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kinds(self, run_id: str) -> list[str]:
        return [alert["kind"] for alert in self.received if alert.get("job") == run_id]


@pytest.fixture
def hook() -> Iterator[Hook]:
    served = Hook()
    yield served
    served.server.shutdown()
    served.server.server_close()


def hpc_elastic(
    cluster: Cluster, cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", *args],
        cwd=cwd,
        env={**cluster.env, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_held_job_is_alerted_once_and_once_more_when_it_runs_again(
    cluster: Cluster, hook: Hook, tmp_path: Path
) -> None:
    result = hpc_elastic(
        cluster,
        tmp_path,
        "submit",
        "--nodes=1:2",
        f"--zk={cluster.zk_hosts}",
        "--no-prewarm",
        "--no-snapshot",
        f"--notify={hook.url}",
        "--sbatch-arg=--hold",
        str(SLOW_SAVE),
        "--",
        "--steps=400",
        "--step-seconds=0.3",
        "--save-seconds=0.1",
    )
    assert result.returncode == 0, result.stderr
    job, job_dir = submitted(result.stdout)
    run_id = job_dir.name
    # The watcher's memory and index of its own, so that no other test's job is looked at.
    private = {"HPC_ELASTIC_INDEX": str(tmp_path / "state" / "jobs")}

    def watch() -> str:
        done = hpc_elastic(
            cluster,
            tmp_path,
            "watch",
            f"--log-dir={job_dir.parent}",
            "--dead-after=2",
            env=private,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    try:
        assert wait_until(lambda: "stalled" in watch(), 60, interval=1.0)
        for _ in range(3):
            watch()
        assert wait_until(lambda: hook.kinds(run_id).count("stalled") == 1, 30)
        [alert] = [a for a in hook.received if a["kind"] == "stalled"]
        assert "every slot is pending, held or gone" in alert["message"]
        assert alert["job"] == run_id
        cluster.run(["scontrol", "release", job])
        assert wait_until(lambda: "recovered" in watch(), 180, interval=2.0), cluster.squeue()
        for _ in range(2):
            watch()
        assert wait_until(lambda: "recovered" in hook.kinds(run_id), 30)
        watcher = [kind for kind in hook.kinds(run_id) if kind in ("stalled", "recovered")]
        assert watcher == ["stalled", "recovered"], hook.received
    finally:
        hpc_elastic(cluster, tmp_path, "cancel", str(job_dir))
    assert wait_until(lambda: not cluster.squeue(), 120), cluster.squeue()
