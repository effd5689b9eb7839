"""The agent's life cycle against an in-memory rendezvous, with fast torch-free workers."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from agent_fakes import MemoryJob

from hpc_elastic import events, logs
from hpc_elastic.agent.agent import Agent
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.agent.rules import (
    ENDS_ROUND,
    AfterRound,
    Outcome,
    RoundEnd,
    after_round,
    overslept,
    restart_reason,
    round_outcome,
)
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.spec import NodeRange
from hpc_elastic.train.exitcodes import FENCED_EXIT_CODE

WORKER = Path(__file__).parents[1] / "workloads" / "worker.py"
REPO = Path(__file__).resolve().parents[2]


class Cluster:
    """N agents in threads sharing one MemoryJob (the real rendezvous); one run() thread each."""

    def __init__(self, tmp_path: Path, nodes: str = "2", max_restarts: int = 3, **spec: object):
        self.job = MemoryJob(
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
            rdzv = self.job.rendezvous(
                NodeInfo(f"node{index}", "127.0.0.1", self.spec.nproc_per_node, f"n{index}")
            )
            environ = {**os.environ, "FAKE_WORKER_OUT": str(self.out), **env}
            agent = Agent(self.spec, rdzv, environ=environ, say=self.said.append)
            self.agents.append(agent)
            thread = threading.Thread(target=self._run, args=(index, agent), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _run(self, index: int, agent: Agent) -> None:
        self.codes[index] = agent.run()

    def join(self, timeout: float = 120.0) -> dict[int, ExitCode]:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "agent did not finish"
        return self.codes

    def envs(self, round_: int) -> dict[int, dict[str, str]]:
        found = {}
        for path in self.out.glob(f"env_{round_}_*.json"):
            try:
                env = json.loads(path.read_text())
            except json.JSONDecodeError:
                continue  # the worker is still writing it: a later look finds it whole
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
        assert env["HPC_ELASTIC_RUN_ID"] == "run1"  # one tracker run across requeues
        assert (env["WANDB_RUN_ID"], env["WANDB_RESUME"]) == ("run1", "allow")
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
    assert any("all 0 restarts are spent" in line and "rank 0" in line for line in cluster.said)
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


def training_alone(tmp_path: Path) -> Cluster:
    """One agent whose two workers train for 30 s (a stop signal ends them first); returns
    once they are training: both wrote their environment and the agent reads a step."""
    cluster = Cluster(tmp_path, nodes="1", nproc_per_node=2, grace=5.0)
    cluster.start(1, FAKE_WORKER_SECONDS="30")
    _wait_for(lambda: len(cluster.envs(1)) == 2)
    _wait_for(lambda: cluster.agents[0].step() is not None)
    return cluster


def test_preemption_signal_is_forwarded_and_exits_for_requeue(tmp_path: Path) -> None:
    cluster = training_alone(tmp_path)
    cluster.agents[0].request_stop(signal.SIGUSR2)
    assert cluster.join() == {0: ExitCode.PREEMPTED}
    assert (cluster.out / "saved_0").exists()
    assert (cluster.out / "saved_1").exists()
    assert "preempt" in cluster.kinds()


def test_a_node_whose_workers_stop_for_a_peers_preemption_rejoins(tmp_path: Path) -> None:
    """The training helpers stop every rank at the step where any rank got the preemption
    signal, so the workers of a node that was not preempted exit 75 too: that node rejoins."""
    cluster = Cluster(tmp_path, nodes="1:2", nproc_per_node=1, grace=5.0)
    cluster.job = MemoryJob(
        RendezvousSettings("run1", NodeRange(1, 2), last_call=2.0, session_timeout=1.0)
    )
    cluster.start(1, FAKE_WORKER_SECONDS="30")
    _wait_for(lambda: "node0" in cluster.job.server.member_ids)  # node0 joins first: it has rank 0.
    cluster.start(1, FAKE_WORKER_FAIL="1:1:75", FAKE_WORKER_SECONDS="30")
    _wait_for(lambda: len(cluster.envs(1)) == 2)
    cluster.agents[0].request_stop(signal.SIGUSR2)
    _wait_for(lambda: len(cluster.envs(2)) == 1)
    assert cluster.envs(2)[0]["HPC_ELASTIC_SLOT"] == "n1"
    cluster.agents[1].request_stop(signal.SIGTERM)
    assert cluster.join() == {0: ExitCode.PREEMPTED, 1: ExitCode.TERMINATED}
    assert cluster.job.restarts_used == 0


def test_workers_stopped_for_an_arrival_get_the_time_to_save_a_slow_step(tmp_path: Path) -> None:
    """A step boundary 3 s away, past the 2 s stop grace and the 1/3 s lease: after an
    arrival every rank is healthy, so the worker gets ``arrival_grace`` and a lease kept fresh,
    and its save lands before the bigger round starts (a 2.2 s step was SIGKILLed at a grow in
    CI, and the bigger round restarted from nothing)."""
    cluster = Cluster(tmp_path, nodes="1:2", nproc_per_node=1)
    assert st.arrival_grace(cluster.job.settings) > 3.0 > cluster.spec.stop_grace
    cluster.start(1, FAKE_WORKER_SECONDS="60", FAKE_WORKER_SAVE_SECONDS="3")
    _wait_for(lambda: cluster.agents[0].step() is not None)
    cluster.start(1, FAKE_WORKER_SECONDS="60")
    _wait_for(lambda: len(cluster.envs(2)) == 2)
    assert (cluster.out / "saved_0").exists(), "the slow save was SIGKILLed or fenced"
    for agent in cluster.agents:
        agent.request_stop(signal.SIGTERM)
    assert sorted(cluster.join()) == [0, 1]
    assert cluster.job.restarts_used == 0


def test_below_min_nodes_fails_after_min_wait(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="2")
    cluster.job = MemoryJob(
        RendezvousSettings("run1", NodeRange(2, 2), min_wait=0.5, session_timeout=1.0)
    )
    cluster.start(1)
    assert cluster.join() == {0: ExitCode.FAILED}
    assert any("only 1 of the 2 nodes needed joined within 0.5 s" in line for line in cluster.said)


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
        time.sleep(60)  # the agent lives on until the test SIGKILLs it
        """
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
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


