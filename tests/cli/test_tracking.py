"""Tracker continuity: the variables every worker gets so a requeued job continues one run."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from hpc_elastic.submission import new_run_id
from hpc_elastic.tracking import WANDB_ID_MAX, tracker_env, wandb_run_id


def test_every_worker_gets_the_run_id_and_wandb_resumes_the_same_run() -> None:
    assert tracker_env("train-20261201-010203-ab12", {}) == {
        "HPC_ELASTIC_RUN_ID": "train-20261201-010203-ab12",
        "WANDB_RUN_ID": "train-20261201-010203-ab12",
        "WANDB_RESUME": "allow",
    }


def test_the_users_own_wandb_settings_win() -> None:
    added = tracker_env("run1", {"WANDB_RUN_ID": "mine", "WANDB_RESUME": "must"})
    assert added == {"HPC_ELASTIC_RUN_ID": "run1"}


def test_a_long_or_dotted_run_id_becomes_a_stable_plain_wandb_id() -> None:
    long_id = new_run_id("a.very-long_job." + "x" * 47, datetime(2026, 12, 1, 1, 2, 3))
    first, again = wandb_run_id(long_id), wandb_run_id(long_id)
    assert first == again
    assert len(first) <= WANDB_ID_MAX
    assert re.fullmatch(r"[A-Za-z0-9_-]+", first)
    other = new_run_id("a.very-long_job." + "x" * 47, datetime(2026, 12, 1, 1, 2, 3))
    assert wandb_run_id(other) != first  # the random suffix still tells two jobs apart


def test_a_requeued_run_writes_on_into_the_same_tracker_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "examples"))
    import tracker_run  # noqa: PLC0415

    monkeypatch.setenv("HPC_ELASTIC_RUN_ID", "train-20261201-010203-ab12")
    monkeypatch.setenv("RANK", "0")
    tracker_run.main(tmp_path, 4)  # the first allocation, preempted after step 3
    tracker_run.main(tmp_path, 8, start=4)  # the requeued slot resumes at step 4
    assert [path.name for path in tmp_path.iterdir()] == ["train-20261201-010203-ab12"]
    lines = (tmp_path / "train-20261201-010203-ab12" / "scalars.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(8))
