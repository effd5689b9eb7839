"""Soak: one elastic job under random churn (preemptions, node losses and returns) to the end,
with one straggling rank and one frozen rank planted on the way, and no hand-set timeout.

CI runs a short soak (about six minutes on the loaded machine: the planted hang alone costs
the learned step deadline's one-minute floor, and each start-up of six ranks about a minute);
``HPC_ELASTIC_SOAK_SECONDS=1800`` runs the long one by hand.
Either prints its figures and its goodput breakdown, which docs/reliability.md records.

The job runs three ranks per node (``1:2`` nodes, so three or six ranks), since the straggler
rule compares the ranks of one node and needs three of them. The straggler is planted through
``examples/train.py --slow-file``: rank 1 sleeps longer before every step's collective until a
``straggler`` event names it. The hang is a ``SIGSTOP`` of one worker, never continued: the
learned step deadline must catch it (no ``--hang-timeout`` is given), and no other hang may be
caught during the whole soak.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cluster import Cluster, wait_until
from faults import Run, committed, hang_failures, hang_rounds, submit

from hpc_elastic import events
from hpc_elastic.ops import goodput

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]
"""On a cluster of its own (``private_cluster``): the longest test runs beside the shared
cluster's tests, not after them."""
SECONDS = int(os.environ.get("HPC_ELASTIC_SOAK_SECONDS", "100"))
LONG = SECONDS > 300
SLEEP_PER_STEP = 0.5
"""Above the heartbeat's half-second throttle, so every rank records every step and the
watchdog can see which rank arrives last at each step's collective."""
STEP_WALL = 1.5
"""Seconds a step takes on the loaded machine, six ranks on two cores, restarts included (a
start-up took 95 s there): the job's steps are sized so that it trains for about ``SECONDS``.
At least ``MIN_STEPS``, so that training outlasts the planted faults of the short soak."""
MIN_STEPS = 200
NPROC = 3
TRAIN_ARGS = ("--batch-size=24", "--micro-batch-size=4", f"--sleep-per-step={SLEEP_PER_STEP}")
"""A global batch that splits evenly over three and six ranks."""
SLOW_RANK = 1
"""On the node of rank 0 (ranks 0-2) whatever the world size, so always among three."""
SLOW_SECONDS = 1.5
"""More than a normal step (the sleep plus the work): rank 1's arrival lag scores above 1.5."""
FROZEN_RANK = 2
STRAGGLER_WITHIN = 300.0
"""Generous: 20 slow observations take about ten slow steps, a restart may come between."""
HANG_WITHIN = 600.0
"""Generous: the learned step deadline is at least a minute, the start-up one five."""
PLANTED_AT = {"straggler": 0.15, "hang": 0.4}
"""When each planted fault comes, as a share of ``SECONDS``; random churn fills the rest."""


@dataclass
class Planted:
    """What the soak planted and what the job made of it, for the checks and the record."""

    slow_file: Path
    straggle: tuple[float, float] | None = None
    """When rank 1 was slow: from the file's writing to its removal (seconds since 1970)."""
    frozen_at: float | None = None
    frozen_rank: int | None = None
    notes: list[str] = field(default_factory=list)


def preempt(run: Run, rng: random.Random, _: Planted) -> str | None:
    """A high-partition job takes three nodes for a while, then leaves: one slot goes and comes."""
    hold = rng.randint(8, 20)
    run.cluster.run(
        [
            "sbatch",
            "--partition=high",
            "--nodes=3",
            "--output=/dev/null",
            f"--wrap=srun sleep {hold}",
        ]
    )
    return f"preemption for {hold} s"


def lose_node(run: Run, rng: random.Random, _: Planted) -> str | None:
    """A node of the job crashes and comes back a few seconds later."""
    node = run.node(rng.randint(0, 1)) or run.node(0)
    if not node:
        return "no node to lose"
    run.cluster.node_kill(node)
    time.sleep(rng.uniform(3, 8))
    run.cluster.node_start(node)
    return f"{node} lost and back"


def training(run: Run, steps: int = 5, within: float = 600.0) -> bool:
    """Wait until the job has trained ``steps`` more steps: a round is up and stepping, not
    starting up (whose deadline is minutes, not the step's)."""
    now = run.last_step()
    return wait_until(lambda: run.last_step() >= now + steps, within, interval=0.5)


