"""The user's checkpoint key: every job of a user resumes from the checkpoints of the user's
earlier jobs with no setting at all, nobody else's checkpoint loads, and the workers hold the
key derived from the user's secret, never the secret (docs/security.md, "Checkpoint keys")."""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from cluster import REPO
from slurm_fake import mocked_slurm, mocked_submit

from hpc_elastic import api, checkpoint_key
from hpc_elastic.contract import SECRET_FILE_ENV, USER_SECRET_FILE_ENV
from hpc_elastic.errors import CheckpointError, UsageError
from hpc_elastic.jobdir import make_private_dir, write_private
from hpc_elastic.rendezvous.secret import read_secret_file

if TYPE_CHECKING:
    import torch

    from hpc_elastic.train import TrainState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def new_job(log_dir: Path, name: str) -> Path:
    """A job directory as ``submit`` and ``run`` write it: 0700, a fresh job secret, and the
    user's checkpoint key from the user's secret in the environment."""
    job = log_dir / name
    make_private_dir(job)
    write_private(job / "secret", secrets.token_hex(32), exclusive=True)
    checkpoint_key.write_key(job / "checkpoint-key")
    return job


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's user secret (made on first use) and no job named in the environment."""
    path = tmp_path / "home" / ".hpc-elastic" / "user-secret"
    monkeypatch.setenv(USER_SECRET_FILE_ENV, str(path))
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv("HPC_ELASTIC_JOB_DIR", raising=False)
    return path


def in_job(monkeypatch: pytest.MonkeyPatch, job: Path) -> None:
    """What the agent gives its workers: the job directory, nothing else about keys."""
    monkeypatch.setenv("HPC_ELASTIC_JOB_DIR", str(job))


def linear(value: float) -> tuple[TrainState, torch.nn.Linear]:
    import torch  # noqa: PLC0415

    from hpc_elastic.train import TrainState  # noqa: PLC0415

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    return TrainState(model), model


