"""In-place recovery (``agent --in-place`` with ``hpc_elastic.train.InPlace``), with real agents
on the in-memory rendezvous and real gloo workers (tests/workloads/train_inplace.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_fakes import MemoryJob
from cluster import free_port

from hpc_elastic import events
from hpc_elastic.agent import inplace as inplace_module
from hpc_elastic.agent.agent import Agent
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.ops import phases
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.spec import NodeRange
from hpc_elastic.train.assignment import (
    ROUND_KEYS,
    Assignment,
    is_collective_error,
    read_ack,
    read_assignment,
    write_ack,
    write_assignment,
)
from hpc_elastic.train.inplace import AbortWatch

WORKLOAD = Path(__file__).parents[1] / "workloads" / "train_inplace.py"
FAKE_WORKER = Path(__file__).parents[1] / "workloads" / "worker.py"
DIRECT = Path(__file__).parents[1] / "workloads" / "inplace_direct.py"
REPO = Path(__file__).resolve().parents[2]
JOB_DEADLINE = 600.0
"""Seconds a wait for a job's progress or end may take: generous, since beside two CPU-bound
processes and the rest of the suite a worker once took 133 s from its start to its first step
(torch's import and the process group), and a 40-step job 194 s in all."""
TEST_TIMEOUT = 1800
"""pytest-timeout's backstop for a test that runs two such jobs, never a speed check."""


@dataclass(frozen=True)
class Line:
    """One line of the workload's trace: a rank finished a step."""

    time: float
    step: int
    round: int
    rank: int
    world: int
    pid: int
    slot: str
    received: bool


def trace(out: Path) -> list[Line]:
    lines = []
    for text in (out / "trace").read_text().splitlines() if (out / "trace").exists() else ():
        t, step, rnd, rank, world, pid, slot, received = text.split()
        lines.append(
            Line(
                float(t),
                int(step),
                int(rnd),
                int(rank),
                int(world),
                int(pid),
                slot,
                received == "1",
            )
        )
    return lines


def run_nodes(
    tmp_path: Path,
    command: tuple[str, ...],
    *,
    during: Callable[[Path, list[Agent]], None] | None = None,
    nodes: str = "2",
    count: int = 2,
    **env: str,
) -> tuple[dict[int, ExitCode], MemoryJob, Path]:
    """``count`` in-place agents of one worker each (``{out}`` in ``command`` is the workers'
    output directory); ``during(out, agents)`` runs while they train. Returns the codes, the
    job and the job dir."""
    job = MemoryJob(
        RendezvousSettings(
            "run1",
            NodeRange.parse(nodes),
            last_call=0.3,
            session_timeout=1.0,
            min_wait=5.0,
            max_restarts=3,
        )
    )
    out, job_dir = tmp_path / "out", tmp_path / "job"
    out.mkdir(parents=True)
    spec = AgentSpec(
        job_dir=job_dir,
        command=tuple(word.replace("{out}", str(out)) for word in command),
        in_place=True,
    )
    codes: dict[int, ExitCode] = {}
    threads, agents = [], []
    for index in range(count):
        rdzv = job.rendezvous(NodeInfo(f"node{index}", "127.0.0.1", 1, f"n{index}"))
        environ = {**os.environ, "FAKE_WORKER_OUT": str(out), **env}
        agent = Agent(spec, rdzv, environ=environ, say=lambda _: None)
        agents.append(agent)

        def run(index: int = index, agent: Agent = agent) -> None:
            codes[index] = agent.run()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
    if during is not None:
        during(out, agents)
    for thread in threads:
        thread.join(JOB_DEADLINE)
        assert not thread.is_alive(), "agent did not finish"
    return codes, job, job_dir


def training(steps: int) -> tuple[str, ...]:
    return (sys.executable, str(WORKLOAD), "--out", "{out}", "--steps", str(steps))


def wait_for(condition: Callable[[], bool], timeout: float = JOB_DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def kill_the_worker_of_n1_at_step(step: int) -> Callable[[Path, list[Agent]], None]:
    def during(out: Path, agents: list[Agent]) -> None:
        wait_for(lambda: any(line.step >= step for line in trace(out)))
        victim = next(line.pid for line in trace(out) if line.slot == "n1")
        os.kill(victim, signal.SIGKILL)

    return during


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_survivor_keeps_its_process_and_a_replacement_gets_the_state_bitwise_exact(
    tmp_path: Path,
) -> None:
    steps = 40
    codes, _, _ = run_nodes(tmp_path / "uninterrupted", training(steps))
    assert codes == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}
    reference = tmp_path / "uninterrupted" / "out"

    codes, _, job_dir = run_nodes(
        tmp_path / "killed", training(steps), during=kill_the_worker_of_n1_at_step(10)
    )
    assert codes == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}
    out = tmp_path / "killed" / "out"
    lines = trace(out)
    survivor = {line.pid for line in lines if line.slot == "n0"}
    assert len(survivor) == 1, f"the survivor on n0 was restarted: pids {survivor}"
    assert max(line.round for line in lines if line.slot == "n0") > 1  # it went on in round 2
    n1 = [line for line in lines if line.slot == "n1"]
    first_pid = n1[0].pid
    replacement = [line for line in n1 if line.pid != first_pid]
    assert replacement, "n1's worker was not replaced"
    assert replacement[0].received, "the replacement did not receive the state by broadcast"
    assert replacement[0].step > 1  # it went on from the survivor's step, not from scratch
    assert (out / "final").read_text() == (reference / "final").read_text()
    history = list(events.read(job_dir / "events.jsonl"))
    on_n0 = [event.kind for event in history if event.slot == "n0"]
    assert events.Kind.WORKERS_KEPT in on_n0
    assert events.Kind.WORKERS_STOPPED not in on_n0
    # The recorded timeline: the kept round's row has its own phases (`events --phases`).
    (restart,) = phases.restarts(history)
    assert restart.in_place
    assert restart.phases == phases.IN_PLACE_PHASES
    formed, kept, ready, stepped = (
        restart.after[p] for p in ("formed", "kept", "ready", "stepped")
    )
    assert None not in (formed, kept, ready, stepped), restart.after
    assert formed is not None
    assert kept is not None
    assert ready is not None
    assert stepped is not None
    assert 0 <= formed <= kept  # an agent hands its survivors a round once it formed
    assert ready <= stepped


