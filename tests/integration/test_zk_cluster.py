"""The user's own ZooKeeper ensemble on the real local Slurm cluster (``hpc-elastic zk``).

The cluster is this module's own (or the one named by ``HPC_ELASTIC_TEST_ZK_CLUSTER``, a
state dir of ``scripts/dev-cluster up --service-nodes 4``), with four service nodes (s1..s4)
in a partition ``service`` beside the four compute nodes: three servers and a spare. The
compute partitions give every job whole nodes (OverSubscribe=EXCLUSIVE), so an ensemble
there would hold three of the four nodes a training job needs (docs/dev-cluster.md). Every
command runs through the real CLI in a fresh interpreter, with a state directory of the
test's own and no ``$HPC_ELASTIC_ZK``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, ClusterError, wait_until
from submit_output import submitted

from hpc_elastic import events
from hpc_elastic.contract import STATE_DIR_ENV, ZK_ENV
from hpc_elastic.ensemble import fourletter

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
SERVICE_NODES = 4
REUSE_ENV = "HPC_ELASTIC_TEST_ZK_CLUSTER"
"""Names a running ``dev-cluster up --service-nodes 4`` state dir for this module to reuse."""


@pytest.fixture(scope="module")
def private_cluster() -> Iterator[Cluster]:
    """This module's cluster: conftest's ``private_cluster`` with four service nodes (the
    name is conftest's, so that its after-test checks look at this cluster), or the one
    named by ``HPC_ELASTIC_TEST_ZK_CLUSTER``."""
    reused = os.environ.get(REUSE_ENV)
    if reused:
        yield Cluster.from_state_dir(Path(reused))
        return
    state_dir = Path(tempfile.mkdtemp(prefix="hpc-elastic-zk-cluster-"))
    try:
        running = Cluster.start(state_dir, service_nodes=SERVICE_NODES)
    except ClusterError as error:
        shutil.rmtree(state_dir, ignore_errors=True)
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"a private test cluster is required in CI: {error}", pytrace=False)
        pytest.skip(f"no private test cluster: {error}")
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture
def env(private_cluster: Cluster, tmp_path: Path) -> dict[str, str]:
    """The cluster's environment with a state directory of this test's own, no ZooKeeper
    named anywhere, and a project directory without a config file."""
    environment = {
        **private_cluster.env,
        "PYTHONPATH": str(REPO),
        STATE_DIR_ENV: str(tmp_path / "state"),
    }
    environment.pop(ZK_ENV, None)
    (tmp_path / "project").mkdir()
    return environment


def hpc_elastic(
    env: dict[str, str], cwd: Path, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def zk_status(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    result = hpc_elastic(env, cwd, "zk", "status", "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    status: dict[str, Any] = json.loads(result.stdout)
    return status


def servers(status: dict[str, Any]) -> list[dict[str, Any]]:
    return list(status["servers"])


@contextlib.contextmanager
def ensemble(env: dict[str, str], cwd: Path, *args: str) -> Iterator[dict[str, Any]]:
    """``zk start`` with ``args``; the ensemble's status; always stopped at the end (with
    --force only when the test itself did not stop it)."""
    started = hpc_elastic(env, cwd, "zk", "start", "--partition", "service", *args)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "Your ensemble serves at" in started.stdout
    try:
        yield zk_status(env, cwd)
    finally:
        if (Path(env[STATE_DIR_ENV]) / "zk" / "ensemble.json").exists():
            hpc_elastic(env, cwd, "zk", "stop", "--force", timeout=180)


def train_on(
    env: dict[str, str], project: Path, log: Path, status: dict[str, Any]
) -> tuple[str, Path]:
    """A ``1:4`` job submitted with no --zk anywhere, which must pick the ensemble; returns
    its Slurm job and directory once it trains on four nodes."""
    connect = str(status["connect"])
    result = hpc_elastic(
        env,
        project,
        "submit",
        "--nodes=1:4",
        "--nproc-per-node=1",
        "--no-prewarm",
        "--partition=low",
        "--last-call=2",
        "--signal=USR2@15",
        str(TRAIN),
        "--",
        "--steps=400",
        "--checkpoint-every=5",
        "--sleep-per-step=0.3",
        f"--log-file={log}",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    job, job_dir = submitted(result.stdout)
    assert f"ZooKeeper: {connect} (your ensemble of 3 servers, Slurm job {status['job_id']})" in (
        result.stdout
    )
    assert f"--zk {connect}" in (job_dir / "sbatch.sh").read_text()
    assert training_at(job_dir, log, 4, 300), (rounds(job_dir), log.read_text()[-500:])
    return job, job_dir


def rounds(job_dir: Path) -> dict[int, int]:
    """Round number -> world size, from the job's events."""
    seen: dict[int, int] = {}
    for event in events.read(job_dir / "events.jsonl"):
        if event.kind == "round" and event.round is not None:
            seen.setdefault(event.round, int(event.details["world_size"]))
    return seen