def _wait_for(condition: object, timeout: float = 60.0) -> None:
    """Poll until ``condition()``; the deadline is generous for a loaded machine, not a bound
    the test asserts (a passing run returns as soon as the condition holds)."""
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
        cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert result.stdout.strip() == "[]"


def test_a_node_that_succeeded_reruns_when_a_peer_fails_afterwards(tmp_path: Path) -> None:
    """The exit-barrier deadlock: rank 0 finished and waited in the barrier while rank 1's
    failure waited for a round that the success blocked. Budget is left, so both rerun."""
    cluster = Cluster(tmp_path, nodes="2", nproc_per_node=1)
    cluster.start(2, FAKE_WORKER_FAIL="1:1:1:1.0", FAKE_WORKER_SECONDS="0.1")
    assert cluster.join() == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}
    assert cluster.job.restarts_used == 1
    assert sorted(cluster.envs(2)) == [0, 1]
    restarts = [e for e in events.read(cluster.job_dir / "events.jsonl") if e.kind == "restart"]
    assert "failure on another node" in [event.details["reason"] for event in restarts]


def test_sigint_reaches_each_worker_exactly_once(tmp_path: Path) -> None:
    cluster = training_alone(tmp_path)
    cluster.agents[0].request_stop(signal.SIGINT)
    # The fake workers save and exit 75 on any stop signal, which asks for a requeue.
    assert cluster.join() == {0: ExitCode.PREEMPTED}
    assert (cluster.out / "signals_0").read_text() == "1"
    assert (cluster.out / "signals_1").read_text() == "1"


