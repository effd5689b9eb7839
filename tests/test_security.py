"""Security: the job's znodes keep other clients out, the secret stays secret, files keep the
user's umask, and nothing on the wire is unpickled. docs/security.md has the threat model.
"""

from __future__ import annotations

import ast
import os
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from cluster import REPO, Cluster, wait_until
from faults import submit
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NotEmptyError
from test_cli import FakeSlurm
from typer.testing import CliRunner

from hpc_elastic import cli, events
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.zookeeper import ZooKeeperAddress, connect
from hpc_elastic.spec import NodeRange
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
    monkeypatch.setattr(cli, "slurm", FakeSlurm())
    (tmp_path / "train.py").write_text("pass\n")
    result = CliRunner().invoke(cli.app, ["submit", "--nodes=1:2", "train.py"])
    assert result.exit_code == 0, result.stderr
    [job_dir] = (tmp_path / "hpc-elastic-runs").iterdir()
    checkpoints = Checkpointer.at(tmp_path / "checkpoints")
    staging = checkpoints.prepare_staging(5)
    (staging / "state.pt").write_bytes(b"")
    checkpoints.commit(staging, 5, 1, {})
    events.append(job_dir / "events.jsonl", events.Event(kind="start"))
    written = [job_dir, *job_dir.rglob("*"), *(tmp_path / "checkpoints").rglob("*")]
    for path in [*written, tmp_path / "checkpoints"]:
        assert_no_wider(path, umask)
    assert (job_dir / "secret").stat().st_mode & 0o777 == 0o600


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


def test_no_pickle_on_the_control_plane() -> None:
    """Rendezvous, agent, Slurm layer, CLI, ops and checkpoints: JSON and weights_only only."""
    sources = sorted(set(PACKAGE.rglob("*.py")) - {PACKAGE / "train" / "_dist.py"})
    assert [use for path in sources for use in unsafe_uses(path)] == []


@pytest.mark.xfail(
    strict=True,
    reason="train/_dist.py broadcasts small objects (checkpoint paths, RNG states) with "
    "torch.distributed's object collectives, which pickle between the job's own ranks",
)
def test_no_pickle_between_ranks() -> None:
    assert unsafe_uses(PACKAGE / "train" / "_dist.py") == []
