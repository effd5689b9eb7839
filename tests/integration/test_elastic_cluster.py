"""Elastic jobs on the real local Slurm + ZooKeeper: grow, shrink by preemption, finish, cancel.

Every job goes through the real CLI (``python -m hpc_elastic submit``) with examples/train.py;
the waits read the job's events.jsonl, the single timeline the agents write.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import Cluster, wait_until
from submit_output import submitted

from hpc_elastic import events

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"


def hpc_elastic(cluster: Cluster, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", *args],
        cwd=cwd,
        env={**cluster.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def submit_training(
    cluster: Cluster,
    cwd: Path,
    nodes: str,
    steps: int,
    *extra: str,
    train_args: tuple[str, ...] = (),
) -> tuple[str, Path]:
    """Submit examples/train.py (``extra``: submit options, ``train_args``: the script's own);
    returns the Slurm job id and the job directory."""
    result = hpc_elastic(
        cluster,
        cwd,
        "submit",
        f"--nodes={nodes}",
        "--nproc-per-node=2",
        "--partition=low",
        f"--zk={cluster.zk_hosts}",
        "--last-call=2",
        "--signal=USR2@15",
        *extra,
        str(TRAIN),
        "--",
        f"--steps={steps}",
        "--checkpoint-every=5",
        "--sleep-per-step=0.2",
        f"--log-file={cwd / 'steps.log'}",
        *train_args,
    )
    assert result.returncode == 0, result.stderr
    return submitted(result.stdout)


def hold(cluster: Cluster, partition: str, nodes: int, seconds: int) -> str:
    """A plain job that keeps ``nodes`` nodes busy for ``seconds``."""
    result = cluster.run(
        [
            "sbatch",
            "--parsable",
            f"--partition={partition}",
            f"--nodes={nodes}",
            "--output=/dev/null",
            f"--wrap=srun sleep {seconds}",
        ]
    )
    job = result.stdout.strip()
    assert wait_until(lambda: (job, "RUNNING") in cluster.squeue(), 30), cluster.squeue()
    return job


def rounds(job_dir: Path) -> list[int]:
    """World sizes of the job's rounds, in order (one entry per round, not per agent)."""
    seen: dict[int, int] = {}
    for event in events.read(job_dir / "events.jsonl"):
        if event.kind == "round" and event.round is not None:
            seen.setdefault(event.round, int(event.details["world_size"]))
    return [seen[number] for number in sorted(seen)]


def story(cluster: Cluster, job_dir: Path, log: Path) -> str:
    """What a failed wait needs to be understood from CI's output alone: the rounds, the last
    step logged, the queue with Slurm's reasons, the nodes' states, and the events that
    explain a slot's absence."""
    telling = {"health", "requeue", "held", "released", "leave", "exclude", "failed", "done"}
    told = [
        f"{event.kind}@{event.slot}:{json.dumps(event.details, sort_keys=True)[:160]}"
        for event in events.read(job_dir / "events.jsonl")
        if event.kind in telling
    ]
    text = log.read_text() if log.exists() else ""
    last = [line for line in text.splitlines() if line.startswith("step=")][-1:]
    queue = cluster.run(["squeue", "-h", "-o", "%i %T %r %N"], check=False).stdout.strip()
    nodes = cluster.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], check=False).stdout.strip()
    return f"rounds {rounds(job_dir)}; last {last}; queue [{queue}]; nodes [{nodes}]; events {told}"


def training_at(job_dir: Path, log: Path, world_size: int, timeout: float) -> bool:
    """Wait until the newest round has this size and rank 0 has logged a step in it."""

    def reached() -> bool:
        sizes = rounds(job_dir)
        text = log.read_text() if log.exists() else ""
        lines = [line for line in text.splitlines() if line.startswith("step=")]
        stepping = bool(lines) and lines[-1].endswith(f" world={world_size}")
        return bool(sizes) and sizes[-1] == world_size and stepping

    return wait_until(reached, timeout, interval=0.5)


def kinds(job_dir: Path) -> list[str]:
    return [event.kind for event in events.read(job_dir / "events.jsonl")]


