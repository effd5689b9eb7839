"""The agent with its watchdog (issue 16): hangs caught by learned deadlines, user errors
not retried, the breaker for restarts without progress; real agents and workers on the
in-memory rendezvous, as in test_agent.py."""

from __future__ import annotations

import os
import sys
import textwrap
import threading
from pathlib import Path

from agent_fakes import MemoryJob

from hpc_elastic import events
from hpc_elastic.agent.agent import Agent
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.agent.watchdog import DEFAULT_RULES, DeadlineRule, Phase
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.spec import NodeRange

WORKER = Path(__file__).parents[1] / "workloads" / "worker.py"
QUICK = {
    **DEFAULT_RULES,
    Phase.STEP: DeadlineRule(initial=20.0, floor=0.5, percentile=99.0, factor=5.0, min_samples=5),
}
"""Learned step deadlines with a floor of half a second instead of a minute."""


def run_agents(
    tmp_path: Path,
    command: tuple[str, ...],
    *,
    count: int = 1,
    max_restarts: int = 3,
    env: dict[str, str] | None = None,
    rules: dict[Phase, DeadlineRule] | None = None,
    nproc: int = 2,
    session_timeout: float = 1.0,
) -> tuple[MemoryJob, dict[int, ExitCode], list[str], list[events.Event]]:
    job = MemoryJob(
        RendezvousSettings(
            "run1",
            NodeRange.parse(str(count)),
            last_call=0.3,
            session_timeout=session_timeout,
            min_wait=5.0,
            max_restarts=max_restarts,
        )
    )
    out = tmp_path / "out"
    out.mkdir()
    spec = AgentSpec(job_dir=tmp_path / "job", command=command, nproc_per_node=nproc)
    said: list[str] = []
    codes: dict[int, ExitCode] = {}
    threads = []
    for index in range(count):
        rdzv = job.rendezvous(NodeInfo(f"node{index}", "127.0.0.1", nproc, f"n{index}"))
        environ = {**os.environ, "FAKE_WORKER_OUT": str(out), **(env or {})}
        agent = Agent(spec, rdzv, environ=environ, say=said.append, deadline_rules=rules)

        def run(index: int = index, agent: Agent = agent) -> None:
            codes[index] = agent.run()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(60.0)
        assert not thread.is_alive(), "an agent did not finish"
    return job, codes, said, list(events.read(spec.job_dir / "events.jsonl"))


def test_a_hang_is_caught_by_a_learned_deadline_without_any_hang_timeout(tmp_path: Path) -> None:
    job, codes, said, recorded = run_agents(
        tmp_path,
        (sys.executable, str(WORKER)),
        env={"FAKE_WORKER_STOP": "1:0", "FAKE_WORKER_SECONDS": "4"},
        rules=QUICK,
    )
    assert codes == {0: ExitCode.SUCCESS}
    root = job.root_cause
    assert root is not None
    assert root.rank == 0
    assert "made no progress" in root.message
    assert "in step (learned deadline" in root.message
    assert [e.details["hung"] for e in recorded if e.kind == "failure"] == [True]
    # The agent's own output says who hung, then where, and where its stacks are.
    [told] = [line for line in said if line.startswith("Hang, root cause: Rank 0 on node")]
    assert "\n    Rank 0 hung in worker.py:" in told, told
    assert told.endswith("; its log has every thread's stack."), told