@pytest.mark.timeout(TEST_TIMEOUT)
def test_when_a_node_leaves_the_survivors_go_on_in_place_at_the_smaller_size(
    tmp_path: Path,
) -> None:
    def stop_n2(out: Path, agents: list[Agent]) -> None:
        wait_for(lambda: any(line.step >= 5 for line in trace(out)))
        agents[2].request_stop(signal.SIGTERM)

    codes, job, job_dir = run_nodes(tmp_path, training(30), during=stop_n2, nodes="2:3", count=3)
    failures = [
        (event.slot, event.round, event.details.get("message"))
        for event in events.read(job_dir / "events.jsonl")
        if event.kind == events.Kind.FAILURE
    ]
    assert codes == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS, 2: ExitCode.TERMINATED}, failures
    assert job.restarts_used == 0, failures  # a node change is free
    lines = trace(tmp_path / "out")
    for slot in ("n0", "n1"):
        pids = {line.pid for line in lines if line.slot == slot}
        assert len(pids) == 1, f"{slot}'s worker was restarted: pids {pids}"
    after = [line for line in lines if line.world == 2]
    assert {line.slot for line in after} == {"n0", "n1"}
    assert after[-1].step == 30
    assert min(line.step for line in after) > 1  # went on from the step they held


def test_a_loop_without_in_place_is_restarted_the_normal_way(tmp_path: Path) -> None:
    # The torch-free stand-in never enters InPlace: its agent must not keep it for round 2.
    codes, job, job_dir = run_nodes(
        tmp_path, (sys.executable, str(FAKE_WORKER)), FAKE_WORKER_FAIL="1:1:3:1"
    )
    assert codes == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}
    assert job.restarts_used == 1
    kinds = [event.kind for event in events.read(job_dir / "events.jsonl")]
    assert "workers_kept" not in kinds
    assert events.Kind.WORKERS_STOPPED in kinds