def step_lines(log: Path) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^step=(\d+) ", log.read_text(), re.M)]


def checkpoint_steps(job_dir: Path) -> set[int]:
    return {
        int(event.details["step"])
        for event in events.read(job_dir / "events.jsonl")
        if event.kind == "checkpoint"
    }


def resumes(job_dir: Path, log: Path) -> str:
    """What an out-of-order step needs to be understood from CI's output alone: every round,
    save and load with its round and slot, and the step lines with their world sizes."""
    shown = {"round": "world_size", "checkpoint": "step", "checkpoint_loaded": "step"}
    told = [
        f"{event.kind}@r{event.round}/s{event.slot}={event.details.get(shown.get(kind, 'cause'))}"
        for event in events.read(job_dir / "events.jsonl")
        if (kind := event.kind) in {*shown, "preempt", "leave", "requeue"}
    ]
    lines = [" ".join(line.split()[::2]) for line in log.read_text().splitlines()]
    return f"events {told[:60]}; steps {lines[:30]}"


def test_grows_shrinks_on_preemption_grows_back_and_finishes(
    cluster: Cluster, tmp_path: Path
) -> None:
    steps = 100
    log = tmp_path / "steps.log"
    # Every step is slow until the last phase (rank 0 sleeps 2 s more, the others wait for it at
    # the collective): the job must still be training when the preempted slots come back,
    # however long the machine's load makes each phase. At full speed, CI once ran the last
    # of 200 steps at world 6 and finished before the second slot was back. Slowed, the first
    # four phases took 5 steps (139 s at load 16, most of it workers starting). A slow step is
    # also longer than the 2 s stop grace: the grows must wait for it to save (arrival_grace;
    # with 2.2 s steps CI once saw a grow SIGKILL the ranks before their save).
    slow = tmp_path / "slow"
    slow.write_text("0 3")
    holder = hold(cluster, "high", 3, 600)
    job, job_dir = submit_training(
        cluster, tmp_path, "1:4", steps, train_args=(f"--slow-file={slow}",)
    )
    # 1. The job starts on the one free node, without waiting a last call for the others.
    assert training_at(job_dir, log, 2, 120), story(cluster, job_dir, log)
    # 2. The other job ends: the three pending slots start and join the next round.
    cluster.run(["scancel", holder])
    assert training_at(job_dir, log, 8, 150), story(cluster, job_dir, log)
    # 3. A high-priority job needs two nodes: two slots are preempted, save and are requeued.
    high = hold(cluster, "high", 2, 600)
    assert training_at(job_dir, log, 4, 120), story(cluster, job_dir, log)
    # 4. The high job ends (once the job trains at 4, not after a fixed time); the requeued
    # slots come back.
    cluster.run(["scancel", high])
    assert training_at(job_dir, log, 8, 150), story(cluster, job_dir, log)
    # 5. Training speeds up and finishes; nothing stays queued.
    slow.unlink()
    assert wait_until(lambda: not cluster.squeue(), 240), cluster.squeue()

    for task in range(4):
        record = cluster.run(["scontrol", "-o", "show", "job", f"{job}_{task}"]).stdout
        assert "JobState=COMPLETED" in record, record
        assert "ExitCode=0:0" in record, record
    history = kinds(job_dir)
    assert history.count("done") == 4, history
    requeues = [event for event in events.read(job_dir / "events.jsonl") if event.kind == "requeue"]
    # Exactly the two preempted slots are requeued: the cause is read when the signal arrives
    # (DepartureWatch), and a slot whose workers stopped only because a peer was preempted
    # rejoins instead of leaving (it was once requeued as 'by_hand').
    causes = [event.details["cause"] for event in requeues]
    assert causes == ["preemption", "preemption"], [event.details for event in requeues]
    sizes = rounds(job_dir)
    assert sizes[0] == 2, sizes
    assert 4 in sizes, sizes
    assert sizes[-1] == 8, sizes
    assert max(checkpoint_steps(job_dir)) == steps
    ran = step_lines(log)
    saved = checkpoint_steps(job_dir)
    for before, after in itertools.pairwise(ran):
        if after != before + 1:
            assert after - 1 in saved, (
                f"resumed at {after} after {before}, saved {sorted(saved)}; {resumes(job_dir, log)}"
            )
    assert set(ran) == set(range(1, steps + 1))


