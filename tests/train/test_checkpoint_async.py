"""Asynchronous checkpoints: the copy is taken at save, the commit is crash-safe, errors surface.

One process (a world of one) exercises the real background worker and the real commit; the
two-rank behaviour (every rank raising a background failure at once) is in
``test_checkpoint_async_ranks.py``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_checkpoint import make_state, random_draws, train
from torch import nn

from hpc_elastic.errors import CheckpointError, UsageError
from hpc_elastic.train import Checkpointer, TrainState, background, preemption, verify
from hpc_elastic.train.checkpoint import snapshot

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_commit_left_behind() -> Iterator[None]:
    """Every test ends with no background commit in flight and no stop request pending."""
    yield
    background.wait_local()
    preemption._requested = None


def async_checkpointer(directory: Path, **settings: Any) -> Checkpointer:
    return Checkpointer(directory, round=None, asynchronous=True, **settings)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)


def parameters(state: TrainState) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in state.model.parameters()]


def test_an_asynchronous_save_resumes_bitwise_like_an_uninterrupted_run(tmp_path: Path) -> None:
    checkpointer = async_checkpointer(tmp_path)
    seed_everything(7)
    uninterrupted = make_state()
    train(uninterrupted, 3)
    train(uninterrupted, 4)
    expected_draws = random_draws()

    seed_everything(7)
    interrupted = make_state()
    train(interrupted, 3)
    assert checkpointer.save(interrupted) == tmp_path / "step-00000003"
    train(interrupted, 2)  # the loop goes on while the commit runs
    checkpointer.wait()

    resumed = make_state(seed=99)
    assert checkpointer.load(resumed) == tmp_path / "step-00000003"
    train(resumed, 4)
    assert resumed.step == uninterrupted.step
    for mine, theirs in zip(parameters(resumed), parameters(uninterrupted), strict=True):
        assert torch.equal(mine, theirs)
    assert random_draws() == expected_draws


def test_what_the_loop_changes_after_save_returns_is_not_in_the_checkpoint(
    tmp_path: Path,
) -> None:
    checkpointer = async_checkpointer(tmp_path)
    model = nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.fill_(1.0)
    state = TrainState(model, extras={"values": [torch.ones(2)]})
    checkpointer.save(state)
    with torch.no_grad():
        model.weight.fill_(2.0)
    state.extras["values"][0].fill_(2.0)
    checkpointer.wait()

    fresh = nn.Linear(3, 3)
    restored = TrainState(fresh, extras={})
    checkpointer.load(restored)
    assert torch.equal(fresh.weight, torch.ones(3, 3))
    assert torch.equal(restored.extras["values"][0], torch.ones(2))


def test_consecutive_asynchronous_saves_each_keep_their_own_values(tmp_path: Path) -> None:
    """The host buffers are reused from save to save; no checkpoint may see a later value."""
    checkpointer = async_checkpointer(tmp_path)
    model = nn.Linear(3, 3)
    state = TrainState(model)
    for step in range(1, 4):
        with torch.no_grad():
            model.weight.fill_(float(step))
        state.step = step
        checkpointer.save(state)
    checkpointer.wait()
    for checkpoint in checkpointer.committed():
        saved = torch.load(checkpoint / "state.pt", weights_only=True)
        assert torch.equal(saved["model"]["weight"], torch.full((3, 3), float(saved["step"])))


def test_a_snapshot_keeps_a_state_dicts_type_and_metadata() -> None:
    original = nn.BatchNorm1d(2).state_dict()
    copied = snapshot(original)
    assert type(copied) is type(original)
    assert copied._metadata == original._metadata  # type: ignore[attr-defined]
    assert all(copied[name] is not original[name] for name in original)


def test_a_failed_background_commit_is_raised_at_the_next_wait_then_cleared(
    tmp_path: Path,
) -> None:
    checkpointer = async_checkpointer(tmp_path)
    state = TrainState(nn.Linear(2, 2), extras={"hook": lambda: None})  # cannot be pickled
    checkpointer.save(state)
    with pytest.raises(CheckpointError, match=r"Could not write checkpoint step 0 .*pickle"):
        checkpointer.wait()
    assert not list(tmp_path.glob(".step-*")), "the failed staging was left behind"
    del state.extras["hook"]
    checkpointer.save(state)
    checkpointer.wait()
    assert [path.name for path in checkpointer.committed()] == ["step-00000000"]


def test_a_failed_background_commit_is_raised_at_the_next_save(tmp_path: Path) -> None:
    checkpointer = async_checkpointer(tmp_path)
    state = TrainState(nn.Linear(2, 2), extras={"hook": lambda: None})
    checkpointer.save(state)
    with pytest.raises(CheckpointError, match="pickle"):
        checkpointer.save(TrainState(nn.Linear(2, 2)))


def test_a_failed_background_commit_is_raised_at_the_next_should_stop(tmp_path: Path) -> None:
    checkpointer = async_checkpointer(tmp_path)
    checkpointer.save(TrainState(nn.Linear(2, 2), extras={"hook": lambda: None}))
    deadline = time.monotonic() + 60
    while not background.failed():  # the flag should_stop exchanges; wait for it to be set
        assert time.monotonic() < deadline, "the background commit never ended"
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match="pickle"):
        preemption.should_stop(1)
    assert preemption.should_stop(2) is False  # reported once


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every background commit at its start until the test opens the gate."""
    opened = threading.Event()
    real = Checkpointer._write_payload

    def held(self: Checkpointer, payload: dict[str, Any], step: int) -> Path:
        assert opened.wait(60), "the test never opened the gate"
        return real(self, payload, step)

    monkeypatch.setattr(Checkpointer, "_write_payload", held)
    return opened