def test_a_cut_off_agent_stops_its_workers_and_exits_for_requeue(tmp_path: Path) -> None:
    """Split brain, agent side: SUSPENDED for about a session timeout stops the workers (the
    others may re-form without us); the rendezvous stays out of reach, so the agent exits 75
    with its reason instead of letting the error kill the workers without grace."""
    cluster = Cluster(tmp_path, nodes="1", nproc_per_node=1)
    cluster.start(1, FAKE_WORKER_SECONDS="30")
    _wait_for(lambda: len(cluster.envs(1)) == 1)
    store = cluster.agents[0].rdzv._store  # type: ignore[attr-defined]
    store.disconnect()
    assert cluster.join() == {0: ExitCode.PREEMPTED}
    found = list(events.read(cluster.job_dir / "events.jsonl"))
    reasons = [event.details.get("reason") for event in found if event.kind == "restart"]
    assert reasons == ["connection lost"]
    errors = [event for event in found if event.kind == "error"]
    assert len(errors) == 1
    assert "out of reach" in str(errors[0].details["reason"])
    assert any("Lost touch with the rendezvous" in line for line in cluster.said)


def test_workers_get_a_lease_that_the_agent_renews_while_the_round_is_live(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path, nodes="1", nproc_per_node=1)
    cluster.start(1, FAKE_WORKER_SECONDS="3")
    _wait_for(lambda: len(cluster.envs(1)) == 1)
    env = cluster.envs(1)[0]
    assert env["HPC_ELASTIC_LEASE_TIMEOUT"] == "0.333333"  # a third of the 1 s session
    lease = Path(env["HPC_ELASTIC_LEASE_FILE"])
    first = lease.stat().st_mtime_ns
    _wait_for(lambda: lease.stat().st_mtime_ns > first)
    assert cluster.join() == {0: ExitCode.SUCCESS}


def test_events_name_the_agents_phase(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="1")
    cluster.start(1)
    assert cluster.join() == {0: ExitCode.SUCCESS}
    phases = {e.kind: e.details["phase"] for e in events.read(cluster.job_dir / "events.jsonl")}
    assert phases[events.Kind.JOIN] == "joining"
    assert phases[events.Kind.START] == "running"
    assert phases[events.Kind.DONE] == "succeeding"


def test_a_worker_that_fenced_itself_ends_the_round_without_spending_the_budget() -> None:
    decided = round_outcome(
        [FENCED_EXIT_CODE, None], stop_requested=False, changed=False, fenced=False
    )
    assert decided == (Outcome.FENCED, None)


def reaction(
    end: RoundEnd,
    *,
    barrier: bool = True,
    heard: bool = False,
    unfixable: bool = False,
    stop_after: AfterRound | None = None,
) -> list[AfterRound]:
    """The actions ``after_round`` takes for ``end``, each action adding the fact the world
    gives it (the barrier's answer, whether the change was heard, ...); a stop signal arrives
    right after the action ``stop_after``."""
    learned = {
        AfterRound.BARRIER: {"barrier": barrier},
        AfterRound.STOP_WORKERS: {"workers_stopped": True},
        AfterRound.KEEP_WORKERS: {"workers_stopped": True},
        AfterRound.WAIT_FOR_CHANGE: {"heard_change": heard},
        AfterRound.ANNOUNCE_FAILURE: {"announced": True, "unfixable": unfixable},
        AfterRound.REPORT_FAILURE: {"reported": True},
        AfterRound.FAIL_JOB: {"reported": True},
    }
    actions: list[AfterRound] = []
    while not actions or actions[-1] not in ENDS_ROUND:
        assert len(actions) < 10, f"after_round never settles: {actions}"
        action = after_round(end)
        actions.append(action)
        end = replace(end, **learned.get(action, {}))  # type: ignore[arg-type]
        if action is stop_after:
            end = replace(end, stop_signal=True)
    return actions


A = AfterRound


def test_a_failed_worker_is_stopped_announced_and_reported_before_the_node_rejoins() -> None:
    failed = RoundEnd(Outcome.FAILED)
    assert reaction(failed) == [A.STOP_WORKERS, A.ANNOUNCE_FAILURE, A.REPORT_FAILURE, A.REJOIN]
    assert restart_reason(replace(failed, reported=True)) == "worker failure"


