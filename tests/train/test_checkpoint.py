"""Checkpoints: a full round trip, keep-K, fallback past corruption, and a crash mid-save."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpc_elastic.errors import CheckpointError, CheckpointFencedError, UsageError
from hpc_elastic.train import Checkpointer, ElasticSampler, TrainState, load, save, verify
from hpc_elastic.train.checkpoint import STATE_FILE, default_directory, fenced, may_remove

ROOT = Path(__file__).resolve().parents[2]


def make_state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    sampler = ElasticSampler(64, 8, seed=3, rank=0, world_size=1)
    return TrainState(model, optimizer, scheduler, sampler, extras={"best": 1.5})


def train(state: TrainState, steps: int) -> None:
    assert state.optimizer is not None
    assert state.scheduler is not None
    for _ in range(steps):
        state.optimizer.zero_grad()
        torch.autograd.backward(state.model(torch.randn(2, 4)).sum())
        state.optimizer.step()
        state.scheduler.step()
        state.finish_step()


def random_draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(()).item()


def test_round_trip_restores_everything(tmp_path: Path) -> None:
    original = make_state()
    train(original, 3)
    save(original, tmp_path)
    expected_draws = random_draws()
    train(original, 2)

    restored = make_state(seed=1)
    assert load(restored, tmp_path) == tmp_path / "step-00000003"
    assert random_draws() == expected_draws
    assert restored.step == 3
    assert restored.sampler is not None
    assert restored.sampler.position == 24
    assert restored.extras == {"best": 1.5}
    train(restored, 2)
    for mine, theirs in zip(restored.model.parameters(), original.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_nothing_to_resume_returns_none(tmp_path: Path) -> None:
    assert load(make_state(), tmp_path / "missing") is None


def test_keeps_only_the_newest(tmp_path: Path) -> None:
    state = make_state()
    checkpointer = Checkpointer(tmp_path, keep=2)
    for _ in range(4):
        train(state, 1)
        checkpointer.save(state)
    assert [path.name for path in checkpointer.committed()] == ["step-00000004", "step-00000003"]


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    state = make_state()
    save(state, tmp_path)
    state.extras["best"] = 0.5
    save(state, tmp_path)
    restored = make_state()
    load(restored, tmp_path)
    assert restored.extras == {"best": 0.5}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000000"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest"])
def test_corrupt_newest_falls_back_with_a_warning(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = make_state()
    for _ in range(2):
        train(state, 1)
        save(state, tmp_path)
    newest = tmp_path / "step-00000002"
    data = (newest / STATE_FILE).read_bytes()
    if damage == "truncate":
        (newest / STATE_FILE).write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        middle = len(data) // 2
        (newest / STATE_FILE).write_bytes(
            data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :]
        )
    else:
        (newest / "manifest.json").unlink()

    restored = make_state()
    with caplog.at_level(logging.WARNING):
        assert load(restored, tmp_path) == tmp_path / "step-00000001"
    assert restored.step == 1
    assert "step-00000002" in caplog.text
    assert "falling back" in caplog.text
    assert verify(newest) is not None


def test_all_corrupt_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    state = make_state()
    save(state, tmp_path)
    (tmp_path / "step-00000000" / STATE_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="No intact checkpoint"):
        load(make_state(), tmp_path)


def test_default_directory_follows_the_agent_then_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPC_ELASTIC_CHECKPOINT_DIR", str(tmp_path / "job"))
    assert default_directory() == tmp_path / "job"
    monkeypatch.delenv("HPC_ELASTIC_CHECKPOINT_DIR")
    monkeypatch.chdir(tmp_path)
    assert default_directory() == tmp_path / "checkpoints"


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("single_rank_group")
def test_ddp_checkpoint_loads_into_a_bare_model(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    save(TrainState(DistributedDataParallel(model)), tmp_path)
    bare = nn.Linear(3, 2)
    load(TrainState(bare), tmp_path)
    assert torch.equal(bare.weight, model.weight)


CRASHING_SAVER = """
import sys, torch
from hpc_elastic.train import TrainState, save
state = TrainState(torch.nn.Linear(1, 1))
save(state, sys.argv[1])
state.model = torch.nn.Linear(4096, 8192)
state.step = 1
print("committed", flush=True)
save(state, sys.argv[1])
"""


def test_sigkill_during_save_never_leaves_a_bad_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    saver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CRASHING_SAVER), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert saver.stdout is not None
    assert saver.stdout.readline().strip() == "committed"
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".step-00000001.tmp-*/" + STATE_FILE)):
        assert saver.poll() is None, "the saver exited before it was killed"
        assert time.monotonic() < deadline, "the save never started"
        time.sleep(0.001)
    saver.send_signal(signal.SIGKILL)
    saver.wait()

    restored = TrainState(nn.Linear(1, 1))
    assert load(restored, tmp_path) == tmp_path / "step-00000000"
    save(restored, tmp_path)
    assert not list(tmp_path.glob(".step-*")), "the half-written checkpoint was not cleaned up"


class SimulatedCrash(BaseException):
    """Raised in place of a rename: like a crash, nothing after it runs (not even except
    Exception clean-ups)."""


def crash_at_rename(monkeypatch: pytest.MonkeyPatch, crash_at: int) -> list[str]:
    """Make the ``crash_at``-th ``os.rename`` from now on raise; returns the renames seen."""
    real_rename = os.rename
    seen: list[str] = []

    def rename(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        seen.append(f"{Path(source).name} -> {Path(target).name}")
        if len(seen) == crash_at:
            raise SimulatedCrash(seen[-1])
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename)
    return seen


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_a_crash_at_any_rename_of_a_resaved_step_leaves_it_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: int
) -> None:
    state = make_state()
    train(state, 2)
    save(state, tmp_path, keep=1)
    state.extras["best"] = 0.5
    seen = crash_at_rename(monkeypatch, crash_at)
    with pytest.raises(SimulatedCrash):
        save(state, tmp_path, keep=1)
    monkeypatch.undo()
    assert len(seen) == crash_at, "the re-save did not reach that rename"

    restored = make_state()
    assert load(restored, tmp_path) is not None, f"no committed checkpoint after {seen}"
    assert restored.step == 2
    assert restored.extras["best"] in (1.5, 0.5)
    state.extras["best"] = 0.25
    save(state, tmp_path, keep=1)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000002"]
    load(restored, tmp_path)
    assert restored.extras["best"] == 0.25


def test_a_resave_takes_three_renames_so_the_crash_test_covers_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = make_state()
    save(state, tmp_path)
    seen = crash_at_rename(monkeypatch, 0)
    save(state, tmp_path)
    assert len(seen) == 3, seen


def test_a_stale_round_cannot_commit_after_a_newer_round_did(tmp_path: Path) -> None:
    stale, current = Checkpointer(tmp_path, round=3), Checkpointer(tmp_path, round=4)
    state = make_state()
    train(state, 1)
    stale.save(state)
    train(state, 1)
    state.extras["best"] = 0.5
    current.save(state)
    state.extras["best"] = 9.0
    with pytest.raises(CheckpointFencedError, match=r"Round 3 .* round 4"):
        stale.save(state)
    train(state, 1)
    with pytest.raises(CheckpointFencedError, match="Round 3"):
        stale.save(state)

    assert [path.name for path in current.committed()] == ["step-00000002", "step-00000001"]
    restored = make_state()
    assert current.load(restored) == tmp_path / "step-00000002"
    assert restored.extras["best"] == 0.5
    assert not list(tmp_path.glob(".step-*"))


def test_a_stale_round_never_removes_the_newer_rounds_staging(tmp_path: Path) -> None:
    stale, current = Checkpointer(tmp_path, round=3), Checkpointer(tmp_path, round=4)
    state = make_state()
    stale_staging = stale.prepare_staging(1)
    staging = current.prepare_staging(1)
    assert not stale_staging.exists(), "round 4 may remove the older round's staging"
    (staging / STATE_FILE).write_bytes(b"being written by round 4")
    with pytest.raises(CheckpointFencedError, match="Round 3"):
        stale.save(state)
    with pytest.raises(CheckpointFencedError, match="Round 3"):
        stale.commit(stale_staging, 1, 1, {})
    assert (staging / STATE_FILE).read_bytes() == b"being written by round 4"

    train(state, 1)
    assert current.save(state) == tmp_path / "step-00000001"
    assert not list(tmp_path.glob(".step-*"))


def test_a_stale_writer_whose_staging_a_newer_round_removed_is_told_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale, current = Checkpointer(tmp_path, round=3), Checkpointer(tmp_path, round=4)
    real_save = torch.save
    newer: list[Path] = []

    def newer_round_starts_meanwhile(payload: object, path: Path) -> None:
        newer.append(current.prepare_staging(0))
        real_save(payload, path)

    monkeypatch.setattr(torch, "save", newer_round_starts_meanwhile)
    with pytest.raises(CheckpointFencedError, match="Round 3 may not commit step 0"):
        stale.save(make_state())
    assert list(tmp_path.glob(".step-*")) == newer, "the newer round's staging must stay"


def test_a_newer_round_fences_the_older_one_from_the_moment_it_loads(tmp_path: Path) -> None:
    stale, current = Checkpointer(tmp_path, round=3), Checkpointer(tmp_path, round=4)
    state = make_state()
    stale.save(state)
    assert current.load(make_state()) == tmp_path / "step-00000000"
    train(state, 1)
    with pytest.raises(CheckpointFencedError, match="Round 3 may not commit step 1"):
        stale.save(state)
    with pytest.raises(CheckpointFencedError, match="Round 3 may not load"):
        stale.load(make_state())
    assert [path.name for path in current.committed()] == ["step-00000000"]


def test_a_new_job_resuming_from_the_directory_counts_its_rounds_afresh(tmp_path: Path) -> None:
    state = make_state()
    Checkpointer(tmp_path, round=9, job="first").save(state)
    train(state, 1)
    Checkpointer(tmp_path, round=1, job="second").save(state)
    train(state, 1)
    Checkpointer(tmp_path, round=2, job="second").save(state)
    with pytest.raises(CheckpointFencedError, match="Round 1 may not commit step 2"):
        Checkpointer(tmp_path, round=1, job="second").save(state)
    assert load(make_state(), tmp_path) == tmp_path / "step-00000002"


def test_a_writer_without_a_round_is_never_fenced(tmp_path: Path) -> None:
    state = make_state()
    Checkpointer(tmp_path, round=4).save(state)
    train(state, 1)
    assert Checkpointer(tmp_path, round=None).save(state) == tmp_path / "step-00000001"


@pytest.mark.parametrize(
    ("mine", "newest", "refused"), [(3, 4, True), (4, 4, False), (5, 4, False), (3, None, False)]
)
def test_only_a_round_older_than_the_newest_is_fenced(
    mine: int, newest: int | None, refused: bool
) -> None:
    assert fenced(mine, newest) is refused


@pytest.mark.parametrize(
    ("leftover", "mine", "removed"),
    [
        (3, 4, True),
        (4, 4, True),
        (5, 4, False),
        (None, 4, True),
        (None, None, True),
        (4, None, False),
    ],
)
def test_a_writer_removes_only_its_own_or_older_rounds_leftovers(
    leftover: int | None, mine: int | None, removed: bool
) -> None:
    assert may_remove(leftover, mine) is removed


def test_the_round_comes_from_the_agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPC_ELASTIC_ROUND", "7")
    assert Checkpointer.at(tmp_path).round == 7
    monkeypatch.delenv("HPC_ELASTIC_ROUND")
    assert Checkpointer.at(tmp_path).round is None
    monkeypatch.setenv("HPC_ELASTIC_ROUND", "seven")
    with pytest.raises(UsageError, match="'seven'"):
        Checkpointer.at(tmp_path)