def events_in(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_save_while_one_commits_is_skipped_with_an_event_when_asked(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("HPC_ELASTIC_EVENTS_FILE", str(events))
    checkpointer = async_checkpointer(tmp_path / "ckpt", when_busy="skip")
    state = TrainState(nn.Linear(2, 2))
    checkpointer.save(state)
    state.finish_step()
    assert checkpointer.save(state) is None
    gate.set()
    checkpointer.wait()
    assert [path.name for path in checkpointer.committed()] == ["step-00000000"]
    kinds = [(event["kind"], event["details"]["step"]) for event in events_in(events)]
    assert kinds == [("checkpoint_skipped", 1), ("checkpoint", 0)]


def test_a_save_while_one_commits_waits_for_it_by_default(
    tmp_path: Path, gate: threading.Event
) -> None:
    checkpointer = async_checkpointer(tmp_path)
    state = TrainState(nn.Linear(2, 2))
    checkpointer.save(state)
    state.finish_step()
    threading.Timer(0.2, gate.set).start()  # the second save can only return after this
    checkpointer.save(state)
    assert gate.is_set()
    checkpointer.wait()
    assert [path.name for path in checkpointer.committed()] == ["step-00000001", "step-00000000"]


def test_should_stop_waits_for_the_commit_in_flight_before_it_says_stop(
    tmp_path: Path, gate: threading.Event
) -> None:
    checkpointer = async_checkpointer(tmp_path)
    checkpointer.save(TrainState(nn.Linear(2, 2)))
    preemption.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGUSR1)
    threading.Timer(0.2, gate.set).start()
    assert preemption.should_stop(0) is True
    assert [path.name for path in checkpointer.committed()] == ["step-00000000"]
    assert not background.busy()


def test_a_synchronous_save_after_an_asynchronous_one_waits_for_it(
    tmp_path: Path, gate: threading.Event
) -> None:
    state = TrainState(nn.Linear(2, 2))
    async_checkpointer(tmp_path).save(state)
    state.finish_step()
    threading.Timer(0.2, gate.set).start()
    Checkpointer(tmp_path, round=None).save(state)
    assert [path.name for path in Checkpointer(tmp_path).committed()] == [
        "step-00000001",
        "step-00000000",
    ]


@pytest.mark.parametrize(
    ("name", "value", "complaint"),
    [
        ("HPC_ELASTIC_CHECKPOINT_ASYNC", "maybe", "is not a yes or no"),
        ("HPC_ELASTIC_CHECKPOINT_KEEP", "three", "is not a whole number"),
        ("HPC_ELASTIC_CHECKPOINT_KEEP_EVERY", "-1", "is not a whole number"),
    ],
)
def test_a_bad_setting_in_the_environment_is_one_sentence_that_quotes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str, complaint: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=f"{name}='{value}' {complaint}"):
        Checkpointer(tmp_path)