def steps(log: Path) -> list[int]:
    text = log.read_text() if log.exists() else ""
    return [int(m.group(1)) for m in re.finditer(r"^step=(\d+) ", text, re.M)]


def training_at(job_dir: Path, log: Path, world: int, timeout: float) -> bool:
    def reached() -> bool:
        sizes = rounds(job_dir)
        text = log.read_text() if log.exists() else ""
        lines = [line for line in text.splitlines() if line.startswith("step=")]
        return (
            bool(sizes)
            and sizes[max(sizes)] == world
            and lines[-1:] != []
            and (lines[-1].endswith(f" world={world}"))
        )

    return wait_until(reached, timeout, interval=0.5)


def java_processes_of(job_id: str) -> list[str]:
    """ZooKeeper processes whose configuration lies in one of this job's data directories."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if any(f"hpc-elastic-zk-{job_id}-" in arg for arg in argv):
                found.append(f"{proc.name} {' '.join(argv)}")
    return found


def listening(port: int) -> bool:
    """Whether something listens on ``port``. With SO_REUSEADDR, as a server binds: the
    connections a stopped server closed may linger in TIME_WAIT, which holds no port."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
            probe.listen(1)
        except OSError:
            return True
        return False


def assert_nothing_left(state: dict[str, Any], data_root: Path, env: dict[str, str]) -> None:
    job_id = str(state["job_id"])
    assert java_processes_of(job_id) == []
    for server in servers(state):
        for key in ("client_port", "quorum_port", "election_port"):
            assert not listening(int(server[key])), (key, server)
    assert list(data_root.glob(f"hpc-elastic-zk-{job_id}-*")) == []
    zk_dir = Path(env[STATE_DIR_ENV]) / "zk"
    assert not (zk_dir / "ensemble.json").exists()
    assert not (zk_dir / "run").exists()


@pytest.mark.timeout(900)
def test_a_job_trains_through_your_own_ensemble_and_a_lost_server_disturbs_nothing(
    private_cluster: Cluster, env: dict[str, str], tmp_path: Path
) -> None:
    """``zk start --servers 3``; a ``1:4`` job submitted with no --zk anywhere trains through
    it; one server's step is cancelled mid-training: the job keeps its round and its step log
    goes on without a resume, ``zk status`` shows the ensemble degraded, ``zk stop`` refuses
    while the job runs, and once the job is done leaves nothing behind."""
    project = tmp_path / "project"
    data_root = tmp_path / "local"
    log = project / "steps.log"
    with ensemble(
        env, project, "--servers", "3", "--restarts", "0", "--data-dir", str(data_root)
    ) as status:
        assert status["state"] == "serving", status
        placed = {server["node"] for server in servers(status)}
        assert len(placed) == 3
        assert placed <= {f"s{k}" for k in range(1, SERVICE_NODES + 1)}
        job, job_dir = train_on(env, project, log, status)
        users = zk_status(env, project)["users"]
        assert [user["job_id"] for user in users] == [job]

        # One follower's step is cancelled (the leader's loss costs an election: see
        # docs/cluster-setup.md). --restarts 0: it stays down.
        follower = next(s for s in servers(status) if s["mode"] == "follower")
        before = rounds(job_dir)
        logged = steps(log)
        at_kill, lines_at_kill = logged[-1], len(logged)
        private_cluster.run(["scancel", str(follower["step"])])
        assert wait_until(
            lambda: any(
                s["myid"] == follower["myid"] and s["mode"] == "down"
                for s in servers(zk_status(env, project))
            ),
            60,
        ), zk_status(env, project)
        degraded = zk_status(env, project)
        assert degraded["state"] == "degraded", degraded
        lost = next(s for s in servers(degraded) if s["myid"] == follower["myid"])
        assert lost["slurm"] == "step ended", lost
        text = hpc_elastic(env, project, "zk", "status", timeout=60).stdout
        assert "DEGRADED" in text
        assert "2 of 3 serving" in text

        # Training goes on through the two servers left: same round, no step repeated.
        assert wait_until(lambda: steps(log)[-1] >= at_kill + 20, 240), log.read_text()[-500:]
        refused = hpc_elastic(env, project, "zk", "stop", timeout=60)
        assert refused.returncode == 1
        assert refused.stderr.startswith("error: Your ensemble (Slurm job ")
        assert f"(Slurm job {job}, RUNNING)" in refused.stderr
        assert len(refused.stderr.splitlines()) == 1
        assert private_cluster.run(["scancel", job]).returncode == 0
        assert wait_until(lambda: all(j != job for j, _ in _jobs(private_cluster)), 120)
        after = rounds(job_dir)
        assert after == before, (before, after)
        ran = steps(log)
        since = ran[lines_at_kill - 1 :]
        assert since == list(range(at_kill, at_kill + len(since))), since[:50]
        kinds = [event.kind for event in events.read(job_dir / "events.jsonl")]
        assert "failure" not in kinds

        stopped = hpc_elastic(env, project, "zk", "stop", timeout=180)
        assert stopped.returncode == 0, stopped.stderr
        assert "nothing of it is left" in stopped.stdout
    assert private_cluster.wait_queue_empty(60), private_cluster.squeue()
    assert_nothing_left(degraded, data_root, env)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["node", "step"])