def straggle(run: Run, _: random.Random, planted: Planted) -> str | None:
    """Rank 1 sleeps longer per step until a ``straggler`` event names it, then catches up."""
    if not training(run):
        return None
    begin = time.time()
    planted.slow_file.write_text(f"{SLOW_RANK} {SLOW_SECONDS}\n")
    try:
        named = wait_until(
            lambda: any(e.time >= begin for e in stragglers(run.events(), SLOW_RANK)),
            STRAGGLER_WITHIN,
            interval=1.0,
        )
    finally:
        planted.slow_file.unlink()
        planted.straggle = (begin, time.time())
    seconds = planted.straggle[1] - begin
    return f"rank {SLOW_RANK} slow for {seconds:.0f} s" + ("" if named else ", never named")


def freeze(run: Run, _: random.Random, planted: Planted) -> str | None:
    """SIGSTOP the worker of rank 2 and never continue it: only its agent's learned deadline
    can end the round (the agent kills it; SIGKILL reaches a stopped process)."""
    pid = worker_of(run, FROZEN_RANK) if training(run) else None
    if pid is None:
        return None
    planted.frozen_at, planted.frozen_rank = time.time(), FROZEN_RANK
    os.kill(pid, signal.SIGSTOP)
    frozen_at = planted.frozen_at
    caught = wait_until(
        lambda: any(e.time >= frozen_at for e in hang_failures(run.events())),
        HANG_WITHIN,
        interval=1.0,
    )
    seconds = time.time() - frozen_at
    return f"rank {FROZEN_RANK} frozen, " + (f"caught in {seconds:.0f} s" if caught else "never")


def worker_of(run: Run, rank: int) -> int | None:
    """The pid of the running worker of ``rank``: the process of the job whose output goes to
    the newest attempt's ``rank_<rank>.log``. Not from its /proc environ: a prewarmed worker
    gets its environment later, on stdin."""
    found: dict[int, int] = {}
    for task in (0, 1):
        for pid in run.processes(task):
            try:
                log = Path(os.readlink(f"/proc/{pid}/fd/1"))
            except OSError:
                continue
            if log.name == f"rank_{rank}.log" and log.parent.name.startswith("attempt_"):
                found[int(log.parent.name.removeprefix("attempt_"))] = pid
    return found[max(found)] if found else None


def all_held(run: Run) -> bool:
    """Every task of the job held by Slurm (``REQUEUE_HOLD``: requeued more often than the
    site's ``MaxBatchRequeue``, 5 by default): the job can never train again on its own.
    The 30-minute soak of 2026-12-01 stalled so, and waited until released by hand."""
    squeue = ["squeue", "-h", "-j", run.job, "-o", "%T"]
    tasks = run.cluster.run(squeue, check=False).stdout.split()  # a purged job: no tasks
    return bool(tasks) and all(state == "REQUEUE_HOLD" for state in tasks)


def stragglers(timeline: list[events.Event], rank: int | None = None) -> list[events.Event]:
    return [
        event
        for event in timeline
        if event.kind == "straggler" and (rank is None or event.details.get("rank") == rank)
    ]


Disturbance = Callable[[Run, random.Random, Planted], str | None]
"""Churn or a planted fault: what it did, or None if it could not be done now (a planted
fault is then tried again at the next turn)."""
PLANTS: dict[str, Disturbance] = {"straggler": straggle, "hang": freeze}


def next_disturbance(
    elapsed: float, due: dict[str, float], rng: random.Random
) -> tuple[str, Disturbance]:
    """The planted fault whose time has come, else random churn."""
    for name, share in due.items():
        if elapsed >= share * SECONDS:
            return name, PLANTS[name]
    return "churn", rng.choice((preempt, lose_node))


def disturb(
    run: Run, rng: random.Random, planted: Planted, due: dict[str, float], started: float
) -> list[str]:
    """Churn and the planted faults, one after another, for ``SECONDS`` of training or until
    the job is over; what each did. The newest checkpoint must never go back meanwhile."""
    churn = []
    quiet = (20, 60) if LONG else (10, 25)
    newest = ""
    while run.cluster.squeue() and time.monotonic() - started < SECONDS:
        time.sleep(rng.uniform(*quiet))
        if not run.cluster.squeue() or all_held(run):
            break
        name, disturbance = next_disturbance(time.monotonic() - started, due, rng)
        done = disturbance(run, rng, planted)
        churn.append(done or f"{name} not possible now")
        if done is not None:
            due.pop(name, None)
        now = max(committed(run.checkpoint_dir), default="")
        assert now >= newest, f"newest checkpoint went back from {newest} to {now}"
        newest = now
    return churn


