"""The agent's life cycle against an in-memory rendezvous, with fast torch-free workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from agent_fakes import FakeJob, FakeRendezvous

from hpc_elastic import events
from hpc_elastic.agent.agent import Agent
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.spec import NodeRange

WORKER = Path(__file__).parent / "workloads" / "worker.py"


class Cluster:
    """N agents in threads sharing one FakeJob; each gets its own run() thread."""

    def __init__(self, tmp_path: Path, nodes: str = "2", max_restarts: int = 3, **spec: object):
        self.job = FakeJob(
            RendezvousSettings(
                "run1",
                NodeRange.parse(nodes),
                last_call=0.3,
                session_timeout=1.0,
                min_wait=5.0,
                max_restarts=max_restarts,
            )
        )
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.job_dir = tmp_path / "job"
        self.spec = AgentSpec(
            job_dir=self.job_dir,
            command=(sys.executable, str(WORKER)),
            **spec,  # type: ignore[arg-type]
        )
        self.agents: list[Agent] = []
        self.codes: dict[int, ExitCode] = {}
        self.threads: list[threading.Thread] = []
        self.said: list[str] = []

    def start(self, count: int, **env: str) -> None:
        for _ in range(count):
            index = len(self.agents)
            rdzv = FakeRendezvous(
                self.job.settings,
                NodeInfo(f"node{index}", "127.0.0.1", self.spec.nproc_per_node, f"n{index}"),
                job=self.job,
            )
            environ = {**os.environ, "FAKE_WORKER_OUT": str(self.out), **env}
            agent = Agent(self.spec, rdzv, environ=environ, say=self.said.append)
            self.agents.append(agent)
            thread = threading.Thread(target=self._run, args=(index, agent), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _run(self, index: int, agent: Agent) -> None:
        self.codes[index] = agent.run()

    def join(self, timeout: float = 30.0) -> dict[int, ExitCode]:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "agent did not finish"
        return self.codes

    def envs(self, round_: int) -> dict[int, dict[str, str]]:
        found = {}
        for path in self.out.glob(f"env_{round_}_*.json"):
            env = json.loads(path.read_text())
            found[int(env["RANK"])] = env
        return found

    def kinds(self) -> list[str]:
        return [event.kind for event in events.read(self.job_dir / "events.jsonl")]


def test_two_nodes_get_torchruns_environment_and_succeed(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="2", nproc_per_node=2)
    cluster.start(2)
    assert cluster.join() == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}
    envs = cluster.envs(1)
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, env in envs.items():
        assert env["WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank % 2)
        assert env["GROUP_RANK"] == str(rank // 2)
        assert env["ROLE_RANK"] == str(rank)
        assert env["ROLE_WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert env["TORCHELASTIC_RUN_ID"] == "run1"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_1/error_{rank}.json")
        assert env["HPC_ELASTIC_CHECKPOINT_DIR"] == str(cluster.job_dir / "checkpoints")
        assert env["HPC_ELASTIC_EVENTS_FILE"] == str(cluster.job_dir / "events.jsonl")
        assert env["HPC_ELASTIC_HEARTBEAT_FILE"].endswith(f"heartbeat_{rank}")
        assert env["OMP_NUM_THREADS"] == "1"
    slots = {(env["GROUP_RANK"], env["HPC_ELASTIC_SLOT"]) for env in envs.values()}
    assert len(slots) == 2
    log = cluster.job_dir / "logs" / "attempt_1" / "rank_3.log"
    assert "rank 3 of 4 starting round 1" in log.read_text()
    assert cluster.kinds().count("done") == 2


def test_worker_failure_restarts_whole_group_and_spends_one_restart(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="2")
    cluster.start(2, FAKE_WORKER_FAIL="1:1:3", FAKE_WORKER_SECONDS="2")
    assert cluster.join() == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}
    assert cluster.job.restarts_used == 1
    root = cluster.job.root_cause
    assert root is not None
    assert (root.rank, root.exit_code, root.signal) == (1, 3, None)
    assert "ValueError: rank 1 fails" in root.message
    assert cluster.envs(2)[0]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert (cluster.job_dir / "logs" / "attempt_2" / "rank_1.log").exists()
    assert sum("root cause" in line for line in cluster.said) == 1


def test_spent_budget_fails_the_job_with_the_root_cause(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="2", max_restarts=0)
    cluster.start(2, FAKE_WORKER_FAIL="1:0:7", FAKE_WORKER_SECONDS="5")
    assert cluster.join() == {0: ExitCode.FAILED, 1: ExitCode.FAILED}
    assert any("budget" in line and "rank 0" in line for line in cluster.said)
    assert "failed" in cluster.kinds()


def test_a_hung_rank_is_killed_and_counts_as_a_failure(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="1", hang_timeout=0.5)
    cluster.start(1, FAKE_WORKER_STOP="1:0", FAKE_WORKER_SECONDS="1.5")
    assert cluster.join() == {0: ExitCode.SUCCESS}
    root = cluster.job.root_cause
    assert root is not None
    assert "made no progress" in root.message
    assert root.signal is None


def test_node_leaving_reforms_the_rest_without_spending_the_budget(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="2:3", nproc_per_node=1)
    cluster.start(3, FAKE_WORKER_SECONDS="3")
    _wait_for(lambda: len(cluster.envs(1)) == 3)
    cluster.agents[2].request_stop(signal.SIGTERM)
    codes = cluster.join()
    assert codes == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS, 2: ExitCode.TERMINATED}
    assert cluster.job.restarts_used == 0
    assert sorted(cluster.envs(2)) == [0, 1]
    assert cluster.envs(2)[0]["WORLD_SIZE"] == "2"
    lost = [e for e in events.read(cluster.job_dir / "events.jsonl") if e.kind == "node_lost"]
    assert [event.details["nodes"] for event in lost] == [["n2"]]


def test_preemption_signal_is_forwarded_and_exits_for_requeue(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="1", nproc_per_node=2, grace=5.0)
    cluster.start(1, FAKE_WORKER_SECONDS="30")
    _wait_for(lambda: len(cluster.envs(1)) == 2)
    time.sleep(0.3)
    cluster.agents[0].request_stop(signal.SIGUSR2)
    assert cluster.join() == {0: ExitCode.PREEMPTED}
    assert (cluster.out / "saved_0").exists()
    assert (cluster.out / "saved_1").exists()
    assert "preempt" in cluster.kinds()


def test_below_min_nodes_fails_after_min_wait(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="2")
    cluster.job = FakeJob(
        RendezvousSettings("run1", NodeRange(2, 2), min_wait=0.5, session_timeout=1.0)
    )
    cluster.start(1)
    assert cluster.join() == {0: ExitCode.FAILED}
    assert any("fewer than 2 nodes" in line for line in cluster.said)


def test_spec_rejects_bad_values_in_one_sentence(tmp_path: Path) -> None:
    from hpc_elastic.errors import UsageError  # noqa: PLC0415

    with pytest.raises(UsageError, match="No worker command"):
        AgentSpec(job_dir=tmp_path, command=())
    with pytest.raises(UsageError, match="--nproc-per-node '0'"):
        AgentSpec(job_dir=tmp_path, command=("x",), nproc_per_node=0)


def test_workers_die_with_a_sigkilled_agent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from hpc_elastic.agent.api import AgentSpec
        from hpc_elastic.agent.workers import WorkerGroup, WorkerPaths
        spec = AgentSpec(job_dir=Path({str(tmp_path)!r}), command=("sleep", "60"))
        paths = WorkerPaths(Path({str(tmp_path / "log")!r}), Path("/nonexistent"),
                            Path({str(tmp_path / "hb")!r}))
        group = WorkerGroup.start(spec, [dict(RANK="0")], [paths])
        print(group.workers[0].process.pid, flush=True)
        time.sleep(60)
        """
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert agent.stdout is not None
    worker_pid = int(agent.stdout.readline())
    _wait_for(lambda: _cmdline(worker_pid).startswith("sleep"))
    agent.kill()
    agent.wait()
    _wait_for(lambda: not _alive(worker_pid))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_for(condition: object, timeout: float = 10.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_standby_command_wraps_only_python_scripts_and_modules() -> None:
    from hpc_elastic.agent.standby import standby_command  # noqa: PLC0415

    script = standby_command(("python3", "-u", "train.py", "--lr", "1"), ("torch",))
    assert script is not None
    assert script[:3] == ["python3", "-u", "-c"]
    assert script[4:] == ["torch", "train.py", "--lr", "1"]
    module = standby_command(("/usr/bin/python", "-m", "pkg.train"), ("torch", "numpy"))
    assert module is not None
    assert module[3:] == ["torch,numpy", "-m", "pkg.train"]
    assert standby_command(("bash", "run.sh"), ("torch",)) is None
    assert standby_command(("python", "-c", "pass"), ("torch",)) is None
    assert standby_command(("python", "train.py"), ()) is None


def test_prewarmed_workers_get_the_rank_environment_and_logs(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="1", nproc_per_node=2, prewarm=("json",))
    cluster.start(1, FAKE_WORKER_FAIL="1:1:3", FAKE_WORKER_SECONDS="0.5")
    assert cluster.join() == {0: ExitCode.SUCCESS}
    assert cluster.envs(1)[1]["HPC_ELASTIC_ROUND"] == "1"
    envs = cluster.envs(2)
    assert sorted(envs) == [0, 1]
    assert envs[1]["LOCAL_RANK"] == "1"
    assert envs[1]["HPC_ELASTIC_ROUND"] == "2"
    log = cluster.job_dir / "logs" / "attempt_2" / "rank_1.log"
    assert "rank 1 of 2 starting round 2" in log.read_text()
    root = cluster.job.root_cause
    assert root is not None
    assert "ValueError: rank 1 fails" in root.message


def test_the_agent_imports_neither_torch_nor_kazoo_up_front() -> None:
    code = (
        "import sys, hpc_elastic.agent.command, hpc_elastic.agent.agent; "
        "print(sorted(m for m in ('torch', 'kazoo') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert result.stdout.strip() == "[]"
