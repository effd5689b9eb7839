"""`hpc-elastic submit` against the real local Slurm + ZooKeeper: the scripts it renders run.

Every job is submitted through the real CLI (``python -m hpc_elastic submit``) in a fresh
interpreter, with the cluster's environment, from a scratch project directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import Cluster, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

REPORT = """\
import json, os, pathlib
out = pathlib.Path(os.environ["REPORT_DIR"])
name = os.environ.get("RANK", os.environ.get("SLURM_ARRAY_TASK_ID", os.environ["SLURM_NODEID"]))
keys = ("SLURMD_NODENAME", "SLURM_NODEID", "RANK", "WORLD_SIZE", "GROUP_RANK")
(out / f"{name}.json").write_text(json.dumps({key: os.environ.get(key) for key in keys}))
"""

# Stands in for the agent: runs the worker directly, one per node, under the same #SBATCH lines.
NO_AGENT_TEMPLATE = """\
{% extends "elastic.sh.j2" if elastic else "fixed.sh.j2" %}
{% block launch %}
exec srun --ntasks-per-node=1 {{ worker }}
{% endblock %}
"""


def submit(cluster: Cluster, project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "PYTHONPATH": str(REPO), "REPORT_DIR": str(project / "reports")}
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "submit", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "reports").mkdir()
    (tmp_path / "report.py").write_text(REPORT)
    (tmp_path / "no-agent.sh.j2").write_text(NO_AGENT_TEMPLATE)
    return tmp_path


def _job_dir(result: subprocess.CompletedProcess[str]) -> Path:
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("Job directory: "))
    return Path(line.removeprefix("Job directory: "))


def _reports(project: Path, count: int, job_dir: Path) -> list[dict[str, str]]:
    found = wait_until(lambda: len(list((project / "reports").iterdir())) == count, 90)
    logs = "\n".join(path.read_text() for path in sorted(job_dir.glob("slurm-*.out")))
    assert found, f"expected {count} reports; Slurm output:\n{logs}"
    return [json.loads(path.read_text()) for path in sorted((project / "reports").iterdir())]


def test_dry_run_submits_nothing(cluster: Cluster, project: Path) -> None:
    result = submit(cluster, project, "--dry-run", "--nodes", "2", "report.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash\n")
    assert cluster.squeue() == []
    assert not (project / "hpc-elastic-runs").exists()


def test_unknown_partition_is_refused_before_sbatch(cluster: Cluster, project: Path) -> None:
    result = submit(cluster, project, "--partition", "nosuch", "report.py")
    assert result.returncode == 2
    assert result.stderr.startswith("error: --partition 'nosuch' does not exist on this cluster")
    assert cluster.squeue() == []


def test_fixed_job_gets_one_step_task_per_node(cluster: Cluster, project: Path) -> None:
    job_dir = _job_dir(
        submit(cluster, project, "--nodes", "2", "--template", "no-agent.sh.j2", "report.py")
    )
    reports = _reports(project, 2, job_dir)
    assert sorted(report["SLURM_NODEID"] for report in reports) == ["0", "1"]
    assert len({report["SLURMD_NODENAME"] for report in reports}) == 2
    assert cluster.wait_queue_empty(30)


def test_elastic_job_gets_one_node_per_array_task(cluster: Cluster, project: Path) -> None:
    job_dir = _job_dir(
        submit(cluster, project, "--nodes", "1:3", "--template", "no-agent.sh.j2", "report.py")
    )
    reports = _reports(project, 3, job_dir)
    assert len({report["SLURMD_NODENAME"] for report in reports}) == 3
    assert len(list(job_dir.glob("slurm-*_*.out"))) == 3
    assert cluster.wait_queue_empty(30)


def test_two_agents_train_on_two_nodes(cluster: Cluster, project: Path) -> None:
    """The whole chain: submit -> sbatch -> srun -> two agents -> one rendezvous -> workers."""
    job_dir = _job_dir(
        submit(cluster, project, "--nodes", "2", "--zk", cluster.zk_hosts, "report.py")
    )
    reports = _reports(project, 2, job_dir)
    assert sorted(report["RANK"] for report in reports) == ["0", "1"]
    assert {report["WORLD_SIZE"] for report in reports} == {"2"}
    assert len({report["SLURMD_NODENAME"] for report in reports}) == 2
    assert cluster.wait_queue_empty(60)


VERSIONED = """\
import json, os, pathlib, time
VERSION = {version}
attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
facts = {{"version": VERSION, "file": __file__, "cwd": os.getcwd()}}
(pathlib.Path(os.environ["REPORT_DIR"]) / f"attempt{{attempt}}.json").write_text(json.dumps(facts))
if attempt == "0":
    time.sleep(600)  # until the test requeues the job
"""


def _git(project: Path, *args: str) -> str:
    identity = {"GIT_AUTHOR_NAME": "Ada", "GIT_AUTHOR_EMAIL": "ada@example.com"}
    identity |= {"GIT_COMMITTER_NAME": "Ada", "GIT_COMMITTER_EMAIL": "ada@example.com"}
    done = subprocess.run(
        ["git", "-C", str(project), *args],
        env={"PATH": "/usr/bin:/bin", "GIT_CONFIG_GLOBAL": "/dev/null", **identity},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_a_requeued_job_still_runs_the_code_as_submitted_not_as_edited(
    cluster: Cluster, project: Path
) -> None:
    """Submit, edit the script while the job waits, requeue it while it runs: both runs are
    the snapshot's code, from the snapshot's directory; status names the commit."""
    script = project / "versioned.py"
    script.write_text(VERSIONED.format(version=1))
    (project / ".gitignore").write_text("reports/\nhpc-elastic-runs/\n")
    _git(project, "init", "--quiet")
    _git(project, "add", ".")
    _git(project, "commit", "--quiet", "-m", "version 1")
    job_dir = _job_dir(
        submit(cluster, project, "--nodes", "1", "--zk", cluster.zk_hosts, "versioned.py")
    )
    script.write_text(VERSIONED.format(version=2))  # edited while the job waits in the queue
    job_id = json.loads((job_dir / "job.json").read_text())["job_id"]
    first = _reports(project, 1, job_dir)[0]
    script.write_text(VERSIONED.format(version=3))  # and again while it runs
    cluster.run(["scontrol", "requeue", job_id])
    # It waits out Slurm's requeue delay (6 s here): skipping it with StartTime=now is unsafe
    # for a job that may come back to its node (tests/integration/test_elastic_cluster.py, node
    # down).
    first, second = _reports(project, 2, job_dir)
    code = job_dir / "code"
    for run in (first, second):
        assert run == {"version": 1, "file": str(code / "versioned.py"), "cwd": str(code)}
    assert cluster.wait_queue_empty(60)
    shown = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "status", "--json", job_id],
        cwd=project,
        env={**cluster.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    snapshot = json.loads(shown.stdout)["code"]
    assert snapshot["commit"] == _git(project, "rev-parse", "HEAD")
    assert snapshot["dirty"] is False
