"""Checkpoints in S3: against a real S3-compatible HTTP server (moto's), not an in-process mock.

The fixture starts ``python -m moto.server`` on 127.0.0.1 and points the AWS client at it the
way a user would point it at any S3-compatible store: ``AWS_ENDPOINT_URL`` and credentials in
the environment. s3fs and moto[server] are in the dev extra: without them these tests fail
(never skip), as every test must run in CI.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from hpc_elastic.errors import CheckpointFencedError
from hpc_elastic.rendezvous.testing import free_ports
from hpc_elastic.train import Checkpointer, TrainState, background
from hpc_elastic.train.checkpoint import ObjectCheckpointer
from hpc_elastic.train.storage import ObjectStore


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, "the S3 server exited at start"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the S3 server never listened"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """A fresh bucket per test; the client finds server and credentials in the environment."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    name = request.node.name.replace("_", "-")[:50].strip("-").lower()
    ObjectStore(f"s3://{name}").fs.mkdir(name)
    return f"s3://{name}/run"


def filled_state(value: float) -> tuple[TrainState, nn.Linear]:
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(value)
    return TrainState(model), model


def test_a_checkpoint_round_trips_through_s3(bucket: str) -> None:
    checkpointer = Checkpointer.at(bucket, keep=2)
    assert isinstance(checkpointer, ObjectCheckpointer)
    state, _ = filled_state(1.5)
    state.step = 4
    state.extras["note"] = "s3"
    checkpointer.save(state)

    restored, model = filled_state(0.0)
    assert Checkpointer.at(bucket).load(restored) is not None
    assert restored.step == 4
    assert restored.extras["note"] == "s3"
    assert torch.equal(model.weight, torch.full((4, 4), 1.5))


def test_an_asynchronous_save_to_s3_commits_behind_the_loop(bucket: str) -> None:
    checkpointer = ObjectCheckpointer.for_url(bucket, round=None, asynchronous=True)
    state, model = filled_state(2.0)
    state.step = 9
    checkpointer.save(state)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    checkpointer.wait()
    restored, fresh = filled_state(0.0)
    checkpointer.load(restored)
    assert torch.equal(fresh.weight, torch.full((4, 4), 2.0))
    background.wait_local()


def test_a_corrupt_object_falls_back_to_the_previous_checkpoint(
    bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    checkpointer = ObjectCheckpointer.for_url(bucket, round=None)
    for step, value in ((1, 1.0), (2, 2.0)):
        state, _ = filled_state(value)
        state.step = step
        checkpointer.save(state)
    store = checkpointer.store
    key = store.key("step-00000002", "state.pt")
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the CRC-32 sees it
    store.put(key, bytes(data))

    restored, model = filled_state(0.0)
    assert checkpointer.load(restored) == checkpointer.directory / "step-00000001"
    assert torch.equal(model.weight, torch.full((4, 4), 1.0))
    assert "step-00000002' is unusable" in caplog.text


def test_a_checkpoint_planted_in_the_bucket_without_the_jobs_seal_is_never_loaded(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone who may write the bucket can upload a whole checkpoint; only the job's secret
    makes a manifest that verifies (hpc_elastic.train._integrity)."""
    checkpointer = ObjectCheckpointer.for_url(bucket, round=None)
    state, _ = filled_state(666.0)
    state.step = 190
    checkpointer.save(state)  # no secret in the environment: an unsealed, planted checkpoint
    secret = tmp_path / "job-secret"
    secret.write_text("the-jobs-own-secret")
    secret.chmod(0o600)
    monkeypatch.setenv("HPC_ELASTIC_SECRET_FILE", str(secret))
    state, _ = filled_state(1.0)
    state.step = 10
    checkpointer.save(state)  # the job's own: sealed
    manifest = json.loads(
        checkpointer.store.get(checkpointer.store.key("step-00000010", "manifest.json"))
    )
    assert set(manifest["seal"]) == {"hmac_sha256"}

    restored, model = filled_state(0.0)
    assert checkpointer.load(restored) == checkpointer.directory / "step-00000010"
    assert restored.step == 10
    assert torch.equal(model.weight, torch.full((4, 4), 1.0))


def test_an_upload_without_its_manifest_is_never_trusted_and_is_cleaned_up(bucket: str) -> None:
    checkpointer = ObjectCheckpointer.for_url(bucket, round=None)
    state, _ = filled_state(1.0)
    state.step = 1
    checkpointer.save(state)
    store = checkpointer.store
    store.put(store.key("step-00000005", "state.pt"), b"half an upload")  # killed writer
    assert [path.name for path in checkpointer.committed()] == ["step-00000001"]
    restored, _ = filled_state(0.0)
    assert checkpointer.load(restored) == checkpointer.directory / "step-00000001"
    state.step = 2
    checkpointer.save(state)
    assert "step-00000005" not in store.names()


def test_retention_and_a_resaved_step_work_on_s3(bucket: str) -> None:
    checkpointer = ObjectCheckpointer.for_url(bucket, round=None, keep=2, keep_every=2)
    state, _ = filled_state(1.0)
    for step in range(1, 6):
        state.step = step
        checkpointer.save(state)
    checkpointer.save(state)  # step 5 again: a higher version replaces it
    names = [path.name for path in checkpointer.committed()]
    assert names == ["step-00000005.1", "step-00000004", "step-00000002"]


def test_a_stale_round_cannot_commit_to_s3_after_a_newer_one_loaded(bucket: str) -> None:
    stale = ObjectCheckpointer.for_url(bucket, round=3)
    ObjectCheckpointer.for_url(bucket, round=4).choose()
    state, _ = filled_state(1.0)
    with pytest.raises(CheckpointFencedError, match="Round 3 may not commit step 0"):
        stale.save(state)