TAKES_ROUND_ONE = f"""
import os, runpy, sys
from pathlib import Path
from hpc_elastic.train.assignment import write_ack
if os.environ["HPC_ELASTIC_ROUND"] == "1":  # as InPlace would on entry, then never again
    write_ack(Path(os.environ["HPC_ELASTIC_ASSIGNMENT_FILE"]), 1)
runpy.run_path({str(FAKE_WORKER)!r}, run_name="__main__")
"""


def test_a_survivor_that_never_takes_up_its_round_is_killed_and_restarted_the_normal_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inplace_module, "ACK_TIMEOUT", 0.5)
    codes, job, job_dir = run_nodes(
        tmp_path,
        (sys.executable, "-c", TAKES_ROUND_ONE),
        FAKE_WORKER_FAIL="1:1:3:1",
        FAKE_WORKER_SECONDS="4",
    )
    assert codes == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}
    root = job.root_cause
    assert root is not None
    assert root.rank == 0
    assert "did not take up round 2 in place within 0.5 s" in root.message
    assert job.restarts_used == 2  # rank 1's failure, then rank 0's missed round
    kinds = [event.kind for event in events.read(job_dir / "events.jsonl")]
    assert "workers_kept" in kinds
    assert (tmp_path / "out" / "env_3_0.json").exists()  # rank 0 started afresh in round 3


def test_an_assignment_round_trips_and_refuses_anything_but_the_rounds_variables(
    tmp_path: Path,
) -> None:
    path = tmp_path / "assignment_0"
    env = {key: str(index) for index, key in enumerate(ROUND_KEYS)}
    write_assignment(path, Assignment(4, env))
    assert read_assignment(path) == Assignment(4, env)
    path.write_text('{"round": 5, "env": {"RANK": "1", "LD_PRELOAD": "/tmp/evil.so"}}')
    assert read_assignment(path) is None
    path.write_text("not json")
    assert read_assignment(path) is None
    assert read_assignment(tmp_path / "missing") is None


def test_an_acknowledgement_names_the_round_taken_up(tmp_path: Path) -> None:
    path = tmp_path / "assignment_0"
    assert read_ack(path) is None
    write_ack(path, 3)
    assert read_ack(path) == 3