def test_a_user_error_fails_the_job_at_once_without_spending_a_restart(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import tochvision\n")
    job, codes, said, recorded = run_agents(
        tmp_path, (sys.executable, str(script)), count=2, max_restarts=3
    )
    assert codes == {0: ExitCode.FAILED, 1: ExitCode.FAILED}
    assert job.restarts_used == 0
    assert any("ModuleNotFoundError, which no restart can fix" in line for line in said)
    assert "user_error" in [event.kind for event in recorded]
    assert {event.round for event in recorded if event.kind == "round"} == {1}


def test_the_breaker_stops_a_job_that_keeps_failing_without_a_new_checkpoint(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise RuntimeError('CUDA error: an illegal memory access')\n")
    job, codes, said, recorded = run_agents(
        tmp_path, (sys.executable, str(script)), max_restarts=20
    )
    assert codes == {0: ExitCode.FAILED}
    sentence = (
        "The job restarted 5 times since the start (no checkpoint yet) without progress; fix "
        "the cause in the workers' logs, then resubmit."
    )
    assert sentence in said
    assert job.restarts_used == 4  # the fifth failure tripped the breaker instead
    assert [event.details["reason"] for event in recorded if event.kind == "breaker"] == [sentence]


LEARNING = """
import os, time
from hpc_elastic.train.heartbeat import Heartbeat

beat = Heartbeat(min_interval=0.0)
for step in range(20):
    beat.beat(step)
    time.sleep(0.05)  # a step's work (the scenario): QUICK learns a deadline of about 0.5 s
"""
"""The start of a worker whose step deadline the watchdog has learned (with ``QUICK``)."""


def learned_worker(tmp_path: Path, then: str) -> tuple[str, ...]:
    """The command of a worker that runs ``LEARNING``, then the code ``then``."""
    script = tmp_path / "train.py"
    script.write_text(LEARNING + textwrap.dedent(then))
    return (sys.executable, str(script))


def test_a_rank_that_said_its_loop_is_over_is_not_timed_any_more(tmp_path: Path) -> None:
    worker = learned_worker(
        tmp_path,
        """
        beat.finish()
        time.sleep(3.0)  # a final save, far past the learned step deadline
        """,
    )
    job, codes, _, recorded = run_agents(tmp_path, worker, rules=QUICK)
    assert codes == {0: ExitCode.SUCCESS}
    assert job.root_cause is None
    assert [event.kind for event in recorded if event.kind == "failure"] == []


def test_a_rank_that_keeps_stepping_slower_than_the_others_is_reported_once(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            from hpc_elastic.train.heartbeat import Heartbeat

            beat = Heartbeat(min_interval=0.0)
            pause = 0.3 if os.environ["RANK"] == "2" else 0.1
            deadline = time.monotonic() + 10.0
            step = 0
            while time.monotonic() < deadline:
                beat.beat(step)
                step += 1
                time.sleep(pause)  # rank 2 steps three times slower: the straggler
            """
        )
    )
    _, codes, _, recorded = run_agents(tmp_path, (sys.executable, str(script)), nproc=3)
    assert codes == {0: ExitCode.SUCCESS}
    stragglers = [event.details for event in recorded if event.kind == "straggler"]
    assert [details["rank"] for details in stragglers] == [2]
    assert stragglers[0]["score"] > 1.5


def test_a_hung_group_dumps_every_ranks_stacks_and_the_root_cause_names_the_frame(
    tmp_path: Path,
) -> None:
    worker = learned_worker(
        tmp_path,
        """
        def all_reduce_step():
            time.sleep(60.0)  # the hang: a collective whose peer never comes

        def wait_for_the_others():
            beat.finish()  # not timed: only rank 0's hang is caught
            time.sleep(60.0)

        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            if os.environ["RANK"] == "0":
                all_reduce_step()
            else:
                wait_for_the_others()
        """,
    )
    job, codes, said, _ = run_agents(tmp_path, worker, rules=QUICK)
    assert codes == {0: ExitCode.SUCCESS}
    root = job.root_cause
    assert root is not None
    assert root.rank == 0
    line = LEARNING.count("\n") + 3  # the sleep in all_reduce_step, after the dedent
    assert f"Rank 0 hung in train.py:{line} in all_reduce_step" in root.message
    assert any("asking every local rank for its stacks" in sentence for sentence in said)
    first = tmp_path / "job" / "logs" / "attempt_1"
    rank0, rank1 = ((first / f"rank_{rank}.log").read_text() for rank in (0, 1))
    assert "Fatal Python error: Aborted" in rank0
    assert "in all_reduce_step" in rank0
    assert "in wait_for_the_others" in rank1


SLOW_PEER = """
import os, sys, time
from pathlib import Path
from hpc_elastic import events
from hpc_elastic.train import lease
from hpc_elastic.train.collectives import collective
from hpc_elastic.train.heartbeat import Heartbeat

beat = Heartbeat(min_interval=0.0)
released = Path(sys.argv[1]) / "released"
for step in range(20):
    beat.beat(step)
    time.sleep(0.05)
if os.environ["RANK"] == "0":
    with collective("all_reduce"):  # waits for rank 1, as in a collective
        while not released.exists():
            time.sleep(0.01)
    beat.beat(20)
else:
    step = 20
    def dismissed():
        return any(e.kind == "hang" for e in events.read(os.environ["HPC_ELASTIC_EVENTS_FILE"]))
    while not dismissed():  # rank 1 goes on stepping, slowly for its peer
        step += 1
        beat.beat(step)
        lease.check()  # a stale lease would fence it: the agent must renew it meanwhile
        time.sleep(0.05)
    released.touch()
for step in range(21, 31):
    beat.beat(step)
    lease.check()
    time.sleep(0.05)
beat.finish()
"""
"""Rank 0 waits in a marked collective for rank 1, which keeps stepping: the job moves."""


def test_a_rank_waiting_for_a_peer_that_still_moves_is_not_killed(tmp_path: Path) -> None:
    """The investigation finds rank 1 still stepping and rank 0 waiting in a collective for
    it: the hang is dismissed, both ranks go on (neither killed, nor fenced by a lease left
    stale meanwhile), and nothing counts as a failure."""
    script = tmp_path / "train.py"
    script.write_text(SLOW_PEER)
    rules = {**DEFAULT_RULES, Phase.STEP: DeadlineRule(initial=20.0, floor=2.0, min_samples=5)}
    # The product's session (a lease of 2 s): with 1 s, the lease lasts a third of a second,
    # less than a loaded machine may leave the agent's poll unscheduled, and a rank fenced
    # itself in a CI run at load 26.
    job, codes, said, recorded = run_agents(
        tmp_path, (sys.executable, str(script), str(tmp_path)), rules=rules, session_timeout=6.0
    )
    assert codes == {0: ExitCode.SUCCESS}, said
    assert job.restarts_used == 0
    assert [e.kind for e in recorded if e.kind in ("failure", "fenced")] == []
    [hang] = [e.details for e in recorded if e.kind == "hang"]
    assert (hang["verdict"], hang["rank"]) == ("dismissed", 1), hang
    assert hang["sentence"].startswith("No hang: rank 1 still made progress"), hang
    assert any(sentence.startswith("No hang: rank 1") for sentence in said)
