"""Stock torchrun with ``--rdzv-backend=zookeeper``: real agents, real workers, real ZooKeeper."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from cluster import REPO, Cluster

pytestmark = pytest.mark.integration

TRAIN = """
import os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
steps = int(sys.argv[1])
marks = Path(sys.argv[2])
(marks / f"world{dist.get_world_size()}-rank{dist.get_rank()}").touch()
for step in range(steps):
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    time.sleep(0.1)  # a step's work, so a crash lands mid-training
print(f"done world={dist.get_world_size()} sum={total.item():g} "
      f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
dist.destroy_process_group()
"""

ENTRY_POINT = """[torchrun.handlers]
zookeeper = hpc_elastic.rendezvous.torchrun_plugin:create_handler
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """PYTHONPATH with the package, and its entry point if it is not pip-installed yet."""
    paths = [str(REPO)]
    if not any(ep.name == "zookeeper" for ep in entry_points(group="torchrun.handlers")):
        dist_info = tmp_path / "site" / "hpc_elastic_plugin-0.dist-info"
        dist_info.mkdir(parents=True)
        (dist_info / "METADATA").write_text("Name: hpc-elastic-plugin\nVersion: 0\n")
        (dist_info / "entry_points.txt").write_text(ENTRY_POINT)
        paths.append(str(dist_info.parent))
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "OMP_NUM_THREADS": "1",
        "LOGLEVEL": "INFO",
    }


@pytest.fixture
def torchrun() -> Iterator[list[subprocess.Popen[str]]]:
    """The torchrun agents a test started; any still running are crashed afterwards."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for agent in started:
        if agent.poll() is None:
            crash(agent)
        agent.wait()


def launch(zk: str, env: dict[str, str], script: Path, steps: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "torch.distributed.run",
            "--rdzv-backend=zookeeper", f"--rdzv-endpoint={zk}", "--rdzv-id=job",
            "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--monitor-interval=0.2",
            "--rdzv-conf=last_call_timeout=1,session_timeout=2,zk_open_acl=1",
            str(script), str(steps), str(script.parent),
        ],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def crash(agent: subprocess.Popen[str]) -> None:
    """A node crash: the agent and its workers (which torch puts in their own sessions) die."""
    workers = subprocess.run(
        ["pgrep", "-P", str(agent.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    os.killpg(agent.pid, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def test_two_torchrun_agents_train_together_and_close_the_job(
    cluster: Cluster,
    zk_root: str,
    env: dict[str, str],
    script: Path,
    torchrun: list[subprocess.Popen[str]],
) -> None:
    zk = cluster.zk_hosts + zk_root
    torchrun.extend(launch(zk, env, script, steps=5) for _ in range(2))
    outputs = [agent.communicate(timeout=120)[0] for agent in torchrun]
    assert [agent.returncode for agent in torchrun] == [0, 0], outputs
    assert all("done world=2 sum=3 restart=0" in output for output in outputs), outputs
    late = launch(zk, env, script, steps=1)
    torchrun.append(late)
    output = late.communicate(timeout=60)[0]
    assert late.returncode == 0, output
    assert "done" not in output, "a late agent must not train after the job closed"


def test_survivor_restarts_at_the_smaller_size_when_a_node_dies(
    cluster: Cluster,
    zk_root: str,
    env: dict[str, str],
    script: Path,
    torchrun: list[subprocess.Popen[str]],
) -> None:
    zk = cluster.zk_hosts + zk_root
    survivor, victim = launch(zk, env, script, steps=100), launch(zk, env, script, steps=100)
    torchrun.extend([survivor, victim])
    deadline = time.monotonic() + 120
    while len(list(script.parent.glob("world2-rank*"))) < 2:
        assert time.monotonic() < deadline, "the two agents never trained together"
        time.sleep(0.2)
    crash(victim)
    try:
        output = survivor.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        crash(survivor)
        pytest.fail(f"the survivor hung:\n{survivor.communicate()[0][-6000:]}")
    assert survivor.returncode == 0, output
    # The survivor's workers either see the peer's socket reset (torch spends one of its own
    # restarts) or are restarted by our watch first (no restart spent); both train on alone.
    assert "done world=1 sum=1 restart=" in output, output[-6000:]
    assert output.count("Rendezvous'ing worker group") == 2, output