def test_an_echo_waits_to_hear_of_the_peer_and_only_reports_when_nothing_comes() -> None:
    echo = RoundEnd(Outcome.FAILED, echo=True)
    assert reaction(echo, heard=True) == [A.STOP_WORKERS, A.WAIT_FOR_CHANGE, A.REJOIN]
    assert restart_reason(replace(echo, heard_change=True)) == "peer failure"
    assert reaction(echo, heard=False) == [
        A.STOP_WORKERS,
        A.WAIT_FOR_CHANGE,
        A.ANNOUNCE_FAILURE,
        A.REPORT_FAILURE,
        A.REJOIN,
    ]
    hung = replace(echo, hung=True)  # a hang is nobody's echo
    assert A.WAIT_FOR_CHANGE not in reaction(hung, heard=True)


def test_an_echo_whose_wait_ran_out_while_the_agent_was_stalled_listens_again() -> None:
    echo = RoundEnd(Outcome.FAILED, echo=True, workers_stopped=True)
    assert after_round(replace(echo, heard_change=False, stalled=True)) is A.WAIT_FOR_CHANGE
    assert after_round(replace(echo, heard_change=False)) is A.ANNOUNCE_FAILURE
    assert overslept(10.0, 11.5)
    assert not overslept(10.0, 10.1)  # one poll late is jitter


def test_an_echo_whose_wait_ran_out_while_cut_off_rejoins_without_spending_a_restart() -> None:
    echo = RoundEnd(Outcome.FAILED, echo=True, workers_stopped=True)
    cut_off = replace(echo, heard_change=False, cut_off=True)
    assert after_round(cut_off) is A.REJOIN
    assert restart_reason(cut_off) == "connection lost"
    # A rank's own failure (no echo) or a hang is reported whatever the connection.
    assert after_round(replace(cut_off, echo=False)) is A.ANNOUNCE_FAILURE
    assert after_round(replace(cut_off, hung=True)) is A.ANNOUNCE_FAILURE


def test_a_failure_no_restart_can_fix_fails_the_job_and_rejoins_without_a_restart_event() -> None:
    failed = RoundEnd(Outcome.FAILED)
    actions = reaction(failed, unfixable=True)
    assert actions == [A.STOP_WORKERS, A.ANNOUNCE_FAILURE, A.FAIL_JOB, A.REJOIN]
    assert restart_reason(replace(failed, unfixable=True, reported=True)) is None


def test_a_stop_signal_before_the_announcement_leaves_unreported_and_after_it_reports_first() -> (
    None
):
    """After it the failure counts for the job (a full disk would otherwise follow the job
    from node to node for ever); the bad-node watch asks to leave from the failure event."""
    failed = RoundEnd(Outcome.FAILED)
    assert reaction(failed, stop_after=A.STOP_WORKERS) == [A.STOP_WORKERS, A.LEAVE]
    assert reaction(failed, stop_after=A.ANNOUNCE_FAILURE) == [
        A.STOP_WORKERS,
        A.ANNOUNCE_FAILURE,
        A.REPORT_FAILURE,
        A.LEAVE,
    ]


def test_membership_changes_and_fencing_rejoin_without_spending_the_budget() -> None:
    for outcome in (Outcome.CHANGED, Outcome.FENCED):
        actions = reaction(RoundEnd(outcome))
        assert actions == [A.STOP_WORKERS, A.REJOIN], outcome
    assert restart_reason(RoundEnd(Outcome.FENCED)) == "connection lost"


def test_in_place_survivors_are_kept_except_after_a_fence_or_a_signal() -> None:
    for outcome in (Outcome.CHANGED, Outcome.FAILED):
        assert reaction(RoundEnd(outcome, takes_rounds=True))[0] is A.KEEP_WORKERS
    assert reaction(RoundEnd(Outcome.FENCED, takes_rounds=True))[0] is A.STOP_WORKERS
    assert reaction(RoundEnd(Outcome.SIGNALLED, takes_rounds=True)) == [A.DRAIN]


def test_a_success_waits_in_the_barrier_and_reruns_when_a_peer_failed() -> None:
    succeeded = RoundEnd(Outcome.SUCCEEDED)
    assert reaction(succeeded) == [A.BARRIER, A.DONE]
    assert reaction(succeeded, barrier=False) == [A.BARRIER, A.REJOIN]
    assert restart_reason(succeeded) == "failure on another node"