def test_a_lost_leader_costs_the_job_nothing_and_a_spare_restores_full_strength(
    private_cluster: Cluster, env: dict[str, str], tmp_path: Path, fault: str
) -> None:
    """``zk start --servers 3 --spares 1 --restarts 0``; a ``1:4`` job trains through it; the
    LEADER is lost: its node crashes (``node``: its step and server die with it), or its step
    is cancelled (``step``: with no start in place left). The other two elect a leader; the
    job keeps its round and its step log goes on without a resume; ``zk status`` shows the
    ensemble degraded, then (once Slurm has removed the lost node from the ensemble's job, or
    at once for a step) a new server on the spare node, reconfigured in, and the ensemble
    serving at full strength. The job still uses the connect string it was submitted with.
    The election's length is printed, for the record (never asserted)."""
    project = tmp_path / "project"
    data_root = tmp_path / "local"
    log = project / "steps.log"
    with ensemble(
        env,
        project,
        *("--servers", "3", "--spares", "1", "--restarts", "0", "--data-dir", str(data_root)),
    ) as status:
        assert status["state"] == "serving", status
        assert len(status["spares"]) == 1, status
        job, job_dir = train_on(env, project, log, status)
        assert [user["job_id"] for user in zk_status(env, project)["users"]] == [job]

        leader = next(s for s in servers(status) if s["mode"] == "leader")
        survivors = [s for s in servers(status) if s["myid"] != leader["myid"]]
        before = rounds(job_dir)
        logged = steps(log)
        at_kill, lines_at_kill = logged[-1], len(logged)
        if fault == "node":
            private_cluster.node_kill(str(leader["node"]))
        else:
            assert private_cluster.run(["scancel", str(leader["step"])]).returncode == 0
        print(
            f"election after the leader's {fault} was lost: {election_seconds(leader, survivors)}"
        )

        def seen(state: str) -> dict[str, Any] | None:
            now = zk_status(env, project)
            return now if now["state"] == state else None

        def replaced() -> dict[str, Any] | None:
            now = seen("serving")
            return now if now and leader["myid"] not in [s["myid"] for s in servers(now)] else None

        # A lost node keeps the ensemble degraded until Slurm removes the node from its job;
        # a cancelled step is replaced at once, and on a loaded machine that can be over
        # between two `zk status` calls (each a few seconds there). Then the replacement
        # itself, checked below, is the evidence that the loss was seen.
        degraded = wait_for(
            lambda: seen("degraded") or (replaced() if fault == "step" else None), 120
        )
        assert degraded is not None, zk_status(env, project)
        if degraded["state"] == "degraded":
            down = {s["mode"] for s in servers(degraded) if s["myid"] == leader["myid"]}
            assert down == {"down"}, degraded

        full = wait_for(replaced, 300)
        assert full is not None, (zk_status(env, project), slurm_output(env, status))
        (new,) = [s for s in servers(full) if s["myid"] not in [t["myid"] for t in survivors]]
        assert new["node"] == status["spares"][0]
        assert new["replaces"] == leader["myid"]
        assert not new["joining"]
        assert [r["myid"] for r in full["retired"]] == [leader["myid"]]
        assert full["connect"] != status["connect"]
        text = hpc_elastic(env, project, "zk", "status", timeout=60).stdout
        assert "3 of 3 serving" in text
        assert f"Replaced  server {leader['myid']} ({leader['node']}, " in text
        # The job keeps the connect string it was submitted with (two of its servers are
        # members still), and is still known as the ensemble's user.
        assert [user["job_id"] for user in full["users"]] == [job]

        assert wait_until(lambda: steps(log)[-1] >= at_kill + 20, 240), log.read_text()[-500:]
        assert private_cluster.run(["scancel", job]).returncode == 0
        assert wait_until(lambda: all(j != job for j, _ in _jobs(private_cluster)), 120)
        assert_untouched(job_dir, log, before, lines_at_kill)

        stopped = hpc_elastic(env, project, "zk", "stop", timeout=180)
        assert stopped.returncode == 0, stopped.stderr
    assert private_cluster.wait_queue_empty(60), private_cluster.squeue()
    assert_nothing_left({**full, "servers": [*servers(full), *full["retired"]]}, data_root, env)