def test_a_second_job_of_the_same_user_resumes_from_the_first_jobs_checkpoints_unasked(
    tmp_path: Path, user: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch  # noqa: PLC0415

    from hpc_elastic.train import Checkpointer  # noqa: PLC0415
    from hpc_elastic.train.sharded import load_sharded, save_sharded  # noqa: PLC0415

    shared, local = tmp_path / "checkpoints", tmp_path / "node-local"
    in_job(monkeypatch, new_job(tmp_path / "runs", "first"))
    state, _ = linear(1.0)
    state.step = 10
    Checkpointer(shared, round=None, local_directory=local).save(state)
    save_sharded({"weight": torch.arange(4.0), "step": 10}, 10, tmp_path / "sharded")
    assert user.stat().st_mode & 0o777 == 0o600  # made on first use, the user's alone

    second = new_job(tmp_path / "runs", "second")  # a new job secret, the same user
    in_job(monkeypatch, second)
    assert read_secret_file(second / "secret") != read_secret_file(tmp_path / "runs/first/secret")
    for local_tier in (None, local):
        restored, model = linear(0.0)
        resumed = Checkpointer(shared, round=None, local_directory=local_tier)
        assert resumed.load(restored) is not None
        assert restored.step == 10
        assert torch.equal(model.weight, torch.full((2, 2), 1.0))
    sharded = {"weight": torch.zeros(4), "step": 0}
    assert load_sharded(sharded, tmp_path / "sharded") is not None
    assert sharded["step"] == 10


def test_a_job_of_another_user_secret_refuses_the_checkpoints(
    tmp_path: Path, user: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key is the user's: a job whose user secret differs (another user, or a user secret
    made anew) holds no key that verifies them."""
    from hpc_elastic.train import Checkpointer  # noqa: PLC0415

    in_job(monkeypatch, new_job(tmp_path / "runs", "ours"))
    state, _ = linear(1.0)
    state.step = 10
    Checkpointer(tmp_path / "checkpoints", round=None).save(state)

    monkeypatch.setenv(USER_SECRET_FILE_ENV, str(tmp_path / "another-user-secret"))
    in_job(monkeypatch, new_job(tmp_path / "runs", "theirs"))
    with pytest.raises(CheckpointError) as refused:
        Checkpointer(tmp_path / "checkpoints", round=None).load(linear(0.0)[0])
    assert "its manifest's seal matches no key this job holds" in str(refused.value)


def test_the_key_is_derived_from_the_user_secret_and_is_not_the_secret(
    tmp_path: Path, user: Path
) -> None:
    job = new_job(tmp_path / "runs", "job")
    key = read_secret_file(job / "checkpoint-key")
    secret = read_secret_file(user)
    assert key == checkpoint_key.derive(secret)
    assert secret not in key
    assert len(key) == 64
    assert (job / "checkpoint-key").stat().st_mode & 0o777 == 0o600
    assert checkpoint_key.derive(secret + "x") != key


def test_without_a_user_secret_a_job_warns_once_and_seals_with_its_own_secret(
    tmp_path: Path, user: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A home directory nobody can write into (here: its place is a file): the job still runs,
    sealed with its own secret; a later job loads those checkpoints once told that secret."""
    from hpc_elastic.train import Checkpointer  # noqa: PLC0415

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv(USER_SECRET_FILE_ENV, str(blocked / "user-secret"))
    with caplog.at_level(logging.WARNING, logger="hpc_elastic"):
        first = new_job(tmp_path / "runs", "first")
    assert not (first / "checkpoint-key").exists()
    [warning] = [record.getMessage() for record in caplog.records]
    assert warning.startswith(f"No user secret at '{blocked / 'user-secret'}' (File exists)")
    assert f"{SECRET_FILE_ENV}={first / 'secret'}" in warning
    in_job(monkeypatch, first)
    state, _ = linear(1.0)
    state.step = 10
    Checkpointer(tmp_path / "checkpoints", round=None).save(state)

    monkeypatch.setenv(USER_SECRET_FILE_ENV, str(user))
    in_job(monkeypatch, new_job(tmp_path / "runs", "second"))
    with pytest.raises(CheckpointError, match=f"set {SECRET_FILE_ENV} to that job's secret file"):
        Checkpointer(tmp_path / "checkpoints", round=None).load(linear(0.0)[0])
    monkeypatch.setenv(SECRET_FILE_ENV, str(first / "secret"))
    restored, _ = linear(0.0)
    assert Checkpointer(tmp_path / "checkpoints", round=None).load(restored) is not None
    assert restored.step == 10


@pytest.mark.parametrize("flaw", ["readable by others", "a link", "empty"])
def test_a_user_secret_that_is_not_the_users_alone_stops_submit_and_writes_nothing(
    tmp_path: Path, user: Path, monkeypatch: pytest.MonkeyPatch, flaw: str
) -> None:
    real = tmp_path / "real-secret"
    write_private(real, "s3cret\n")
    user.parent.mkdir(parents=True)
    if flaw == "a link":
        user.symlink_to(real)
    else:
        user.write_text("" if flaw == "empty" else "s3cret\n")
        user.chmod(0o644 if flaw == "readable by others" else 0o600)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    plan = api.plan_job(
        "train.py", options={"zk": "127.0.0.1:2181", "log_dir": str(tmp_path / "runs")}, config={}
    )
    with (
        mocked_slurm() as fake,  # told nothing: any Slurm call fails the test
        pytest.raises(UsageError, match=f"^ZooKeeper secret file '{user}' ") as refused,
    ):
        api.send(plan)
    assert "\n" not in str(refused.value)
    assert fake.submitted == []
    assert not plan.job_dir.exists()


def test_submit_writes_the_users_key_beside_the_jobs_secret(
    tmp_path: Path, user: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    plan = api.plan_job(
        "train.py", options={"zk": "127.0.0.1:2181", "log_dir": str(tmp_path / "runs")}, config={}
    )
    with mocked_submit():
        api.send(plan)
    key = plan.job_dir / "checkpoint-key"
    assert key.stat().st_mode & 0o777 == 0o600
    assert read_secret_file(key) == checkpoint_key.derive(read_secret_file(user))
    assert read_secret_file(user) not in plan.script.text


RESUMER = """\
import json, os, sys
import torch
from hpc_elastic.train import Checkpointer, TrainState
state = TrainState(torch.nn.Linear(2, 2))
checkpointer = Checkpointer.at()
checkpointer.load(state)
with open(sys.argv[1], "w") as out:
    json.dump({"resumed_at": state.step, "env": dict(os.environ)}, out)
state.step += 3
checkpointer.save(state)
"""


def test_a_second_local_run_resumes_from_the_first_and_its_workers_never_see_the_user_secret(
    tmp_path: Path, user: Path
) -> None:
    (tmp_path / "resumer.py").write_text(RESUMER)
    checkpoints = tmp_path / "checkpoints"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        USER_SECRET_FILE_ENV: str(user),
        "HPC_ELASTIC_CHECKPOINT_DIR": str(checkpoints),
    }
    seen = []
    for run in ("first", "second"):
        report = tmp_path / f"{run}.json"
        result = subprocess.run(
            [sys.executable, "-m", "hpc_elastic", "run", "--nodes=1", "--no-prewarm",
             "resumer.py", str(report)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        seen.append(json.loads(report.read_text()))
    assert [report["resumed_at"] for report in seen] == [0, 3]
    assert sorted(path.name for path in checkpoints.iterdir() if path.name.startswith("step")) == [
        "step-00000003",
        "step-00000006",
    ]
    secret = read_secret_file(user)
    for report in seen:
        worker_env = report["env"]
        assert USER_SECRET_FILE_ENV not in worker_env
        assert not [name for name, value in worker_env.items() if secret in value]
        assert str(user) not in json.dumps(worker_env)