def test_a_stop_signal_in_the_barrier_leaves_and_signals_and_preemption_drain() -> None:
    stopped = RoundEnd(Outcome.SUCCEEDED, stop_signal=True)
    assert reaction(stopped) == [A.LEAVE]
    assert reaction(RoundEnd(Outcome.SIGNALLED)) == [A.DRAIN]
    assert reaction(RoundEnd(Outcome.PREEMPTED)) == [A.DRAIN_PREEMPTED]


def test_hpc_elastic_log_debug_shows_rendezvous_decisions_and_phase_changes(
    tmp_path: Path,
) -> None:
    """One exported variable reaches the agents that ``hpc-elastic run`` starts, and their log
    (stderr) then carries the handler's decisions and the agent's phase changes."""
    (tmp_path / "ok.py").write_text("print('trained')\n")
    result = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "run", "--no-prewarm", "--log-dir=runs", "ok.py"],
        cwd=tmp_path,
        env={**os.environ, "HPC_ELASTIC_LOG": "debug", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (log,) = (tmp_path / "runs").glob("*/logs/agent_*.log")
    text = log.read_text()
    assert "DEBUG hpc_elastic.rendezvous.handler" in text, text
    assert "decided" in text, text
    assert "DEBUG hpc_elastic.agent.agent" in text, text
    assert "joining -> running" in text, text


def test_hpc_elastic_log_accepts_levels_and_ignores_anything_else() -> None:
    assert logs.level_from_env({"HPC_ELASTIC_LOG": "DEBUG"}) == logging.DEBUG
    assert logs.level_from_env({"HPC_ELASTIC_LOG": "warning"}) == logging.WARNING
    assert logs.level_from_env({"HPC_ELASTIC_LOG": "loud"}) is None
    assert logs.level_from_env({}) is None


def test_a_failure_elsewhere_stops_a_rank_that_outlives_its_sigterm_without_the_grace(
    tmp_path: Path,
) -> None:
    """A framework's rank may outlive the collective that failed on a dead peer (Lightning
    tears down first) and catch SIGTERM: it can never reach a step boundary, so only a saving
    rank is waited for, even on the node whose own worker did not fail."""
    cluster = Cluster(tmp_path, nodes="2", stop_grace=600.0, grace=1.0)
    cluster.start(
        2,
        FAKE_WORKER_SECONDS="600",
        FAKE_WORKER_SAVE_SECONDS="600",  # takes SIGTERM and "saves" for 10 minutes
        FAKE_WORKER_FAIL="1:1:1:1.0",  # round 1's rank 1 fails after a second
    )
    try:
        # Round 2 starts long before the 600-s stop grace could have run out.
        _wait_for(lambda: sorted(cluster.envs(2)) == [0, 1], timeout=120.0)
    finally:
        for agent in cluster.agents:
            agent.request_stop(signal.SIGTERM)
    cluster.join()
    history = list(events.read(cluster.job_dir / "events.jsonl"))
    outcomes = sorted(
        str(e.details.get("outcome")) for e in history if e.kind == "round_ended" and e.round == 1
    )
    # One node's worker failed; the other saw its round end for a change, and stopped anyway.
    assert outcomes == ["changed", "failed"], outcomes
    assert not list(cluster.out.glob("saved_*"))  # nobody was left the time to "save"


def test_a_round_lost_a_rank_when_a_failure_was_recorded_or_a_member_is_gone() -> None:
    members = tuple(NodeInfo(f"n{i}", "127.0.0.1", 1, f"n{i}") for i in range(2))
    state = st.JobState(max_restarts=3, round=4, members=members)
    everyone = frozenset({"n0", "n1"})
    assert not st.peer_lost(state, everyone, 4)
    assert not st.peer_lost(replace(state), everyone | {"n2"}, 4)  # an arrival: all alive
    assert st.peer_lost(state, frozenset({"n0"}), 4)  # n1 is gone
    assert st.peer_lost(replace(state, failed_round=4), everyone, 4)
    assert st.peer_lost(replace(state, excluded=("n1",)), everyone, 4)  # left out as stuck
    assert not st.peer_lost(state, frozenset({"n0"}), 3)  # not the round that ended