def test_only_a_collective_failing_on_a_gone_peer_is_retried() -> None:
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:39618. This is typically caused by a remote worker crashing."
    )
    assert is_collective_error(gloo)
    assert not is_collective_error(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_collective_error(ValueError("connection closed"))


def test_the_nccl_watch_aborts_the_group_once_a_newer_round_is_written_during_a_step(
    tmp_path: Path,
) -> None:
    path = tmp_path / "assignment_0"
    env = {key: "0" for key in ROUND_KEYS}
    write_assignment(path, Assignment(1, env))
    aborted = threading.Event()
    with AbortWatch(path, 1, aborted.set, interval=0.01) as watch:
        write_assignment(path, Assignment(2, env))
        assert aborted.wait(30.0), "the watch did not abort the group"
    assert watch.aborted


class Ranks:
    """``world`` processes of tests/workloads/inplace_direct.py in round 1, with this test as
    their agent: it writes each one's assignment file itself."""

    def __init__(self, tmp_path: Path, scenario: str, world: int) -> None:
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.files = [tmp_path / f"assignment_{rank}" for rank in range(world)]
        self.processes: list[subprocess.Popen[bytes]] = []
        port = free_port()
        for rank in range(world):
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "OMP_NUM_THREADS": "1",
                "TORCHELASTIC_RUN_ID": "direct",
                "HPC_ELASTIC_ASSIGNMENT_FILE": str(self.files[rank]),
                **self.round_env(1, rank, world, port),
            }
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, str(DIRECT), "--out", str(self.out), "--scenario", scenario],
                    env=env,
                    stdout=(tmp_path / f"rank_{rank}.log").open("wb"),
                    stderr=subprocess.STDOUT,
                )
            )

    @staticmethod
    def round_env(number: int, rank: int, world: int, port: int) -> dict[str, str]:
        values = {
            "RANK": rank,
            "WORLD_SIZE": world,
            "GROUP_RANK": rank,
            "GROUP_WORLD_SIZE": world,
            "ROLE_RANK": rank,
            "ROLE_WORLD_SIZE": world,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "TORCHELASTIC_RESTART_COUNT": 0,
            "TORCHELASTIC_USE_AGENT_STORE": False,  # rank 0 opens the store, no agent here
            "HPC_ELASTIC_ROUND": number,
        }
        return {key: str(value) for key, value in values.items()}

    def hand_round(self, number: int, new_rank_of: dict[int, int]) -> None:
        """Round ``number`` to the processes (by their round-1 rank), as the agent writes it."""
        port, world = free_port(), len(new_rank_of)
        for old, new in new_rank_of.items():
            env = self.round_env(number, new, world, port)
            write_assignment(self.files[old], Assignment(number, env))

    def notes(self) -> list[dict[str, object]]:
        return [
            json.loads(line)
            for path in sorted(self.out.glob("log_*"))
            for line in path.read_text().splitlines()
        ]

    def wait_for(self, event: str, count: int) -> list[dict[str, object]]:
        wait_for(lambda: len(self.of(event)) >= count)
        return self.of(event)

    def of(self, event: str) -> list[dict[str, object]]:
        return [note for note in self.notes() if note["event"] == event]

    def finish(self) -> list[int | None]:
        for process in self.processes:
            try:
                process.wait(120.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return [process.returncode for process in self.processes]


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_survivor_blocked_on_a_live_peer_that_abandoned_its_step_takes_up_the_round_too(
    tmp_path: Path,
) -> None:
    # Rank 1's receive from the departed rank 2 fails; rank 0 receives from rank 1, which is
    # alive. Rank 0 must learn of it when rank 1 leaves its broken group, not after the old
    # group's collective timeout (600 s here): that wait missed the agent's 30-s deadline for
    # taking up a round, and the node-leave test above spent two restarts on a loaded machine.
    ranks = Ranks(tmp_path, "blocked", world=3)
    wait_for(lambda: any(note["rank"] == 1 for note in ranks.of("failed")))
    ranks.hand_round(2, {0: 0, 1: 1})
    reformed = ranks.wait_for("reformed", 2)
    assert sorted((note["rank"], note["round"], note["world"]) for note in reformed) == [
        (0, 2, 2),
        (1, 2, 2),
    ]
    assert all(note["total"] == 2.0 for note in reformed)
    assert {note["rank"] for note in ranks.of("failed")} == {0, 1}  # rank 0's receive failed
    assert ranks.finish() == [0, 0, 0]


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_checkpoint_after_an_in_place_change_is_fenced_by_the_new_round_and_its_rank_0(
    tmp_path: Path,
) -> None:
    ranks = Ranks(tmp_path, "checkpoint", world=2)
    first = ranks.wait_for("saved", 2)
    assert {note["step"] for note in first} == {1}
    writer_1 = ranks.processes[0].pid  # round 1's rank 0
    ranks.hand_round(2, {0: 1, 1: 0})  # round 2: the ranks swap
    saved = [note for note in ranks.wait_for("saved", 4) if note["step"] == 2]
    assert ranks.finish() == [0, 0]
    assert {(note["rank"], note["round"]) for note in saved} == {(0, 2), (1, 2)}
    new_rank_0 = next(note["pid"] for note in saved if note["rank"] == 0)
    assert new_rank_0 == ranks.processes[1].pid != writer_1  # round 1's rank 1 wrote step 2
    directory = ranks.out / "checkpoints"
    manifest = json.loads(
        (directory / Path(str(saved[0]["path"])).name / "manifest.json").read_text()
    )
    assert manifest["step"] == 2
    assert (
        manifest["round"] == 2
    )  # stamped and fenced by the new round, not the one it was built in
    assert sorted(path.name.split("-")[-1] for path in directory.glob(".round-*")) == ["00000002"]