def test_cancel_in_the_middle_ends_every_slot(cluster: Cluster, tmp_path: Path) -> None:
    job, job_dir = submit_training(cluster, tmp_path, "2:4", 10_000)
    assert wait_until(lambda: rounds(job_dir)[-1:] == [8], 90), story(
        cluster, job_dir, tmp_path / "steps.log"
    )
    result = hpc_elastic(cluster, tmp_path, "cancel", job, "--log-dir", str(job_dir.parent))
    assert result.returncode == 0, result.stderr
    assert f"cancelled Slurm job {job}" in result.stdout
    assert cluster.wait_queue_empty(60), cluster.squeue()
    assert "cancel" in kinds(job_dir)


def test_a_job_whose_min_never_comes_fails_and_leaves_nothing_queued(
    cluster: Cluster, tmp_path: Path
) -> None:
    holder = hold(cluster, "high", 3, 600)
    try:
        job, job_dir = submit_training(cluster, tmp_path, "2:4", 100, "--min-wait=10")
        assert wait_until(lambda: job not in {j.split("_")[0] for j, _ in cluster.squeue()}, 90)
        failed = [e for e in events.read(job_dir / "events.jsonl") if e.kind == "failed"]
        assert failed
        assert "only 1 of the 2 nodes needed joined" in failed[0].details["reason"]
        assert "cancel_pending" in kinds(job_dir)
    finally:
        cluster.run(["scancel", holder])


def slot_node(cluster: Cluster, job: str, task: int) -> str:
    return cluster.run(["squeue", "-h", "-j", f"{job}_{task}", "-o", "%N"]).stdout.strip()


def task_processes(job: str, task: int) -> dict[int, list[bytes]]:
    """pid -> argv of every process of one array task (agent, workers), found by environment."""
    wanted = {f"SLURM_ARRAY_JOB_ID={job}".encode(), f"SLURM_ARRAY_TASK_ID={task}".encode()}
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
            if wanted <= environ:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
    return found


def agent_pid(job: str, task: int) -> int:
    """The agent itself, not the ``srun`` that carries the same arguments."""
    for pid, argv in task_processes(job, task).items():
        if argv[1:3] == [b"-m", b"hpc_elastic"] and b"agent" in argv:
            return pid
    raise AssertionError(f"no agent process for task {job}_{task}")


def test_a_node_marked_down_shrinks_the_job_and_its_slot_comes_back(
    cluster: Cluster, tmp_path: Path
) -> None:
    spools = cluster.state_dir / "slurm" / "spool"
    # Sockets of slurmstepds that an earlier test SIGKILLed stay behind; only this job's count.
    stale = set(spools.glob("*/*_*"))
    job, job_dir = submit_training(cluster, tmp_path, "2:4", 10_000)
    assert wait_until(lambda: rounds(job_dir)[-1:] == [8], 120), story(
        cluster, job_dir, tmp_path / "steps.log"
    )
    node = slot_node(cluster, job, 3)
    task = f"{job}_3"
    steps = set((spools / node).glob(f"{node}_*")) - stale
    try:
        # Down requeues the task at once; drain keeps the node out until the old task's
        # processes and its slurmstepd (its socket in the node's spool dir) are gone, or
        # Slurm starts the task there again too early and drains the node ("Duplicate jobid").
        cluster.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=test"])
        cluster.run(["scontrol", "update", f"nodename={node}", "state=drain", "reason=test"])
        assert wait_until(lambda: rounds(job_dir)[-1:] == [6], 60), story(
            cluster, job_dir, tmp_path / "steps.log"
        )
        assert wait_until(lambda: not task_processes(job, 3), 60), task_processes(job, 3)
        assert wait_until(lambda: not any(path.exists() for path in steps), 60), (
            "a slurmstepd stayed"
        )
    finally:
        cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
    cluster.run(["scontrol", "release", task], check=False)
    # Slurm's requeue delay (credential lifetime + 1 s = 6 s here) is waited out, never skipped
    # with StartTime=now: the task comes back to the very node it left, and a start within the
    # delay crashed slurmctld 22.05.8 (SIGSEGV in build_job_info_resp as the new srun asked for
    # its allocation, ci11 2026-12-02); a returning node may also refuse the task outright
    # ("Job 9 already killed, do not launch batch job", docs/unattended.md).
    assert wait_until(lambda: rounds(job_dir)[-1:] == [8], 120), story(
        cluster, job_dir, tmp_path / "steps.log"
    )
    cancelled = hpc_elastic(cluster, tmp_path, "cancel", job, "--log-dir", str(job_dir.parent))
    assert cancelled.returncode == 0, cancelled.stderr
    assert cluster.wait_queue_empty(60), cluster.squeue()


