"""Who hung, end to end: real agents on the local-mode rendezvous (a real unix-socket store),
real gloo workers, two nodes of two ranks each (n0: ranks 0 and 1, n1: ranks 2 and 3), and two
CPU-bound processes beside them the whole time, as on a busy machine.

The soak once blamed the wrong rank: rank 2 was frozen, and the agent of the other node, whose
deadline passed first, killed its own ranks 0 and 3 and blamed rank 0, though their stacks
said they waited in backward for rank 2. Here a hang must be blamed on the rank that stopped
and its node, in ``status`` and ``events`` alike, once; and a hang nobody can be blamed for
must say so and count against no node.

Short learned deadlines (``deadline_rules``: a 4 s floor) make each run take seconds of
hang, not minutes; most of a test's time is torch's start-up on the busy machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from lifeline import while_parent_lives

from hpc_elastic import events
from hpc_elastic.agent.agent import Agent
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.agent.watchdog import DEFAULT_RULES, DeadlineRule, Phase
from hpc_elastic.events import FailureDetails, HangDetails
from hpc_elastic.jobdir import JobRecord
from hpc_elastic.rendezvous import local_store
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.local_store import LocalStoreServer
from hpc_elastic.spec import NodeRange

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = Path(__file__).parents[1] / "workloads" / "train_hang.py"
RULES = {
    **DEFAULT_RULES,
    Phase.STEP: DeadlineRule(initial=30.0, floor=4.0, min_samples=5),
}
"""Step deadlines of at least 4 s, learned from the heartbeats (30 s until five are seen);
start-up keeps its minutes."""
NODES = 2
NPROC = 2
STEPS = 60
HANG_STEP = 25
"""Late enough for the step deadline to be learned (the heartbeat beats every half second)."""


@pytest.fixture
def busy() -> Iterator[None]:
    """Two CPU-bound processes, not niced, on the machine for the whole test."""
    # Each hog checks now and then that the test's process is still its parent, so that a run
    # killed outright (SIGKILL, no teardown) leaves no hog spinning behind it.
    spin = while_parent_lives("for _ in range(1_000_000): pass")
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@dataclass
class Run:
    """One local job of ``NODES`` in-process agents on a local-mode store."""

    job_dir: Path
    out: Path
    codes: dict[int, ExitCode]
    said: list[str]

    def events(self) -> list[events.Event]:
        return list(events.read(self.job_dir / "events.jsonl"))

    def trace(self) -> list[tuple[int, int, int, int]]:
        """(step, rank, pid, round) for every step a rank began."""
        path = self.out / "trace"
        lines = path.read_text().splitlines() if path.exists() else []
        return [tuple(int(word) for word in line.split()) for line in lines]  # type: ignore[misc]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hpc_elastic", *args],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


def run_job(tmp_path: Path, hang: str = "", during: Callable[[Run], None] | None = None) -> Run:
    """Run the job to its end; ``during(run)`` runs meanwhile (to freeze a rank)."""
    socket_dir = Path(tempfile.mkdtemp(prefix="hang-"))  # a unix socket's path must be short
    server = LocalStoreServer(socket_dir / "rendezvous.sock")
    server.start()
    address = f"{local_store.SCHEME}{server.path}"
    job_dir, out = tmp_path / "job", tmp_path / "out"
    job_dir.mkdir(mode=0o700)
    out.mkdir()
    JobRecord(
        run_id="hang-job",
        job_dir=job_dir,
        job_id=None,
        local=True,
        zk=address,
        nodes=str(NODES),
        nproc_per_node=NPROC,
        max_restarts=3,
        runner_pid=os.getpid(),
    ).write()
    command = [sys.executable, "-u", str(WORKLOAD), f"--out={out}", f"--steps={STEPS}"]
    spec = AgentSpec(
        job_dir=job_dir,
        command=(*command, *([f"--hang={hang}"] if hang else [])),
        nproc_per_node=NPROC,
    )
    settings = RendezvousSettings(
        "hang-job", NodeRange.parse(str(NODES)), last_call=0.5, session_timeout=10.0
    )
    run = Run(job_dir, out, {}, [])
    threads = []
    # Ranks follow join order, so each agent starts once the one before it has joined: n0
    # holds ranks 0 and 1 however the machine schedules the agents' threads.
    watcher = local_store.LocalStore(server.path, "hang-job")
    try:
        for index in range(NODES):
            node = NodeInfo(f"node{index}-id", "127.0.0.1", NPROC, f"n{index}")
            rdzv = local_store.connect(address, settings, node)
            agent = Agent(spec, rdzv, say=run.said.append, deadline_rules=RULES)

            def go(index: int = index, agent: Agent = agent) -> None:
                run.codes[index] = agent.run()

            thread = threading.Thread(target=go, daemon=True)
            thread.start()
            threads.append(thread)

            def joined(member: str = node.node_id) -> bool:
                return member in watcher.alive()

            wait_for(run, joined, 120.0, f"{node.node_id} join")
        if during is not None:
            during(run)
        for thread in threads:
            thread.join(600.0)
            assert not thread.is_alive(), f"an agent did not finish: {run.said[-20:]}"
    finally:
        watcher.release()
        server.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
    return run


def wait_for(run: Run, condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        over = time.monotonic() >= deadline or len(run.codes) == NODES  # or the job ended
        assert not over, (
            f"never saw {what} within {timeout:g} s; the agents said {run.said[-10:]}, "
            f"the trace ends {run.trace()[-4:]}"
        )
        time.sleep(0.1)


def hang_failures(run: Run) -> list[events.Event]:
    return [e for e in run.events() if e.kind == events.Kind.FAILURE and e.details.get("hung")]


def hang_evidence(run: Run) -> list[events.Event]:
    return [e for e in run.events() if e.kind == events.Kind.HANG]


def status(run: Run) -> dict[str, object]:
    shown = run.cli("status", "--json", str(run.job_dir))
    assert shown.returncode == 0, shown.stderr
    view: dict[str, object] = json.loads(shown.stdout)
    return view


def timeline(run: Run) -> str:
    shown = run.cli("events", str(run.job_dir))
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def freeze_rank_2(run: Run) -> None:
    """SIGSTOP rank 2's worker once every rank is training, and never continue it."""
    wait_for(
        run,
        lambda: {rank for step, rank, _, _ in run.trace() if step >= HANG_STEP} == set(range(4)),
        300.0,
        f"every rank at step {HANG_STEP}",
    )
    pid = next(pid for step, rank, pid, _ in run.trace() if rank == 2)
    os.kill(pid, signal.SIGSTOP)


