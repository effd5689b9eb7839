"""Retention: the newest ``keep`` steps plus every ``keep_every``-th, never one being read."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from hpc_elastic.errors import CheckpointError
from hpc_elastic.train import Checkpointer, TrainState, reading
from hpc_elastic.train.checkpoint import remove_unless_read, retained


def save_steps(checkpointer: Checkpointer, steps: range) -> None:
    state = TrainState(nn.Linear(2, 2))
    for step in steps:
        state.step = step
        checkpointer.save(state)


def names(checkpointer: Checkpointer) -> list[str]:
    return [path.name for path in checkpointer.committed()]


@pytest.mark.parametrize(
    ("steps", "keep", "keep_every", "kept"),
    [
        ([10, 20, 30, 40], 2, 0, {30, 40}),
        ([10, 20, 30, 40, 50], 1, 20, {20, 40, 50}),
        ([0, 5, 10, 15], 1, 10, {10, 15}),  # step 0 is not a K-th step worth keeping
        ([7], 1, 0, {7}),
        ([], 3, 5, set()),
    ],
)
def test_retention_keeps_the_newest_and_every_kth_step(
    steps: list[int], keep: int, keep_every: int, kept: set[int]
) -> None:
    assert retained(steps, keep, keep_every) == kept


def test_the_newest_step_is_always_retained_whatever_the_policy() -> None:
    for keep in range(1, 4):
        for keep_every in range(0, 4):
            assert 13 in retained([1, 2, 3, 13], keep, keep_every)


def test_saving_applies_keep_and_keep_every(tmp_path: Path) -> None:
    checkpointer = Checkpointer(tmp_path, keep=2, keep_every=3, round=None)
    save_steps(checkpointer, range(1, 9))
    assert names(checkpointer) == [
        "step-00000008",
        "step-00000007",
        "step-00000006",
        "step-00000003",
    ]


def test_a_checkpoint_a_reader_holds_open_is_not_deleted_until_released(tmp_path: Path) -> None:
    checkpointer = Checkpointer(tmp_path, keep=1, round=None)
    save_steps(checkpointer, range(1, 2))
    with reading(tmp_path / "step-00000001"):
        save_steps(checkpointer, range(2, 4))
        assert names(checkpointer) == ["step-00000003", "step-00000001"]
    save_steps(checkpointer, range(4, 5))
    assert names(checkpointer) == ["step-00000004"]


def test_a_reader_lock_makes_deletion_skip_rather_than_wait(tmp_path: Path) -> None:
    checkpointer = Checkpointer(tmp_path, round=None)
    save_steps(checkpointer, range(1, 2))
    with reading(tmp_path / "step-00000001"), reading(tmp_path / "step-00000001"):
        assert remove_unless_read(tmp_path / "step-00000001") is False
    assert remove_unless_read(tmp_path / "step-00000001") is True
    assert names(checkpointer) == []


def test_a_negative_keep_every_is_refused_in_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep_every=-2 is negative; use 0"):
        Checkpointer(tmp_path, keep_every=-2)