def test_a_job_that_ends_after_a_node_crash_cancels_the_task_slurm_still_shows_running_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A node crashes and its slurmd comes back without a reboot: Slurm keeps showing the
    task RUNNING there until it notices the task missing, and when the job ends first, the
    end of the job must cancel that task too, not leave it to Slurm.

    Slurm notices a missing task only when the node registers (at its restart, or every
    20 pings: about 200 s here) and the task is older than ``BatchStartTimeout`` + 5 s; the
    test raises ``BatchStartTimeout`` for its own duration so that Slurm never does, and only
    the job's own cancel can empty the queue."""
    log = tmp_path / "steps.log"
    with cluster.slurm_conf_lines("BatchStartTimeout=3600"):
        # Steps enough that the job still trains at world 4 when the node goes, and after.
        job, job_dir = submit_training(cluster, tmp_path, "1:2", 150, "--session-timeout=4")
        assert training_at(job_dir, log, 4, 120), story(cluster, job_dir, log)
        node = slot_node(cluster, job, 1)
        cluster.node_kill(node)
        cluster.node_start(node)
        assert wait_until(lambda: "done" in kinds(job_dir), 300), story(cluster, job_dir, log)
        assert cluster.wait_queue_empty(60), story(cluster, job_dir, log)
    history = list(events.read(job_dir / "events.jsonl"))
    lost = [event.details["nodes"] for event in history if event.kind == "node_lost"]
    assert ["1"] in lost, [event.kind for event in history]
    cancels = [event.details for event in history if event.kind == "cancel_pending"]
    assert [details for details in cancels if 1 in details["running"]], cancels
    crashed = cluster.run(["scontrol", "-o", "show", "job", f"{job}_1"]).stdout
    assert "JobState=CANCELLED" in crashed, crashed
    finished = cluster.run(["scontrol", "-o", "show", "job", f"{job}_0"]).stdout
    assert "JobState=COMPLETED" in finished, finished
    assert "ExitCode=0:0" in finished, finished


def test_a_slot_whose_agent_is_killed_leaves_and_the_rest_train_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, job_dir = submit_training(cluster, tmp_path, "2:4", 10_000)
    assert wait_until(lambda: rounds(job_dir)[-1:] == [8], 120), story(
        cluster, job_dir, tmp_path / "steps.log"
    )
    os.kill(agent_pid(job, 3), signal.SIGKILL)
    assert wait_until(lambda: rounds(job_dir)[-1:] == [6], 60), story(
        cluster, job_dir, tmp_path / "steps.log"
    )
    assert (
        hpc_elastic(cluster, tmp_path, "cancel", job, "--log-dir", str(job_dir.parent)).returncode
        == 0
    )
    assert cluster.wait_queue_empty(60), cluster.squeue()


def round_events(job_dir: Path) -> dict[int, events.Event]:
    """The first ``round`` event of each round, by round number."""
    seen: dict[int, events.Event] = {}
    for event in events.read(job_dir / "events.jsonl"):
        if event.kind == "round" and event.round is not None:
            seen.setdefault(event.round, event)
    return seen


def departures(job_dir: Path) -> list[events.Event]:
    """The job's ``departed`` events so far: a node's links seen closed."""
    return [e for e in events.read(job_dir / "events.jsonl") if e.kind == "departed"]


