"""``hpc-elastic drill`` on a running job of the real local Slurm: a preemption acted on a
random slot, the figures reported, and the step log found clean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import REPO, Cluster, wait_until
from test_elastic_cluster import checkpoint_steps, story, submit_training, training_at

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1200)  # its own waits add up to 1,080 s: the suite's 300 s cut them short
def test_a_drill_on_a_running_job_reports_its_figures_and_finds_the_step_log_clean(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "steps.log"
    slow = tmp_path / "slow"
    slow.write_text("0 1")  # slow until the drill is over, so the job outlives it
    _, job_dir = submit_training(cluster, tmp_path, "2:3", 150, train_args=(f"--slow-file={slow}",))
    assert training_at(job_dir, log, 6, 240), story(cluster, job_dir, log)
    assert wait_until(lambda: bool(checkpoint_steps(job_dir)), 120), story(cluster, job_dir, log)
    options = [f"--step-log={log}", "--json", "--timeout=300", "--seed=7"]
    drilled = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "drill", str(job_dir), "--kind=preempt", *options],
        cwd=tmp_path,
        env={**cluster.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert drilled.returncode == 0, drilled.stdout + drilled.stderr + story(cluster, job_dir, log)
    report = json.loads(drilled.stdout)
    assert report["kind"] == "preempt"
    assert report["full_size"] == 6
    assert report["time_to_full_step_s"] > 0
    assert report["steps_redone"] >= 0
    assert report["save_after_signal_s"] is not None
    assert report["grace_margin_s"] == pytest.approx(15.0 - report["save_after_signal_s"])
    assert report["step_log"].startswith("clean"), report
    assert report["problems"] == []
    slow.unlink()
    assert wait_until(lambda: not cluster.squeue(), 300), story(cluster, job_dir, log)