@pytest.mark.timeout(SECONDS * 3 + 900)
def test_a_job_under_random_churn_a_straggler_and_a_hang_finishes_correctly(
    private_cluster: Cluster, tmp_path: Path
) -> None:
    cluster = private_cluster
    rng = random.Random(int(os.environ.get("HPC_ELASTIC_SOAK_SEED", "0")))
    steps = max(MIN_STEPS, int(SECONDS / STEP_WALL))
    planted = Planted(tmp_path / "slow")
    run = submit(
        cluster,
        tmp_path,
        tmp_path / "checkpoints",
        train_args=(*TRAIN_ARGS, f"--slow-file={planted.slow_file}"),
        steps=steps,
        nproc=NPROC,
    )
    assert wait_until(lambda: run.last_step() > 0, 600), "training never started"
    started = time.monotonic()  # the soak's time is training time, not the first start-up
    due = dict(PLANTED_AT)
    churn = disturb(run, rng, planted, due, started)
    ended = wait_until(lambda: not cluster.squeue() or all_held(run), SECONDS * 2 + 600)
    wall = time.monotonic() - started

    lines = run.steps()
    timeline = run.events()
    kinds = [str(event.kind) for event in timeline]
    rounds = {event.round for event in timeline if event.kind == "round"}
    figures = goodput.goodput(timeline)
    print(
        f"soak {SECONDS} s, seed {os.environ.get('HPC_ELASTIC_SOAK_SEED', '0')}: wall {wall:.0f} s,"
        f" {steps} steps, {len(lines)} step lines, churn {len(churn)} ({'; '.join(churn)}), "
        f"{len(kinds)} events, {len(rounds)} rounds, {kinds.count('requeue')} requeues, "
        f"{kinds.count('node_lost')} node_lost, {kinds.count('preempt')} preempt"
    )
    print(f"stragglers: {describe_stragglers(timeline, planted)}")
    print(f"hangs: {describe_hangs(timeline, planted)}")
    print(f"{goodput.describe(figures)}; breakdown {figures.as_dict()}")

    held = f"every task of job {run.job} is held by Slurm ({cluster.squeue()})"
    if all_held(run):
        run.cluster.run(["scancel", run.job], check=False)  # leave the cluster empty
        pytest.fail(
            f"{held}, at step {run.last_step()} of {steps}: nothing releases them and no "
            "agent is left to say so.",
            pytrace=False,
        )
    assert ended, cluster.squeue()
    assert not due, f"the job ended before {sorted(due)} could be planted"
    assert {step for step, _, _ in lines} == set(range(1, steps + 1)), "a step is missing"
    assert f"done step={steps} " in run.log.read_text()
    assert max(committed(run.checkpoint_dir)) == f"step-{steps:08d}"
    assert planted.straggle is not None, churn
    slow_from = planted.straggle[0]
    assert any(e.time >= slow_from for e in stragglers(timeline, SLOW_RANK)), (
        f"no straggler event for rank {SLOW_RANK}: {stragglers(timeline)}"
    )
    assert planted.frozen_at is not None, churn
    caught = hang_failures(timeline)
    assert caught, "the frozen rank was never caught"
    first = caught[0]
    assert first.time >= planted.frozen_at, f"a hang caught before one was planted: {first}"
    assert hang_rounds(timeline) == [first.round], f"false hang alarms: {caught}"
    assert first.details.get("rank") == planted.frozen_rank, f"the wrong rank was blamed: {first}"
    # Frozen mid-step or mid-save (the churn saves often): either learned deadline ends it,
    # never --hang-timeout ("... while saving (learned save deadline 120.0 s)", seen in CI).
    assert re.search(r"learned (save )?deadline", str(first.details.get("message"))), first


def describe_stragglers(timeline: list[events.Event], planted: Planted) -> str:
    found = stragglers(timeline)
    if not found:
        return "none"
    begin = planted.straggle[0] if planted.straggle else 0.0
    return ", ".join(
        f"rank {e.details.get('rank')} score {e.details.get('score')} in round {e.round} "
        f"{e.time - begin:+.0f} s after rank {SLOW_RANK} slowed"
        for e in found
    )


def describe_hangs(timeline: list[events.Event], planted: Planted) -> str:
    caught = hang_failures(timeline)
    if not caught:
        return "none caught"
    frozen = planted.frozen_at or 0.0
    return "; ".join(
        f"rank {e.details.get('rank')} in round {e.round}, {e.time - frozen:.0f} s after "
        f"rank {planted.frozen_rank} froze: {str(e.details.get('message')).splitlines()[0]}"
        for e in caught
    )