def test_a_crashed_node_whose_links_closed_is_not_waited_for_while_slurm_still_counts_its_slot(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A node crashes with its kernel up (``node-kill``: its slurmd, steps, agent and
    workers SIGKILLed), so its agent's links end with FIN and it is reported departed, while
    Slurm still shows its task running: it notices a silent node only at ``SlurmdTimeout``,
    raised here above the test's length. The survivors' next round must form at once, not
    after a last call for the slot Slurm counts: the last call (600 s) is longer than every
    wait here, the rendezvous' log says the round was completed at once, and the session
    (60 s) keeps the killed agent listed while the survivors stop and come back."""
    log = tmp_path / "steps.log"
    with cluster.slurm_conf_lines("SlurmdTimeout=3600"):
        job, job_dir = submit_training(
            cluster,
            tmp_path,
            "2:3",
            10_000,
            "--last-call=600",
            "--session-timeout=60",
            "--env",
            "HPC_ELASTIC_LOG=debug",
        )
        node = ""
        try:
            assert training_at(job_dir, log, 6, 300), story(cluster, job_dir, log)
            full = max(
                number
                for number, event in round_events(job_dir).items()
                if event.details["world_size"] == 6
            )
            node = slot_node(cluster, job, 2)
            cluster.node_kill(node)
            assert wait_until(lambda: max(round_events(job_dir)) > full, 120), story(
                cluster, job_dir, log
            )
            still_running = (f"{job}_2", "RUNNING") in cluster.squeue()
            # Read before the cancel: it stops the survivors one by one, and each one's
            # links close too, reported departed in the survivors' round. The crash's own
            # report may be written just after the round it let form.
            assert wait_until(lambda: bool(departures(job_dir)), 60), story(cluster, job_dir, log)
            departed = departures(job_dir)
        finally:
            cancelled = hpc_elastic(
                cluster, tmp_path, "cancel", job, "--log-dir", str(job_dir.parent)
            )
            if node:
                cluster.node_start(node)
        assert cancelled.returncode == 0, cancelled.stderr
        assert cluster.wait_queue_empty(120), cluster.squeue()
    assert still_running, "Slurm noticed the crash: the test says nothing of its count"
    survivors = round_events(job_dir)[full + 1]
    assert survivors.details["world_size"] == 4, story(cluster, job_dir, log)
    assert "2" not in survivors.details["members"], survivors.details
    assert {(e.round, e.details["node"], e.details["cause"]) for e in departed} == {
        (full, "2", "connection closed")
    }, departed
    said = "".join(path.read_text() for path in sorted(job_dir.glob("slurm-*.out")))
    assert f"completed round {full + 1} at once" in said, story(cluster, job_dir, log)
    assert f"completed round {full + 1} after the last call" not in said
    assert "without the departed" in said


def test_a_slot_at_its_time_limit_is_requeued_as_such_and_rejoins(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, job_dir = submit_training(cluster, tmp_path, "1:2", 10_000, "--time=1")

    def requeued() -> list[str]:
        return [
            str(event.details["cause"])
            for event in events.read(job_dir / "events.jsonl")
            if event.kind == "requeue"
        ]

    log = tmp_path / "steps.log"
    assert wait_until(lambda: bool(requeued()), 90), story(cluster, job_dir, log)
    assert set(requeued()) == {"time_limit"}

    def rejoined() -> bool:
        # Slurm's requeue delay (6 s here) is waited out: the tasks may come back to the nodes
        # they left, where a start within it is unsafe (see the node-down test above).
        return kinds(job_dir).count("join") > 2

    assert wait_until(rejoined, 120, interval=2.0), story(cluster, job_dir, log)
    cancelled = hpc_elastic(cluster, tmp_path, "cancel", job, "--log-dir", str(job_dir.parent))
    assert cancelled.returncode == 0, cancelled.stderr
    assert cluster.wait_queue_empty(60), cluster.squeue()


def test_a_fixed_job_that_loses_a_node_trains_on_with_the_rest(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, job_dir = submit_training(cluster, tmp_path, "3", 10_000, "--session-timeout=2")
    assert training_at(job_dir, tmp_path / "steps.log", 6, 120), rounds(job_dir)
    nodelist = cluster.run(["squeue", "-h", "-j", job, "-o", "%N"]).stdout.strip()
    lost = cluster.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()[-1]
    cluster.node_kill(lost)
    assert training_at(job_dir, tmp_path / "steps.log", 4, 60), rounds(job_dir)
    assert (job, "RUNNING") in cluster.squeue()
    cancelled = hpc_elastic(cluster, tmp_path, "cancel", job, "--log-dir", str(job_dir.parent))
    assert cancelled.returncode == 0, cancelled.stderr
    assert cluster.wait_queue_empty(60), cluster.squeue()


FAILS_ON_FIRST_NODE = """
import os, sys, time
from pathlib import Path
node = os.environ["SLURMD_NODENAME"]
marker = Path(sys.argv[1])
try:
    with open(marker, "x") as first:
        first.write(node)
except FileExistsError:
    pass
if marker.read_text() == node:
    sys.exit("this node's GPU is broken")
if int(os.environ["WORLD_SIZE"]) < 2:
    time.sleep(600)  # finish only together with the slot that moved away
time.sleep(5)  # train a while: the job ends with both slots in
"""


def test_a_node_that_fails_a_slot_is_excluded_and_the_slot_finishes_elsewhere(
    cluster: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "flaky.py"
    script.write_text(FAILS_ON_FIRST_NODE)
    marker = tmp_path / "bad-node"
    result = hpc_elastic(
        cluster, tmp_path, "submit", "--nodes=1:2", "--partition=low",
        f"--zk={cluster.zk_hosts}", "--exclude-after=1", "--no-prewarm",
        str(script), "--", str(marker),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    job, job_dir = submitted(result.stdout)
    history = job_dir / "events.jsonl"

    def said(kind: str) -> list[events.Event]:
        return [event for event in events.read(history) if event.kind == kind]

    assert wait_until(lambda: bool(said("requeue")), 120), [e.kind for e in events.read(history)]
    bad, moved = marker.read_text(), f"{job}_{said('requeue')[0].slot}"
    # Safe to skip the requeue delay here: the task is excluded from the node it left.
    cluster.run(["scontrol", "update", f"JobId={moved}", "StartTime=now"], check=False)
    assert wait_until(lambda: not cluster.squeue(), 120), cluster.squeue()

    assert [event.details["node"] for event in said("exclude")] == [bad]
    assert [event.details["cause"] for event in said("requeue")] == ["bad_node"]
    assert said("requeue")[0].details["excluded"] == [bad]
    assert len(said("done")) == 2, [e.kind for e in events.read(history)]
    record = cluster.run(["scontrol", "-o", "show", "job", moved]).stdout
    assert f"ExcNodeList={bad}" in record, record
    assert "JobState=COMPLETED" in record, record
    assert f" NodeList={bad} " not in record, record


def latest_members(job_dir: Path) -> list[str]:
    """Slots of the newest round, as its first ``round`` event lists them."""
    latest: dict[int, list[str]] = {}
    for event in events.read(job_dir / "events.jsonl"):
        if event.kind == "round" and event.round is not None:
            latest.setdefault(event.round, [str(m) for m in event.details["members"]])
    return latest[max(latest)] if latest else []


def spare_slots(job_dir: Path) -> set[str]:
    return {e.slot for e in events.read(job_dir / "events.jsonl") if e.kind == "spare"}


def all_nodes_idle(cluster: Cluster) -> bool:
    """Every node can take a task: a node an earlier test crashed may still be coming back,
    and a spare whose task waits for it in the queue is no hot spare."""
    idle = cluster.run(["sinfo", "-h", "-N", "-p", "low", "-t", "idle", "-o", "%N"]).stdout
    return set(idle.split()) >= set(cluster.nodes)


def test_a_hot_spare_replaces_a_lost_node_and_training_goes_on_at_full_size(
    cluster: Cluster, tmp_path: Path
) -> None:
    """--nodes 2:2 --spares 1: three array tasks run; the third agent waits, prewarmed, and
    joins the very next round when a node of the group dies, with no wait in Slurm's queue."""
    log = tmp_path / "steps.log"
    assert wait_until(lambda: all_nodes_idle(cluster), 120), cluster.run(["sinfo"]).stdout
    job, job_dir = submit_training(
        cluster, tmp_path, "2:2", 10_000, "--spares=1", "--session-timeout=2"
    )
    assert training_at(job_dir, log, 4, 120), rounds(job_dir)
    assert wait_until(lambda: bool(spare_slots(job_dir)), 60), kinds(job_dir)
    (spare,) = spare_slots(job_dir)
    members = latest_members(job_dir)
    assert spare not in members
    assert len(members) == 2
    view = json.loads(hpc_elastic(cluster, tmp_path, "status", job, "--json").stdout)
    assert {slot["slot"]: slot["agent"] for slot in view["slots"]}[spare] == "hot spare"
    before = step_lines(log)[-1]
    lost = slot_node(cluster, job, int(members[-1]))
    cluster.node_kill(lost)
    assert wait_until(lambda: spare in latest_members(job_dir), 60), latest_members(job_dir)
    assert training_at(job_dir, log, 4, 60), rounds(job_dir)
    assert set(rounds(job_dir)) == {4}, "every round had 2 nodes: the spare took the place"
    assert wait_until(lambda: step_lines(log)[-1] > before, 60), "the step count goes on"
    cancelled = hpc_elastic(cluster, tmp_path, "cancel", job, "--log-dir", str(job_dir.parent))
    assert cancelled.returncode == 0, cancelled.stderr
    assert cluster.wait_queue_empty(60), cluster.squeue()


def test_a_job_with_a_hot_spare_finishes_and_its_spare_ends_with_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    assert wait_until(lambda: all_nodes_idle(cluster), 120), cluster.run(["sinfo"]).stdout
    job, job_dir = submit_training(cluster, tmp_path, "2:2", 30, "--spares=1")
    assert wait_until(lambda: job not in {j.split("_")[0] for j, _ in cluster.squeue()}, 180), (
        cluster.squeue()
    )
    assert wait_until(lambda: bool(spare_slots(job_dir)), 10), kinds(job_dir)
    (spare,) = spare_slots(job_dir)
    assert set(rounds(job_dir)) == {4}, "the spare never trained"
    assert "done" in kinds(job_dir)
    left = [
        e for e in events.read(job_dir / "events.jsonl") if e.slot == spare and e.kind == "error"
    ]
    assert not left, left


FAILS_ON_CUE = """
import sys, time
from pathlib import Path
cue = Path(sys.argv[1])
while not cue.exists():
    time.sleep(0.2)
sys.exit("the data set is gone")
"""


def test_a_job_with_a_hot_spare_that_fails_ends_its_spare_too(
    cluster: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "fails.py"
    script.write_text(FAILS_ON_CUE)
    cue = tmp_path / "fail-now"
    assert wait_until(lambda: all_nodes_idle(cluster), 120), cluster.run(["sinfo"]).stdout
    result = hpc_elastic(
        cluster,
        tmp_path,
        "submit",
        "--nodes=2:2",
        "--spares=1",
        "--nproc-per-node=1",
        "--partition=low",
        f"--zk={cluster.zk_hosts}",
        "--max-restarts=0",
        "--no-prewarm",
        str(script),
        "--",
        str(cue),
    )
    assert result.returncode == 0, result.stderr
    job = re.search(r"Submitted batch job (\d+)", result.stdout)
    job_dir = re.search(r"Job directory: (\S+)", result.stdout)
    assert job is not None, result.stdout
    assert job_dir is not None, result.stdout
    directory = Path(job_dir.group(1))
    assert wait_until(lambda: bool(spare_slots(directory)), 120), kinds(directory)
    (spare,) = spare_slots(directory)
    cue.touch()
    assert cluster.wait_queue_empty(120), cluster.squeue()
    failed = [e for e in events.read(directory / "events.jsonl") if e.kind == "failed"]
    assert spare in {event.slot for event in failed}, "the spare heard the job fail and left"
