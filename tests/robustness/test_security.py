"""Security: the job's znodes keep other clients out, the secret stays secret, the job's files
are private, nothing on the wire or in a planted checkpoint is unpickled, and the workers' store
stays where the site wants it. docs/security.md has the threat model, one row per test here.
"""

from __future__ import annotations

import ast
import os
import socket
import subprocess
from collections.abc import Iterator
from datetime import datetime
from functools import partial
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster import REPO, Cluster, wait_until
from faults import submit
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NotEmptyError
from ranks import LEAVE, torchrun
from slurm_fake import mocked_submit

from hpc_elastic import cli, events
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.zookeeper import ZooKeeperAddress, connect
from hpc_elastic.spec import NodeRange
from hpc_elastic.submission import new_run_id
from hpc_elastic.train.checkpoint import Checkpointer

SECRET = "the-job-secret-0123456789abcdefghijklmnopqrstuv"
PACKAGE = REPO / "hpc_elastic"


@pytest.mark.integration
def test_a_client_without_the_secret_can_neither_read_write_nor_delete(
    cluster: Cluster, zk_root: str
) -> None:
    zk = cluster.zk_hosts + zk_root
    settings = RendezvousSettings(run_id="job", nodes=NodeRange.parse("1"), last_call=0.1)
    agent = connect(zk, settings, NodeInfo("a", "127.0.0.1", 1), secret=SECRET)
    job = ZooKeeperAddress.parse(zk).job_path("job")
    try:
        agent.next_round()
        for auth in (None, [("digest", "hpc-elastic:wrong")], [("digest", "intruder:x")]):
            intruder = KazooClient(hosts=cluster.zk_hosts, auth_data=auth)
            intruder.start(timeout=10)
            try:
                c = intruder
                attempts = {
                    "read the state": partial(c.get, f"{job}/state"),
                    "list the members": partial(c.get_children, f"{job}/members"),
                    "read a member": partial(c.get, f"{job}/members/a"),
                    "list the job": partial(c.get_children, job),
                    "write the state": partial(c.set, f"{job}/state", b"{}"),
                    "join": partial(c.create, f"{job}/members/x", ephemeral=True),
                    "delete a member": partial(c.delete, f"{job}/members/a"),
                    "delete the state": partial(c.delete, f"{job}/state"),
                    "delete the job": partial(c.delete, job, recursive=True),
                }
                for what, attempt in attempts.items():
                    try:
                        attempt()
                    except (NoAuthError, NotEmptyError):
                        continue
                    pytest.fail(f"an intruder could {what}")
                with pytest.raises(NotEmptyError):
                    intruder.delete(job)
            finally:
                intruder.stop()
                intruder.close()
    finally:
        agent.leave()
        owner = KazooClient(hosts=cluster.zk_hosts, auth_data=[("digest", f"hpc-elastic:{SECRET}")])
        owner.start(timeout=10)
        owner.delete(job, recursive=True)
        owner.stop()
        owner.close()


