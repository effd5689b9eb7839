"""The submitit plugin: found through its entry points, submitting through the Python API to
a fake Slurm, and the worker that runs the pickled function on a rank (a real subprocess)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import submitit
from slurm_fake import FakeSlurm, mocked_submit
from submitit.core import plugins, utils

import hpc_elastic
from hpc_elastic import submitit_plugin

ENTRY_POINTS = Path(__file__).parents[2] / "pyproject.toml"


def install_entry_points(site: Path) -> Path:
    """A dist-info in ``site`` holding pyproject.toml's ``submitit`` entry points."""
    points = tomllib.loads(ENTRY_POINTS.read_text())["project"]["entry-points"]["submitit"]
    section = "\n".join(f"{name} = {target}" for name, target in points.items())
    dist = site / "hpc_elastic_plugin_test-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Name: hpc-elastic-plugin-test\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[submitit]\n{section}\n")
    return site


@pytest.fixture
def registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """pyproject.toml's ``submitit`` entry points, installed as a dist-info on sys.path, so
    submitit discovers the plugin exactly as it would after ``pip install hpc-elastic``."""
    monkeypatch.syspath_prepend(str(install_entry_points(tmp_path / "site")))
    for cached in (plugins._get_plugins, plugins.get_executors, plugins.get_job_environments):
        cached.cache_clear()
    yield
    for cached in (plugins._get_plugins, plugins.get_executors, plugins.get_job_environments):
        cached.cache_clear()


@pytest.fixture
def slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSlurm]:
    """Slurm with partition 'low' that takes job 77 and lists none: the job's ranks are the
    test's own processes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPC_ELASTIC_ZK", raising=False)
    with mocked_submit(partitions=("low",), first_job=77) as fake:
        fake.answer("squeue")
        yield fake


def test_auto_executor_takes_generic_and_prefixed_parameters_and_renders_our_script(
    registered: None, slurm: FakeSlurm, tmp_path: Path
) -> None:
    executor = submitit.AutoExecutor(tmp_path / "runs", cluster="hpcelastic")
    executor.update_parameters(
        nodes=4, timeout_min=60, gpus_per_node=8, hpcelastic_min_nodes=1,
        hpcelastic_partition="low",
    )  # fmt: skip
    job = executor.submit(pow, 2, 10)
    assert job.job_id == "77"
    script = slurm.submitted[0]
    for line in ("#SBATCH --array=0-3", "#SBATCH --time=60", "#SBATCH --gpus-per-node=8"):
        assert line in script
    assert "#SBATCH --partition=low" in script
    assert "# Rendered by hpc-elastic" in script
    assert str(submitit_plugin.WORKER) in script
    pickled = job.paths.submitted_pickle
    assert pickled.parent.parent == tmp_path / "runs"
    assert stat.S_IMODE(pickled.stat().st_mode) == 0o600
    assert utils.DelayedSubmission.load(pickled).result() == 1024


def test_the_executor_takes_an_elastic_range_directly(slurm: FakeSlurm, tmp_path: Path) -> None:
    executor = hpc_elastic.Executor(tmp_path / "runs")
    executor.update_parameters(nodes="1:4", nproc_per_node=2)
    executor.submit(pow, 2, 3)
    assert "#SBATCH --array=0-3" in slurm.submitted[0]
    with pytest.raises(ValueError, match="hpcelastic has no parameter 'nodez'"):
        executor.update_parameters(nodez=3)


def run_rank(job_dir: Path, rank: int, extra_path: Path) -> subprocess.CompletedProcess[str]:
    """One rank as the agent starts it: the worker script with torchrun's environment."""
    return subprocess.run(
        worker_argv(), env=worker_env(job_dir, rank, extra_path),
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip


def worker_argv() -> list[str]:
    return [sys.executable, "-u", str(submitit_plugin.WORKER), submitit_plugin.SUBMISSION_FILE]


def worker_env(job_dir: Path, rank: int, extra_path: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1", "SLURM_JOB_ID": "77", "HPC_ELASTIC_JOB_DIR": str(job_dir),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), str(extra_path), str(extra_path / "site")]
        ),
    }  # fmt: skip
    env.pop("SUBMITIT_EXECUTOR", None)  # the worker must say which environment it is
    return env


