"""Preemption: a signal becomes one agreed stop, the heartbeat moves, and the exit code says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_elastic.train import PREEMPTED_EXIT_CODE, heartbeat

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_signal_stops_the_loop_and_exits_preempted(tmp_path: Path) -> None:
    beats = tmp_path / "heartbeat"
    result = python(
        """
        import os, signal
        import hpc_elastic.train as elastic
        for step in range(1, 100):
            if step == 5:
                os.kill(os.getpid(), signal.SIGUSR1)
            if elastic.should_stop(step):
                print(step, elastic.requested().name)
                elastic.exit_preempted()
        """,
        tmp_path,
        HPC_ELASTIC_HEARTBEAT_FILE=str(beats),
    )
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr
    assert result.stdout.split() == ["5", "SIGUSR1"]
    assert heartbeat.read(beats)[1] == 1


def test_second_ctrl_c_interrupts_as_usual(tmp_path: Path) -> None:
    result = python(
        """
        import os, signal
        import hpc_elastic.train as elastic
        elastic.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGINT)
        print(elastic.should_stop(), flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        print("not reached")
        """,
        tmp_path,
    )
    assert result.stdout.split() == ["True"]
    assert "KeyboardInterrupt" in result.stderr


AGREEMENT = """
import os, signal, torch.distributed as dist
import hpc_elastic.train as elastic
dist.init_process_group("gloo")
for step in range(1, 1000):
    if step == 7 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR2)
    if elastic.should_stop(step):
        print(f"rank={dist.get_rank()} stopped={step}", flush=True)
        elastic.exit_preempted()
"""


def test_all_ranks_stop_at_the_same_step(tmp_path: Path) -> None:
    script = tmp_path / "agree.py"
    script.write_text(AGREEMENT)
    result = subprocess.run(
        [
            str(TORCHRUN),
            "--nnodes=1",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            "--tee=3",
            str(script),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "rank=0 stopped=7" in result.stdout
    assert "rank=1 stopped=7" in result.stdout


def test_heartbeat_round_trip_and_rate_limit(tmp_path: Path) -> None:
    path = tmp_path / "beat"
    heartbeat.write(path, 12)
    assert heartbeat.read(path)[1] == 12
    limited = heartbeat.Heartbeat(path, min_interval=3600)
    limited.beat(13)
    limited.beat(14)
    assert heartbeat.read(path)[1] == 13
    eager = heartbeat.Heartbeat(path, min_interval=0)
    eager.beat(15)
    eager.beat(16)
    assert heartbeat.read(path)[1] == 16


@pytest.mark.parametrize("module", ["hpc_elastic.train", "hpc_elastic.train.heartbeat"])
def test_agent_side_modules_do_not_import_torch(tmp_path: Path, module: str) -> None:
    result = python(
        f"""
        import sys, {module}
        from hpc_elastic.train.exitcodes import PREEMPTED_EXIT_CODE
        assert "torch" not in sys.modules
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
