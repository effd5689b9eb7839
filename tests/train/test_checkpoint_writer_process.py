"""The opt-in writer process (``writer="process"``): same commit, same resume, and a writer
killed at any moment costs the commit in flight, never a checkpoint already committed.

The writer is a real spawned process fed from shared memory; the tests kill it with real
signals (SIGSTOP holds it mid-commit, SIGKILL ends it).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import make_state, random_draws, train
from test_checkpoint_async import parameters, seed_everything
from torch import nn

from hpc_elastic.errors import CheckpointError
from hpc_elastic.train import Checkpointer, TrainState, background, verify, writer_process

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_writer_left_behind() -> Iterator[None]:
    """Every test ends with no commit in flight and no writer process running."""
    yield
    background.wait_local()
    writer_process._writer.close()


def process_checkpointer(directory: Path, **settings: Any) -> Checkpointer:
    return Checkpointer(directory, round=None, asynchronous=True, writer="process", **settings)


def test_a_save_through_the_writer_process_resumes_bitwise(tmp_path: Path) -> None:
    checkpointer = process_checkpointer(tmp_path)
    seed_everything(7)
    uninterrupted = make_state()
    train(uninterrupted, 3)
    train(uninterrupted, 4)
    expected_draws = random_draws()

    seed_everything(7)
    interrupted = make_state()
    train(interrupted, 3)
    assert checkpointer.save(interrupted) == tmp_path / "step-00000003"
    train(interrupted, 2)  # the loop goes on while the writer writes
    checkpointer.wait()
    assert writer_process.writer_pid() is not None

    resumed = make_state(seed=99)
    assert checkpointer.load(resumed) == tmp_path / "step-00000003"
    train(resumed, 4)
    assert resumed.step == uninterrupted.step
    for mine, theirs in zip(parameters(resumed), parameters(uninterrupted), strict=True):
        assert torch.equal(mine, theirs)
    assert random_draws() == expected_draws


def test_the_process_writer_without_asynchronous_saves_is_refused_in_one_sentence(
    tmp_path: Path,
) -> None:
    with pytest.raises(CheckpointError, match="writer='process' is not one of thread, process"):
        Checkpointer(tmp_path, writer="process")


def saved(checkpointer: Checkpointer, model: nn.Linear, state: TrainState, step: int) -> None:
    with torch.no_grad():
        model.weight.fill_(float(step))
    state.step = step
    checkpointer.save(state)


def assert_only_intact_checkpoints_and_the_newest_loads(directory: Path) -> int:
    for checkpoint in Checkpointer(directory).committed():
        assert verify(checkpoint) is None, f"{checkpoint.name} is committed but not intact"
    fresh = nn.Linear(512, 512)
    restored = TrainState(fresh)
    Checkpointer(directory, round=None).load(restored)
    assert torch.equal(fresh.weight, torch.full((512, 512), float(restored.step)))
    return restored.step


def test_a_writer_killed_during_a_commit_fails_that_commit_only(tmp_path: Path) -> None:
    checkpointer = process_checkpointer(tmp_path, keep=10)
    model = nn.Linear(512, 512)
    state = TrainState(model)
    saved(checkpointer, model, state, 1)
    checkpointer.wait()
    pid = writer_process.writer_pid()
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # the writer holds still: step 2's commit stays in flight
    saved(checkpointer, model, state, 2)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match=r"writer process could not write .* exit code -9"):
        checkpointer.wait()
    assert [path.name for path in checkpointer.committed()] == ["step-00000001"]
    assert assert_only_intact_checkpoints_and_the_newest_loads(tmp_path) == 1
    saved(checkpointer, model, state, 3)  # the next save starts a new writer
    checkpointer.wait()
    assert writer_process.writer_pid() not in (None, pid)
    assert [path.name for path in checkpointer.committed()] == ["step-00000003", "step-00000001"]
    assert not list(tmp_path.glob(".step-*")), "the dead writer's staging was not removed"


def failure_of(action: Any) -> str | None:
    try:
        action()
    except CheckpointError as error:
        return str(error)
    return None


def test_sigkill_of_the_writer_at_random_points_loses_nothing_committed(tmp_path: Path) -> None:
    rng = random.Random(15)
    checkpointer = process_checkpointer(tmp_path, keep=50)
    model = nn.Linear(512, 512)
    state = TrainState(model)
    committed: set[str] = set()
    for step in range(1, 13):
        saved(checkpointer, model, state, step)
        if step % 3 == 0 and (pid := writer_process.writer_pid()) is not None:
            time.sleep(rng.uniform(0, 0.05))  # somewhere in this commit, or after it
            os.kill(pid, signal.SIGKILL)
        problem = failure_of(checkpointer.wait)
        assert problem is None or "writer process" in problem
        names = {path.name for path in checkpointer.committed()}
        assert committed <= names, f"lost {committed - names}"
        committed = names
        assert assert_only_intact_checkpoints_and_the_newest_loads(tmp_path) == max(
            int(name.removeprefix("step-")) for name in names
        )


UNGUARDED_SCRIPT = """
import sys, torch
from pathlib import Path
from torch import nn
from hpc_elastic.train import Checkpointer, TrainState

print("top level ran", flush=True)  # no __main__ guard, as many training scripts
checkpointer = Checkpointer(Path("ckpt"), round=None, asynchronous=True, writer="process")
state = TrainState(nn.Linear(8, 8))
state.step = 1
checkpointer.save(state)
checkpointer.wait()
print("saved", [path.name for path in checkpointer.committed()], flush=True)
"""


def test_a_script_without_a_main_guard_is_not_run_again_by_the_writer(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(UNGUARDED_SCRIPT)
    result = subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("top level ran") == 1, result.stdout
    assert "saved ['step-00000001']" in result.stdout