USER_CODE = """
import submitit

def where():
    env = submitit.JobEnvironment()
    return (env.cluster, env.global_rank, env.num_tasks, env.node, env.num_nodes, env.job_id)

def broken():
    raise ValueError("bad batch")


class Counter(submitit.helpers.Checkpointable):
    # Counts to until; progress says where it got to. It holds at step 5 until the file
    # progress + ".go" exists, so the test stops it there whatever the machine's load.

    def __init__(self, progress):
        self.step = 0
        self.progress = progress

    def __call__(self, until):
        import pathlib
        import time

        with open(self.progress + ".starts", "a") as starts:
            starts.write(f"{self.step}\\n")
        while self.step < until:
            self.step += 1
            pathlib.Path(self.progress).write_text(str(self.step))
            while self.step == 5 and not pathlib.Path(self.progress + ".go").exists():
                time.sleep(0.01)
        return self.step
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_runs_the_function_and_rank_0s_result_is_the_jobs(
    registered: None, slurm: FakeSlurm, tmp_path: Path, rank: int
) -> None:
    (tmp_path / "usercode.py").write_text(USER_CODE)
    sys.path.insert(0, str(tmp_path))
    try:
        import usercode  # type: ignore[import-not-found]  # noqa: PLC0415

        job = hpc_elastic.Executor(tmp_path / "runs").submit(usercode.where)
    finally:
        sys.path.remove(str(tmp_path))
    done = run_rank(job.paths.submitted_pickle.parent, rank, tmp_path)
    assert done.returncode == 0, done.stderr
    if rank == 0:
        assert job.done()
        assert job.result() == ("hpcelastic", 0, 2, 0, 1, "77")
    else:
        assert not job.paths.result_pickle.exists()


def test_a_failing_function_is_the_jobs_error(
    registered: None, slurm: FakeSlurm, tmp_path: Path
) -> None:
    (tmp_path / "usercode2.py").write_text(USER_CODE)
    sys.path.insert(0, str(tmp_path))
    try:
        import usercode2  # type: ignore[import-not-found]  # noqa: PLC0415

        job = hpc_elastic.Executor(tmp_path / "runs").submit(usercode2.broken)
    finally:
        sys.path.remove(str(tmp_path))
    done = run_rank(job.paths.submitted_pickle.parent, 0, tmp_path)
    assert done.returncode != 0
    with pytest.raises(utils.FailedJobError, match="bad batch"):
        job.result()


def test_a_checkpointable_stopped_for_preemption_resumes_from_its_checkpoint(
    registered: None, slurm: FakeSlurm, tmp_path: Path
) -> None:
    (tmp_path / "usercode3.py").write_text(USER_CODE)
    progress = tmp_path / "progress"
    sys.path.insert(0, str(tmp_path))
    try:
        import usercode3  # type: ignore[import-not-found]  # noqa: PLC0415

        job = hpc_elastic.Executor(tmp_path / "runs").submit(usercode3.Counter(str(progress)), 60)
    finally:
        sys.path.remove(str(tmp_path))
    job_dir = job.paths.submitted_pickle.parent
    first = subprocess.Popen(worker_argv(), env=worker_env(job_dir, 0, tmp_path))
    try:
        assert wait_for(lambda: progress.exists() and progress.read_text() == "5")
        first.send_signal(signal.SIGUSR2)  # what the agent forwards on preemption
        assert first.wait(timeout=60) == 128 + signal.SIGUSR2
    finally:
        first.kill()
    stopped_at = int(progress.read_text())
    assert not job.paths.result_pickle.exists()
    assert stat.S_IMODE(job.paths.submitted_pickle.stat().st_mode) == 0o600
    checkpointed: Any = utils.DelayedSubmission.load(job.paths.submitted_pickle).function
    assert checkpointed.step == stopped_at

    assert stopped_at == 5
    progress.write_text("0")
    progress.with_name("progress.go").touch()
    requeued = run_rank(job_dir, 0, tmp_path)  # the requeued slot runs the same file
    assert requeued.returncode == 0, requeued.stderr
    assert job.result() == 60
    assert int(progress.read_text()) == 60
    starts = progress.with_name("progress.starts").read_text().split()
    assert starts == ["0", "5"]  # the rerun counted on from the checkpoint, not from 0


def wait_for(predicate: Callable[[], bool], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_the_example_switches_a_submitit_script_by_one_line(
    registered: None, slurm: FakeSlurm, tmp_path: Path
) -> None:
    example = Path(__file__).parents[2] / "examples" / "submitit_switch.py"
    lines = example.read_text().splitlines()
    switch = [line for line in lines if "SWITCH" in line and "AutoExecutor" in line]
    before = [line for line in lines if "# executor = submitit.AutoExecutor(folder)" in line]
    assert len(switch) == 1
    assert len(before) == 1
    sys.path.insert(0, str(example.parent))
    try:
        import submitit_switch  # noqa: PLC0415
    finally:
        sys.path.remove(str(example.parent))
    job = submitit_switch.submit(str(tmp_path / "runs"))
    assert job.job_id == "77"
    assert "#SBATCH --array=0-3" in slurm.submitted[0]
    assert "#SBATCH --partition=low" in slurm.submitted[0]
    assert utils.DelayedSubmission.load(job.paths.submitted_pickle).args == (3e-4,)