def assert_untouched(job_dir: Path, log: Path, before: dict[int, int], lines_at_fault: int) -> None:
    """The job trained through the fault: the same rounds as before it, its step log going on
    from the step it had reached with none repeated (no resume), no failure or restart."""
    assert rounds(job_dir) == before
    logged = steps(log)
    at_fault = logged[lines_at_fault - 1]
    since = logged[lines_at_fault - 1 :]
    assert since == list(range(at_fault, at_fault + len(since))), since[:50]
    timeline = events.read(job_dir / "events.jsonl")
    kinds = [event.kind for event in timeline]
    told = "\n".join(
        f"{event.time:.2f} {event.slot} round {event.round} {event.kind} {event.details}"
        for event in timeline
    )
    assert "failure" not in kinds, told
    assert "restart" not in kinds, told


def wait_for(probe: Any, timeout: float) -> Any:
    """``probe()``'s first answer that is not None, polled until ``timeout``; else None."""
    found: list[Any] = []

    def answered() -> bool:
        value = probe()
        if value is not None:
            found.append(value)
        return value is not None

    return found[0] if wait_until(answered, timeout, interval=1.0) else None


def election_seconds(leader: dict[str, Any], survivors: list[dict[str, Any]]) -> str:
    """From the moment the lost leader stops answering to the moment one of the others
    leads, polled every 50 ms over ``mntr`` (for the record, never asserted)."""

    def mode(server: dict[str, Any]) -> str:
        return fourletter.health(str(server["host"]), int(server["client_port"]), 0.5).mode

    deadline = time.monotonic() + 120
    while mode(leader) != "down" and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = time.monotonic()
    while time.monotonic() < deadline:
        if any(mode(server) == "leader" for server in survivors):
            return f"{time.monotonic() - gone:.2f} s from the leader's loss to a new leader"
        time.sleep(0.05)
    return "no new leader within 120 s"


def slurm_output(env: dict[str, str], status: dict[str, Any]) -> str:
    """The ensemble job's output (the supervisor's lines), for a failure's message."""
    run = Path(env[STATE_DIR_ENV]) / "zk" / "run" / f"slurm-{status['job_id']}.out"
    return run.read_text()[-2000:] if run.exists() else "(no output)"


def _jobs(cluster: Cluster) -> list[tuple[str, str]]:
    """(base job id, state) of everything Slurm lists."""
    return [(job.split("_")[0], state) for job, state in cluster.squeue()]


@pytest.mark.timeout(600)
def test_a_lost_server_starts_again_in_place_and_doctor_checks_the_ensemble(
    private_cluster: Cluster, env: dict[str, str], tmp_path: Path
) -> None:
    """A one-server ensemble whose step is cancelled comes back on the same node and port
    (its restart in place); ``doctor`` with no --zk finds it and passes its checks."""
    project = tmp_path / "project"
    data_root = tmp_path / "local"
    with ensemble(env, project, "--servers", "1", "--data-dir", str(data_root)) as status:
        (first,) = servers(status)
        assert first["mode"] == "standalone", status
        private_cluster.run(["scancel", str(first["step"])])

        def back() -> bool:
            (server,) = servers(zk_status(env, project))
            return bool(server["incarnation"] == 2 and server["mode"] == "standalone")

        assert wait_until(back, 120), zk_status(env, project)
        (again,) = servers(zk_status(env, project))
        assert (again["node"], again["client_port"]) == (first["node"], first["client_port"])
        assert again["step"] != first["step"]

        checked = hpc_elastic(
            env,
            project,
            "doctor",
            "--partition=service",
            f"--checkpoint-dir={tmp_path / 'ckpt'}",
            timeout=180,
        )
        found = {
            name: level
            for level, name in re.findall(
                r"^[✓!✗] (PASS|WARN|FAIL)\s+([^:]+):", checked.stdout, re.M
            )
        }
        for name in ZOOKEEPER_CHECKS:
            assert found.get(name) == "PASS", checked.stdout
        assert f"{status['connect']} (your ensemble of 1 server, Slurm job" in checked.stdout

        stopped = hpc_elastic(env, project, "zk", "stop", timeout=180)
        assert stopped.returncode == 0, stopped.stderr
    assert private_cluster.wait_queue_empty(60), private_cluster.squeue()
    assert_nothing_left(zk_status_of(status, again), data_root, env)


ZOOKEEPER_CHECKS = (
    "ZooKeeper ensemble",
    "ZooKeeper",
    "ZooKeeper quorum",
    "ZooKeeper sessions",
    "ZooKeeper ACLs",
)


def zk_status_of(status: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    return {**status, "servers": [server]}