@pytest.mark.timeout(900)
def test_a_frozen_rank_is_blamed_with_its_node_not_the_ranks_that_wait_for_it(
    tmp_path: Path, busy: None
) -> None:
    """Rank 2 (node n1) is frozen; ranks 0 and 1 on n0 and rank 3 beside it on n1 wait for
    it in a collective. Whichever agent's deadline passes first, rank 2 and n1 are blamed,
    once, in status and events alike; the job restarts and finishes."""
    run = run_job(tmp_path, during=freeze_rank_2)
    assert run.codes == dict.fromkeys(range(NODES), ExitCode.SUCCESS), run.said[-20:]
    story = timeline(run)
    [failure] = hang_failures(run)
    details = FailureDetails.from_details(failure.details)
    assert (failure.slot, details.rank, details.node_fault) == ("n1", 2, True), story
    assert details.sentence.startswith(
        "Rank 2 on node 'n1' was stopped (state T) while ranks 0, 1 and 3"
    )
    assert "learned deadline" in details.sentence
    assert "Fatal Python error" in details.message, "the dump stays in the detail"
    assert [e.slot for e in run.events() if events.charges_node(e)] == ["n1"]

    evidence = {e.slot: HangDetails.from_details(e.details) for e in hang_evidence(run)}
    assert set(evidence) == {"n0", "n1"}, story
    for seen in evidence.values():
        assert (seen.verdict, seen.rank, seen.culprit_slot) == ("culprit", 2, "n1")
    assert evidence["n1"].evidence["2"].startswith("state T"), evidence["n1"]
    assert "waits in" in evidence["n0"].evidence["0"], evidence["n0"]

    view = status(run)
    assert view["state"] == "succeeded"
    assert str(view["last_failure"]).startswith(details.sentence), view["last_failure"]
    [line] = [line for line in story.splitlines() if " hang: " in line]
    assert f"hang: {details.sentence}" in line
    assert "Extension modules" not in line
    assert len([line for line in story.splitlines() if "hang evidence" in line]) == 2, story


@pytest.mark.timeout(900)
def test_a_rank_that_hangs_in_its_own_loop_is_blamed(tmp_path: Path, busy: None) -> None:
    """Rank 1 (node n0) spins for ever at step 25, in no collective; the others wait for it
    in DDP's gradient all-reduce, in backward."""
    run = run_job(tmp_path, hang=f"spin:1:{HANG_STEP}")
    assert run.codes == dict.fromkeys(range(NODES), ExitCode.SUCCESS), run.said[-20:]
    story = timeline(run)
    [failure] = hang_failures(run)
    details = FailureDetails.from_details(failure.details)
    assert (failure.slot, details.rank, details.node_fault) == ("n0", 1, True), story
    assert details.sentence.startswith("Rank 1 on node 'n0' was outside every collective while"), (
        story
    )
    assert "it hung in train_hang.py:" in details.sentence
    assert [e.slot for e in run.events() if events.charges_node(e)] == ["n0"]
    assert str(status(run)["last_failure"]).startswith(details.sentence)


@pytest.mark.timeout(900)
def test_ranks_that_each_wait_in_a_collective_their_peers_never_join_blame_no_node(
    tmp_path: Path, busy: None
) -> None:
    """At step 25 rank 1 joins an all_reduce of a pair group that its partner, rank 2, never
    joins, and every other rank waits for rank 1 in the world's all_reduce: every rank waits
    in a collective, nobody can be blamed, and no node is counted bad."""
    run = run_job(tmp_path, hang=f"skip:1:{HANG_STEP}")
    assert run.codes == dict.fromkeys(range(NODES), ExitCode.SUCCESS), run.said[-20:]
    story = timeline(run)
    [failure] = hang_failures(run)
    details = FailureDetails.from_details(failure.details)
    assert (details.rank, details.node_fault) == (None, False), story
    assert details.sentence.startswith(
        "Every rank waited in a collective its peers never joined (ranks 0, 2 and 3 waited in "
        "all_reduce #"
    ), story
    assert "and rank 1 in pair_all_reduce #" in details.sentence
    assert "no rank can be blamed" in details.sentence
    assert [e for e in run.events() if events.charges_node(e)] == []
    evidence = [HangDetails.from_details(e.details) for e in hang_evidence(run)]
    assert {seen.verdict for seen in evidence} == {"ambiguous"}
    assert str(status(run)["last_failure"]).startswith(details.sentence)
