"""Agents as real processes against the real ZooKeeper, with real torch/gloo workers.

Each test runs ``python -m hpc_elastic agent`` processes on this machine (the fast path),
or through Slurm for the node-crash test, and checks training went on from its checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from cluster import Cluster, wait_until

from hpc_elastic import events

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
TRAIN = Path(__file__).parents[1] / "workloads" / "train_gloo.py"


class Job:
    """Several agents of one run, their output, and the training progress they made."""

    def __init__(self, cluster: Cluster, zk_root: str, tmp_path: Path, nodes: str) -> None:
        self.cluster = cluster
        self.zk = f"{cluster.zk_hosts}{zk_root}"
        self.nodes = nodes
        self.dir = tmp_path / "job"
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.agents: list[subprocess.Popen[str]] = []

    def argv(self, slot: str, *train_args: str, **flags: str) -> list[str]:
        options = {
            "run-id": "run",
            "job-dir": str(self.dir),
            "zk": self.zk,
            "nodes": self.nodes,
            "max-restarts": "3",
            "grace": "5",
            "session-timeout": "2",
            "last-call": "1",
            "min-wait": "20",
            "slot": slot,
            "host": "127.0.0.1",
            **{key.replace("_", "-"): value for key, value in flags.items()},
        }
        return [
            sys.executable,
            "-m",
            "hpc_elastic",
            "agent",
            *(f"--{key}={value}" for key, value in options.items()),
            "--zk-open-acl",
            "--",
            sys.executable,
            "-u",
            str(TRAIN),
            f"--out={self.out}",
            *train_args,
        ]

    def start(self, count: int, *train_args: str, **flags: str) -> None:
        env = {**self.cluster.env, "PYTHONPATH": str(REPO)}
        for _ in range(count):
            slot = f"a{len(self.agents)}"
            self.agents.append(
                subprocess.Popen(
                    self.argv(slot, *train_args, **flags),
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )

    def wait(self, timeout: float = 300) -> list[tuple[int, str]]:
        """Every agent's exit code and output, once all have exited. The deadline is for a
        hang, not a speed limit: two attempts that take 8 s on a quiet machine took 90 s
        at a load of 40 on 2 cores (each rank's torch import, twice, on a starved core)."""
        results = []
        for agent in self.agents:
            output, _ = agent.communicate(timeout=timeout)
            results.append((agent.returncode, output))
        return results

    def progress(self) -> list[tuple[float, int, int, int]]:
        path = self.out / "progress"
        if not path.exists():
            return []
        rows = [line.split() for line in path.read_text().splitlines()]
        return [(float(t), int(s), int(w), int(r)) for t, s, w, r, _ in rows]

    def worker_pids(self, agent: subprocess.Popen[str]) -> list[int]:
        """The agent's running workers; standbys still write to /dev/null."""
        children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        return [int(pid) for pid in children if _stdout(int(pid)) != os.devnull]

    def kill_all(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                agent.kill()
            agent.wait()


MakeJob = Callable[[str], Job]


@pytest.fixture
def job(cluster: Cluster, zk_root: str, tmp_path: Path) -> Iterator[MakeJob]:
    created: list[Job] = []

    def make(nodes: str) -> Job:
        created.append(Job(cluster, zk_root, tmp_path, nodes))
        return created[-1]

    yield make
    for each in created:
        each.kill_all()


@pytest.mark.parametrize("prewarm", [False, True], ids=["cold", "prewarm"])
def test_sigkilled_worker_restarts_the_group_from_its_checkpoint(
    job: MakeJob, prewarm: bool
) -> None:
    run = job("3")
    run.start(3, "--steps=40", **({"prewarm": "torch"} if prewarm else {}))
    assert wait_until(lambda: len(run.progress()) >= 5, 60)
    os.kill(run.worker_pids(run.agents[1])[0], signal.SIGKILL)
    results = run.wait()
    assert [code for code, _ in results] == [0, 0, 0], results
    progress = run.progress()
    steps = [step for _, step, _, _ in progress]
    assert steps == list(range(1, 41)), "training resumed from its checkpoint, no step lost"
    assert progress[-1][3] == 1, "one restart spent"
    assert sum("root cause" in output for _, output in results) == 1
    assert "SIGKILL" in results[1][1]


def test_sigkilled_agent_leaves_and_the_survivors_reform(job: MakeJob) -> None:
    run = job("2:3")
    run.start(3, "--steps=60")
    assert wait_until(lambda: len(run.progress()) >= 5, 60)
    workers = run.worker_pids(run.agents[2])
    run.agents[2].kill()
    # PDEATHSIG acts at once; the deadline is generous for a loaded machine, not a measure.
    assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 60)
    results = run.wait()
    assert [code for code, _ in results[:2]] == [0, 0], results
    worlds = [world for _, _, world, _ in run.progress()]
    assert worlds[0] == 3
    assert worlds[-1] == 2
    assert run.progress()[-1][3] == 0, "losing a node spends no restart"


def test_a_stopped_worker_is_caught_by_the_heartbeat(job: MakeJob) -> None:
    run = job("2")
    # 12 s of training, so that a loaded machine still stops the worker well before its end.
    run.start(2, "--steps=40", "--sleep=0.3", hang_timeout="2")
    assert wait_until(lambda: len(run.progress()) >= 5, 60)
    rank0 = int((run.out / "progress").read_text().split()[4])  # the training rank 0 itself
    os.kill(rank0, signal.SIGSTOP)
    results = run.wait()
    assert [code for code, _ in results] == [0, 0], results
    # Rank 1 waits for the stopped rank 0 in all_reduce, so its heartbeat stops too: either
    # agent may be the first to call its rank hung. Either way the hang is caught in the round
    # that was stopped, and no later round fails.
    failures = [event for event in events.read(run.dir / "events.jsonl") if event.kind == "failure"]
    assert {event.round for event in failures} == {1}, [event.details for event in failures]
    assert any(event.details["hung"] for event in failures), [e.details for e in failures]
    assert any("made no progress" in output for _, output in results), results
    # Before the kill every local rank dumped its stacks; the root cause says where it was.
    assert any("its log has every thread's stack" in output for _, output in results), results
    assert run.progress()[-1][3] == 1


def test_spent_budget_fails_the_job_and_shows_the_root_cause(job: MakeJob) -> None:
    run = job("2")
    run.start(2, "--fail", max_restarts="1")
    results = run.wait()
    assert [code for code, _ in results] == [1, 1], results
    everything = "".join(output for _, output in results)
    assert "ValueError: rank" in everything
    assert "refuses to train" in everything
    for _, output in results:
        assert "all 1 restarts are spent" in output, output


def test_preemption_signal_reaches_workers_and_exits_for_requeue(job: MakeJob) -> None:
    run = job("2")
    run.start(2, "--steps=1000")
    assert wait_until(lambda: len(run.progress()) >= 3, 60)
    for agent in run.agents:
        agent.send_signal(signal.SIGUSR2)
    results = run.wait()
    assert [code for code, _ in results] == [75, 75], results
    for _, output in results:
        assert "Got SIGUSR2; forwarding it to the workers" in output, output


def test_crashed_slurm_node_is_dropped_and_the_rest_go_on(
    cluster: Cluster, zk_root: str, tmp_path: Path
) -> None:
    """One step per node, so a crashed node takes only its own agent with it."""
    run = Job(cluster, zk_root, tmp_path, "2:3")
    agent = " ".join(run.argv("$node", "--steps=80"))
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --nodes=3 --no-kill --no-requeue --output={tmp_path}/slurm.out\n"
        'for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do\n'
        f'  srun --nodes=1 --ntasks=1 --nodelist="$node" {agent} > {tmp_path}/$node.log 2>&1 &\n'
        "done\n"
        "wait\n"
    )
    env = {**cluster.env, "PYTHONPATH": str(REPO)}
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, check=True
    )
    job_id = submitted.stdout.strip()
    try:
        assert wait_until(lambda: len(run.progress()) >= 5, 90), tmp_path / "slurm.out"
        assert run.progress()[-1][2] == 3
        cluster.node_kill("n3")
        assert wait_until(lambda: run.progress()[-1][2] == 2, 30), "no step at world size 2"
        assert wait_until(lambda: run.progress()[-1][1] == 80, 60), "training did not finish"
        for log in (tmp_path / "n1.log", tmp_path / "n2.log"):
            assert wait_until(partial(_says, log, "finished"), 20), log.read_text()
    finally:
        cluster.run(["scancel", job_id], check=False)
        cluster.node_start("n3")


def _says(log: Path, text: str) -> bool:
    return text in log.read_text()


def _stdout(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""