def test_the_settings_come_from_the_agents_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HPC_ELASTIC_CHECKPOINT_ASYNC", "1")
    monkeypatch.setenv("HPC_ELASTIC_CHECKPOINT_WHEN_BUSY", "skip")
    monkeypatch.setenv("HPC_ELASTIC_CHECKPOINT_KEEP", "5")
    monkeypatch.setenv("HPC_ELASTIC_CHECKPOINT_KEEP_EVERY", "100")
    checkpointer = Checkpointer(tmp_path)
    assert (checkpointer.asynchronous, checkpointer.when_busy) == (True, "skip")
    assert (checkpointer.keep, checkpointer.keep_every) == (5, 100)


def test_an_unknown_busy_policy_is_refused_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="when_busy='later' is not one of wait, skip"):
        Checkpointer(tmp_path, when_busy="later")


CRASHING_SAVER = """
import sys, torch
from pathlib import Path
from torch import nn
from hpc_elastic.train import Checkpointer, TrainState

checkpointer = Checkpointer(Path(sys.argv[1]), keep=2, round=None, asynchronous=True)
model = nn.Linear(256, 256)
state = TrainState(model)
start = checkpointer.load(state)
step = state.step
while True:
    step += 1
    with torch.no_grad():
        model.weight.fill_(float(step))
    state.step = step
    checkpointer.save(state)
    checkpointer.wait()
    print(step, flush=True)
"""


def run_until_killed(directory: Path, rng: random.Random) -> int:
    """Run the saver; SIGKILL it at a random moment; return the last step it saw committed."""
    saver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CRASHING_SAVER), str(directory)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert saver.stdout is not None
    first = saver.stdout.readline().strip()
    assert first.isdigit(), f"the saver stopped before its first commit: {first!r}"
    # Kill after a random number of further commits plus a random slice of the next one.
    for _ in range(rng.randrange(3)):
        saver.stdout.readline()
    time.sleep(rng.uniform(0, 0.05))
    saver.send_signal(signal.SIGKILL)
    seen = [first] + [line.strip() for line in saver.stdout.read().splitlines()]
    saver.wait()
    return max(int(step) for step in seen if step.isdigit())


def test_sigkill_at_random_points_of_background_commits_loses_nothing_committed(
    tmp_path: Path,
) -> None:
    rng = random.Random(15)
    for _ in range(6):
        last_committed = run_until_killed(tmp_path, rng)
        for checkpoint in Checkpointer(tmp_path).committed():
            assert verify(checkpoint) is None, f"{checkpoint.name} is committed but not intact"
        fresh = nn.Linear(256, 256)
        restored = TrainState(fresh)
        Checkpointer(tmp_path, round=None).load(restored)
        assert restored.step >= last_committed
        assert torch.equal(fresh.weight, torch.full((256, 256), float(restored.step)))


def test_a_script_that_ends_without_waiting_still_commits_and_reports_a_failure(
    tmp_path: Path,
) -> None:
    script = textwrap.dedent(
        """
        import sys, torch
        from pathlib import Path
        from hpc_elastic.train import Checkpointer, TrainState
        checkpointer = Checkpointer(Path(sys.argv[1]), round=None, asynchronous=True)
        checkpointer.save(TrainState(torch.nn.Linear(2, 2)))
        checkpointer.wait()
        state = TrainState(torch.nn.Linear(2, 2), extras={"hook": lambda: None})
        state.step = 1
        checkpointer.save(state)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "The last checkpoint was not committed: Could not write checkpoint step 1" in (
        result.stderr
    ), result.stderr[-2000:]
    assert [path.name for path in Checkpointer(tmp_path).committed()] == ["step-00000000"]