@pytest.mark.integration
def test_the_secret_is_never_in_ps_logs_script_or_events(cluster: Cluster, tmp_path: Path) -> None:
    run = submit(cluster, tmp_path, tmp_path / "checkpoints", train_args=("--steps=15",))
    secret = (run.job_dir / "secret").read_text().strip()
    seen_running = False
    while cluster.squeue():
        listing = subprocess.run(
            ["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True
        ).stdout
        assert secret not in listing
        seen_running |= bool(run.processes(0))
    assert wait_until(lambda: run.last_step() == 15, 10), run.steps()
    assert seen_running
    assert "done" in run.kinds()
    for path in [*run.job_dir.rglob("*"), *tmp_path.glob("*.log")]:
        if path.is_file() and path.name != "secret":
            assert secret.encode() not in path.read_bytes(), path


@pytest.fixture(params=[0o077, 0o027], ids=["umask-077", "umask-027"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    yield int(request.param)
    os.umask(previous)


def assert_no_wider(path: Path, umask: int) -> None:
    mode = path.stat().st_mode & 0o777
    assert mode & umask == 0, f"{path} has mode {mode:04o} under umask {umask:04o}"


def test_job_and_checkpoint_files_keep_the_umask(
    umask: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    with mocked_submit():
        result = CliRunner().invoke(cli.app, ["submit", "--nodes=1:2", "train.py"])
    assert result.exit_code == 0, result.stderr
    [job_dir] = (tmp_path / "hpc-elastic-runs").iterdir()
    checkpoints = Checkpointer.at(tmp_path / "checkpoints")
    staging = checkpoints.prepare_staging(5)
    (staging / "state.pt").write_bytes(b"")
    checkpoints.commit(staging, 5, 1, {})
    events.append(job_dir / "events.jsonl", events.Event(kind=events.Kind.START))
    written = [job_dir, *job_dir.rglob("*"), *(tmp_path / "checkpoints").rglob("*")]
    for path in [*written, tmp_path / "checkpoints"]:
        assert_no_wider(path, umask)
    assert (job_dir / "secret").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("loose", [0o000, 0o022], ids=["umask-000", "umask-022"])
def test_the_job_directory_and_files_carrying_env_values_are_private_whatever_the_umask(
    loose: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    previous = os.umask(loose)
    try:
        monkeypatch.chdir(tmp_path)
        (tmp_path / "train.py").write_text("pass\n")
        with mocked_submit():
            result = CliRunner().invoke(
                cli.app, ["submit", "--nodes=1:2", "--env", "WANDB_API_KEY=tok-123", "train.py"]
            )
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.stderr
    [job_dir] = (tmp_path / "hpc-elastic-runs").iterdir()
    assert job_dir.stat().st_mode & 0o777 == 0o700
    for name in ("sbatch.sh", "job.json", "secret"):
        assert (job_dir / name).stat().st_mode & 0o777 == 0o600, name
    secret = (job_dir / "secret").read_text()
    for path in tmp_path.rglob("*"):
        if path.is_file() and (b"tok-123" in path.read_bytes() or secret in path.read_text()):
            assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"


def test_run_ids_carry_128_random_bits_after_the_public_name_and_time() -> None:
    now = datetime(2026, 11, 30, 12, 0, 0)
    first, second = new_run_id("train", now), new_run_id("train", now)
    prefix = "train-20261130-120000-"
    assert first.startswith(prefix)
    assert second.startswith(prefix)
    assert first != second
    suffix = first.removeprefix(prefix)
    assert len(suffix) == 32
    assert set(suffix) <= set("0123456789abcdef")


UNPICKLERS = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


def unsafe_uses(path: Path) -> list[str]:
    """Imports of pickling modules, pickling collectives, and torch.load without weights_only."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names]
            found += [f"imports {n}" for n in names if n.split(".")[0] in UNPICKLERS]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in OBJECT_COLLECTIVES:
                found.append(f"calls {name}")
            safe = any(
                k.arg == "weights_only" and getattr(k.value, "value", None) is True
                for k in node.keywords
            )
            if name == "load" and getattr(node.func.value, "id", None) == "torch" and not safe:
                found.append("calls torch.load without weights_only=True")
    return [f"{path.relative_to(REPO)} {use}" for use in found]


USER_PICKLE = {PACKAGE / "submitit_plugin.py"}
"""Not the control plane: the submitit plugin carries the user's own callable in submitit's
format (cloudpickle), written 0600 into the user's 0700 job directory and loaded only when it
is the user's own file that no one else may write (``submitit_plugin._check_private``)."""


def test_no_pickle_on_the_control_plane() -> None:
    """Rendezvous, agent, Slurm layer, CLI, ops, checkpoints and the values between ranks:
    JSON and weights_only only."""
    sources = sorted(set(PACKAGE.rglob("*.py")) - USER_PICKLE)
    assert [use for path in sources for use in unsafe_uses(path)] == []


def test_the_submitit_plugin_loads_only_the_users_private_pickles(tmp_path: Path) -> None:
    from hpc_elastic import submitit_plugin  # noqa: PLC0415
    from hpc_elastic.errors import UsageError  # noqa: PLC0415

    pickled = tmp_path / "submission.pkl"
    pickled.write_bytes(b"not loaded")
    pickled.chmod(0o666)
    refused = r"submission\.pkl' is not loaded because group or others may write it \(mode 0666\)"
    with pytest.raises(UsageError, match=refused):
        submitit_plugin._check_private(pickled)
    pickled.chmod(0o600)
    submitit_plugin._check_private(pickled)


def test_no_pickle_between_ranks() -> None:
    assert unsafe_uses(PACKAGE / "train" / "_dist.py") == []


def test_values_between_ranks_round_trip_exactly() -> None:
    import torch  # noqa: PLC0415 (the rest of this file runs without torch)

    from hpc_elastic.train import _dist, rng  # noqa: PLC0415

    state = rng.capture()
    value = {"state": state, "path": Path("/ckpt/step-1"), "none": None, "nan": float("inf")}
    back = _dist.decode(_dist.encode(value))
    assert back["path"] == Path("/ckpt/step-1")
    assert back["none"] is None
    assert back["state"]["python"] == state["python"]
    assert torch.equal(back["state"]["torch"], state["torch"])
    assert torch.equal(back["state"]["numpy"]["keys"], state["numpy"]["keys"])
    rng.restore(back["state"])
    for tensor in (torch.arange(6.0).reshape(2, 3).bfloat16(), torch.tensor([True, False])):
        decoded = _dist.decode(_dist.encode(tensor))
        assert decoded.dtype == tensor.dtype
        assert torch.equal(decoded, tensor)


class _Canary:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b'["tensor","object",[1],""]',
        b'["v",{"a":1}]',
        b'["dict",[[["list",[]],["v",1]]]]',
        b"[" * 100_000,
        b"pickle",
    ],
)
def test_what_a_forged_rank_0_sends_is_refused_never_run(tmp_path: Path, payload: bytes) -> None:
    import pickle  # noqa: PLC0415 (to forge the attack, not to read anything)

    from hpc_elastic.errors import CheckpointError  # noqa: PLC0415
    from hpc_elastic.train import _dist  # noqa: PLC0415

    canary = tmp_path / "canary"
    if payload == b"pickle":
        payload = pickle.dumps(_Canary(canary))
    with pytest.raises(CheckpointError, match=r"^Another rank sent a value"):
        _dist.decode(payload)
    assert not canary.exists()


TWO_RANKS = (
    """
import sys, random, torch, torch.distributed as dist
from pathlib import Path
from hpc_elastic.train import _dist, rng
dist.init_process_group("gloo")
random.seed(dist.get_rank())
torch.manual_seed(dist.get_rank())
chosen = _dist.broadcast_from_rank0(Path("/from/rank0") if dist.get_rank() == 0 else None)
states = _dist.gather_to_all(rng.capture())
raw = _dist.broadcast_bytes(b"\\x80\\x04 raw \\x00 bytes" if dist.get_rank() == 1 else None, 1)
print("rank", dist.get_rank(), chosen, [s["python"][1][0] for s in states],
      [int(s["torch"].sum()) for s in states], raw.hex(), flush=True)
dist.destroy_process_group()
"""
    + LEAVE
)


def test_two_ranks_exchange_paths_and_rng_states_without_pickle(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(TWO_RANKS)
    result = torchrun(script, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = sorted(
        line.split("]:", 1)[-1] for line in result.stdout.splitlines() if "rank " in line
    )
    assert len(lines) == 2
    assert lines[0].replace("rank 0", "rank 1") == lines[1]
    assert lines[0].endswith(b"\x80\x04 raw \x00 bytes".hex())  # rank 1's bytes, verbatim
    assert "/from/rank0" in lines[0]


def _forge_metadata(checkpoint: Path, data: bytes) -> None:
    """What an attacker who can write the checkpoint directory does: new .metadata, and a
    manifest that matches it as far as anything without the job's secret can make it match."""
    import hashlib  # noqa: PLC0415
    import json  # noqa: PLC0415

    (checkpoint / ".metadata").write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][".metadata"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "hmac_sha256": hashlib.sha256(data).hexdigest(),
    }
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def job_secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    monkeypatch.setenv("HPC_ELASTIC_SECRET_FILE", str(path))
    monkeypatch.delenv("HPC_ELASTIC_JOB_DIR", raising=False)
    return path


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.usefixtures("job_secret_file")
@pytest.mark.parametrize(
    ("plant", "refusal"),
    [
        # Her manifest cannot carry the job's seal: refused before its .metadata is looked at.
        ("metadata", r"^No intact checkpoint in '.*' \(1 unusable; the newest, step-00000003: "
         r"its manifest's seal matches no key this job holds\)"),
        # Our sealed manifest does not list her file: refused before torch reads it.
        ("rank-local metadata", r"^Sharded checkpoint '.*' is not trusted because it holds "
         r"files its manifest does not list \(__0.metadata\)"),
    ],
)  # fmt: skip
def test_a_planted_sharded_checkpoint_cannot_run_code(
    tmp_path: Path, plant: str, refusal: str
) -> None:
    import pickle  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from hpc_elastic.errors import CheckpointError  # noqa: PLC0415
    from hpc_elastic.train.sharded import load_sharded, save_sharded  # noqa: PLC0415

    canary = tmp_path / "canary"
    checkpoint = save_sharded({"weight": torch.arange(4.0), "step": 3}, 3, tmp_path / "ckpt")
    assert checkpoint is not None  # a synchronous save is never skipped
    if plant == "metadata":
        _forge_metadata(checkpoint, pickle.dumps(_Canary(canary)))
    else:
        (checkpoint / "__0.metadata").write_bytes(pickle.dumps(_Canary(canary)))
    with pytest.raises(CheckpointError, match=refusal):
        load_sharded({"weight": torch.zeros(4), "step": 0}, tmp_path / "ckpt")
    assert not canary.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_without_a_secret_a_swapped_sharded_metadata_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from hpc_elastic.errors import CheckpointError  # noqa: PLC0415
    from hpc_elastic.train.sharded import load_sharded, save_sharded  # noqa: PLC0415

    monkeypatch.delenv("HPC_ELASTIC_SECRET_FILE", raising=False)
    monkeypatch.delenv("HPC_ELASTIC_JOB_DIR", raising=False)
    checkpoint = save_sharded({"weight": torch.arange(4.0), "step": 3}, 3, tmp_path / "ckpt")
    assert checkpoint is not None  # a synchronous save is never skipped
    state = {"weight": torch.zeros(4), "step": 0}
    assert load_sharded(state, tmp_path / "ckpt") == checkpoint
    assert state["step"] == 3
    canary = tmp_path / "canary"
    planted = pickle.dumps(_Canary(canary))
    (checkpoint / ".metadata").write_bytes(planted.ljust((checkpoint / ".metadata").stat().st_size))
    with pytest.raises(CheckpointError, match="SHA-256 does not match the manifest"):
        load_sharded(state, tmp_path / "ckpt")
    assert not canary.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_sealed_with_the_secret_loads_and_needs_it(
    tmp_path: Path, job_secret_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch  # noqa: PLC0415

    from hpc_elastic.errors import CheckpointError  # noqa: PLC0415
    from hpc_elastic.train.sharded import load_sharded, save_sharded  # noqa: PLC0415

    checkpoint = save_sharded({"weight": torch.arange(4.0), "step": 3}, 3, tmp_path / "ckpt")
    assert checkpoint is not None  # the one rank commits
    weight = torch.zeros(4)
    state = {"weight": weight, "step": 0}
    assert load_sharded(state, tmp_path / "ckpt") == checkpoint
    assert torch.equal(weight, torch.arange(4.0))
    other = tmp_path / "other-secret"
    other.write_text("another-job")
    other.chmod(0o600)
    monkeypatch.setenv("HPC_ELASTIC_SECRET_FILE", str(other))
    with pytest.raises(CheckpointError, match="matches no key this job holds"):
        load_sharded(state, tmp_path / "ckpt")
    assert job_secret_file.exists()


def test_non_tensor_values_in_sharded_data_load_without_pickle(tmp_path: Path) -> None:
    import io  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from hpc_elastic.train.sharded import SafeLoadPlanner  # noqa: PLC0415

    canary = tmp_path / "canary"
    planted = io.BytesIO()
    torch.save(_Canary(canary), planted)
    planted.seek(0)
    with pytest.raises(pickle_error()):
        SafeLoadPlanner().load_bytes(None, planted)  # type: ignore[arg-type]
    assert not canary.exists()


def pickle_error() -> type[Exception]:
    import pickle  # noqa: PLC0415

    return pickle.UnpicklingError


def test_the_workers_store_port_stays_in_the_sites_range() -> None:
    from hpc_elastic.errors import RendezvousError  # noqa: PLC0415
    from hpc_elastic.rendezvous.handler import free_port  # noqa: PLC0415

    for _ in range(20):
        assert 29500 <= free_port({"HPC_ELASTIC_MASTER_PORTS": "29500:29509"}) <= 29509
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"No free port in .* '{port}:{port}'"):
            free_port({"HPC_ELASTIC_MASTER_PORTS": f"{port}:{port}"})


def test_the_named_interface_and_port_range_reach_the_workers_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    args = ["render", "--iface", "ib0", "--master-port-range", "29500:29599", "train.py"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    for line in (
        "GLOO_SOCKET_IFNAME=ib0",
        "NCCL_SOCKET_IFNAME=ib0",
        "HPC_ELASTIC_MASTER_PORTS=29500:29599",
    ):
        assert f"export {line}" in lines
    for bad in (
        ["--iface", "ib0;id"],
        ["--master-port-range", "80:90"],
        ["--master-port-range", "9:1"],
    ):
        result = CliRunner().invoke(cli.app, ["render", *bad, "train.py"])
        assert result.exit_code == 2
        assert result.stderr.startswith(f"error: {bad[0]} '{bad[1]}'")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_secret_others_can_read_stops_a_sharded_save_on_every_rank_alike(
    tmp_path: Path, job_secret_file: Path
) -> None:
    import torch  # noqa: PLC0415

    from hpc_elastic.errors import CheckpointError  # noqa: PLC0415
    from hpc_elastic.train.sharded import save_sharded  # noqa: PLC0415

    job_secret_file.chmod(0o644)
    with pytest.raises(CheckpointError, match="Could not commit sharded checkpoint step 3"):
        save_sharded({"weight": torch.arange(4.0)}, 3, tmp_path / "ckpt")
