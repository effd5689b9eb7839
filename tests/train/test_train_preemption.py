"""Preemption: a signal becomes one agreed stop, the heartbeat moves, and the exit code says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ranks
from ranks import ROOT

from hpc_elastic.train import PREEMPTED_EXIT_CODE, heartbeat


def python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return ranks.python(textwrap.dedent(code), cwd=tmp_path, env=env)


def test_signal_stops_the_loop_and_exits_preempted(tmp_path: Path) -> None:
    beats = tmp_path / "heartbeat"
    result = python(
        """
        import os, signal
        import hpc_elastic.train as elastic
        from hpc_elastic.train import heartbeat
        for step in range(1, 100):
            if step == 5:
                print(heartbeat.read(os.environ["HPC_ELASTIC_HEARTBEAT_FILE"])[1])
                os.kill(os.getpid(), signal.SIGUSR1)
            if elastic.should_stop(step):
                print(step, elastic.requested().name)
                elastic.exit_preempted()
        """,
        tmp_path,
        HPC_ELASTIC_HEARTBEAT_FILE=str(beats),
    )
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr
    assert result.stdout.split() == ["1", "5", "SIGUSR1"]  # the heartbeat moved, rate-limited
    assert heartbeat.finished(beats)  # the stop ended the loop: the agent stops timing it


def test_a_save_on_the_training_thread_marks_the_heartbeat_and_a_stop_finishes_it(
    tmp_path: Path,
) -> None:
    beats = tmp_path / "heartbeat"
    result = python(
        """
        import os, signal, threading
        import hpc_elastic.train as elastic
        from hpc_elastic.train import heartbeat, preemption
        path = os.environ["HPC_ELASTIC_HEARTBEAT_FILE"]
        def show(when):
            print(when, heartbeat.read(path)[1], heartbeat.checkpointing(path), flush=True)
        elastic.should_stop(7)
        with preemption.saving():
            with preemption.saving():
                show("nested")
            show("saving")
        show("saved")
        worker = threading.Thread(target=lambda: preemption.saving().__enter__())
        worker.start()
        worker.join()
        show("background")
        os.kill(os.getpid(), signal.SIGUSR1)
        print("stop", elastic.should_stop(8))
        with preemption.saving():
            print("final", heartbeat.finished(path), heartbeat.checkpointing(path))
        print("after", heartbeat.finished(path))
        """,
        tmp_path,
        HPC_ELASTIC_HEARTBEAT_FILE=str(beats),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "nested 7 True",
        "saving 7 True",
        "saved 7 False",
        "background 7 False",
        "stop True",
        "final True False",
        "after True",
    ]


def test_third_ctrl_c_interrupts_a_script_that_does_not_stop(tmp_path: Path) -> None:
    result = python(
        """
        import os, signal
        import hpc_elastic.train as elastic
        elastic.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGINT)
        print(elastic.should_stop(), flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        print("second absorbed", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        print("not reached")
        """,
        tmp_path,
    )
    assert result.stdout.split() == ["True", "second", "absorbed"]
    assert "KeyboardInterrupt" in result.stderr


@pytest.mark.parametrize(("interrupts", "during_save"), [(1, 1), (1, 2)])
def test_repeated_ctrl_c_during_the_final_save_still_commits_it(
    tmp_path: Path, interrupts: int, during_save: int
) -> None:
    saver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(FINAL_SAVE)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert saver.stdout is not None
        assert saver.stdout.readline().strip() == "ready"
        for _ in range(interrupts):
            saver.send_signal(signal.SIGINT)
        assert saver.stdout.readline().strip() == "saving"
        for _ in range(during_save):
            saver.send_signal(signal.SIGINT)
        (tmp_path / "signals-sent").touch()
        output, errors = saver.communicate(timeout=120)
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()
    assert saver.returncode == PREEMPTED_EXIT_CODE, errors
    assert "KeyboardInterrupt" not in errors
    step = int(output.split("saved step=")[1].split()[0])
    assert (tmp_path / "ckpt" / f"step-{step:08d}").is_dir()
    assert not list((tmp_path / "ckpt").glob(".step-*"))


FINAL_SAVE = """
import time, torch
from pathlib import Path
import hpc_elastic.train as elastic
from hpc_elastic.train import checkpoint

real_fsync = checkpoint._fsync_file


def fsync_after_the_signals(path):
    print("saving", flush=True)
    deadline = time.monotonic() + 60
    while not Path("signals-sent").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    real_fsync(path)


checkpoint._fsync_file = fsync_after_the_signals
elastic.install_signal_handlers()
state = elastic.TrainState(torch.nn.Linear(2, 2))
print("ready", flush=True)
while True:
    state.finish_step()
    if elastic.should_stop(state.step):
        elastic.save(state, "ckpt")
        print(f"saved step={state.step}", flush=True)
        elastic.exit_preempted()
    time.sleep(0.01)  # a step's work
"""


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
    result = ranks.torchrun(script, cwd=tmp_path, timeout=180)
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


def test_a_heartbeat_checkpoint_mark_keeps_its_step_and_a_finish_is_final(tmp_path: Path) -> None:
    path = tmp_path / "beat"
    assert not heartbeat.checkpointing(path)
    heartbeat.mark_checkpoint(path, 12)
    assert heartbeat.read(path)[1] == 12
    assert heartbeat.checkpointing(path)
    assert not heartbeat.finished(path)
    beat = heartbeat.Heartbeat(path, min_interval=0)
    beat.finish()
    beat.beat(13)
    with beat.saving():
        assert heartbeat.finished(path)
    assert heartbeat.finished(path)
    assert heartbeat.read(path)[1] is None


@pytest.mark.parametrize(
    "module", ["hpc_elastic.train", "hpc_elastic.train.heartbeat", "hpc_elastic.train.lease"]
)
def test_agent_side_modules_do_not_import_torch(tmp_path: Path, module: str) -> None:
    result = python(
        f"""
        import sys, {module}
        from hpc_elastic.train.exitcodes import FENCED_EXIT_CODE, PREEMPTED_EXIT_CODE
        assert "torch" not in sys.modules
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
