"""Fault injection into a real elastic job on the local cluster, and the invariants after it.

One run: ``hpc-elastic submit --nodes=1:2`` of examples/train.py (one worker per node, a
short job), one fault injected once training is under way, then the checks that every fault
must pass: the job finishes with every step or fails with a clear reason; no committed
checkpoint is lost or replaced by a partial one; while the world stays at its full size, every
logged loss equals the uninterrupted reference run's loss at that step (bitwise identity is
only promised at the same world size); at most one writer of checkpoints at any time; nothing
stays queued or running; the timeline records the fault.

The partition rows (``Fault.netns``) run a ``2:3`` job on a cluster whose nodes each live in a
network namespace (``scripts/dev-cluster up --netns``) and cut or slow the link of the node
that runs rank 0, the writer of the step log and of every checkpoint.

tests/robustness/test_faults.py runs each fault as one test; by hand, with a running
``scripts/dev-cluster`` (``up --netns`` for the partition rows)::

    PYTHONPATH=. .venv/bin/python tests/faults.py --state-dir DIR --fault worker-kill
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ranks
from cluster import MARKER, Cluster, wait_until

from hpc_elastic import events

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
STEPS = 40
INJECT_AT = 12
"""The step after which the fault comes: two checkpoints (5, 10) are committed by then."""
TRAIN_ARGS = (
    "--checkpoint-every=5",
    "--hidden=32",
    "--lr=0.01",
    "--batch-size=16",
    "--micro-batch-size=8",
    "--dataset-size=320",
)
SESSION_TIMEOUT = 4
PARTITION_NODES = "2:3"
"""Three nodes, so that two are left, enough to go on, when one is cut off."""
PARTITION_TRAIN_ARGS = ("--batch-size=12",)
"""A global batch that splits evenly over one, two and three ranks."""
PARTITION_STEPS = 20
"""Steps of a partition row whose cut stops training at once (from the peers, or both) or only
slows it: the cut comes at step 12, and the eight steps or more left to run (ten after a resume
from step 10) show the job training on at its full size. A row cut from ZooKeeper alone keeps
the matrix's 40: its ranks train on into the cut until the fence stops the cut node (about 3 s),
and they must not reach the last step before the others form a new round (about 9 s)."""
PARTITION_S = SESSION_TIMEOUT * 2 + 2
"""How long a link stays cut: long enough for the server to expire the cut node's session."""
QUEUE_DEADLINE = 240
"""Seconds from the fault's injection within which the job must have left the queue."""
DROP_DEADLINE = 120
"""How long a cut from ZooKeeper may last at most while it waits for the others to drop the cut
node: the session's expiry, the last call and the stop take about 10 s on a quiet machine."""
SHRINK_DEADLINE = 180
"""How long the survivor of a crashed node may take to step alone: the crash noticed (its
links close at once, its session within SESSION_TIMEOUT), the last call, its workers' stop
and start, torch's import and a checkpoint's load. About 15 s on a quiet machine; not within
60 s at a load of 40 on 2 cores."""
STEP_LINE = re.compile(r"^step=(\d+) loss=(\S+) world=(\d+)$", re.M)
DONE_LINE = re.compile(r"^done step=\d+ weights_sha256=(\w+)$", re.M)


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run at the job's full size: its loss at every step, its final weights."""

    losses: dict[int, str]
    weights: str
    world: int = 2
    steps: int = STEPS


@dataclass
class Run:
    """One submitted job: where it writes, and what the harness saw while it ran."""

    cluster: Cluster
    workdir: Path
    job: str
    job_dir: Path
    checkpoint_dir: Path
    injected_at_step: int = 0
    recovery_s: float | None = None
    """The longest stall in training after the fault, in seconds."""
    ended_s: float | None = None
    """Seconds from the fault's injection until the queue was empty (None: not within
    QUEUE_DEADLINE): the row's margin is QUEUE_DEADLINE minus this."""
    committed_before: dict[str, str] = field(default_factory=dict)
    spoiled: set[str] = field(default_factory=set)
    """Checkpoints the fault itself damaged on purpose, which the run must skip, not keep."""
    placeholder: str = ""
    """The job that holds ``Fault.hold_nodes`` nodes until the fault frees them."""
    cut_at: float | None = None
    """When a partition row cut its link (seconds since 1970, as events are stamped)."""

    @property
    def log(self) -> Path:
        return self.workdir / "steps.log"

    def steps(self) -> list[tuple[int, str, int]]:
        """(step, loss, world size) of every step line rank 0 logged, in order."""
        text = self.log.read_text() if self.log.exists() else ""
        return [(int(s), loss, int(w)) for s, loss, w in STEP_LINE.findall(text)]

    def last_step(self) -> int:
        return max((step for step, _, _ in self.steps()), default=0)

    def events(self) -> list[events.Event]:
        path = self.job_dir / "events.jsonl"
        return list(events.read(path)) if path.exists() else []

    def kinds(self) -> list[str]:
        return [event.kind for event in self.events()]

    def node(self, task: int) -> str:
        squeue = ["squeue", "-h", "-j", f"{self.job}_{task}", "-o", "%N"]
        return self.cluster.run(squeue).stdout.strip()

    def processes(self, task: int) -> dict[int, str]:
        """pid -> command line of every process of one array task (agent, workers)."""
        wanted = {f"SLURM_ARRAY_JOB_ID={self.job}", f"SLURM_ARRAY_TASK_ID={task}"}
        found = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
                if wanted <= environ:
                    argv = (proc / "cmdline").read_bytes().decode(errors="replace")
                    found[int(proc.name)] = argv.replace("\0", " ")
            except OSError:
                continue
        return found

    def agent(self, task: int) -> int:
        """The agent itself, not the ``srun`` that launched it (same task, same arguments)."""
        return next(
            pid
            for pid, args in self.processes(task).items()
            if " -m hpc_elastic agent " in args and not args.startswith("srun ")
        )

    def workers(self, task: int) -> list[int]:
        """The task's running workers, not the standbys that wait to become the next ones:
        those carry the same command line (agent/standby.py), and with pids wrapped around on
        a busy machine a standby may come first (the worker-kill row once killed one)."""
        return [
            pid
            for pid, args in self.processes(task).items()
            # The worker runs the job's code snapshot (<job dir>/code/examples/train.py), not
            # TRAIN itself: match the path inside the project.
            if f"/{TRAIN.relative_to(REPO)} " in args
            and " agent " not in args
            and not waits_for_its_order(pid)
        ]

    def formed_without(self, slot: str) -> bool:
        """Whether a round formed after the cut leaves ``slot`` out."""
        cut_at = self.cut_at or 0.0
        return any(
            slot not in event.details.get("members", [slot])
            for event in self.events()
            if event.kind == "round" and event.time >= cut_at
        )

    def rank_zero_task(self) -> int | None:
        """The array task whose agent last started rank 0 (from its "start" event), if any.

        Not from the workers' /proc environ: prewarmed workers get theirs only later, on stdin.
        """
        starts = [event for event in self.events() if event.kind == "start"]
        with_zero = [event for event in starts if 0 in event.details.get("ranks", [])]
        return int(with_zero[-1].slot) if with_zero else None


Inject = Callable[[Run], None]


class FaultMissed(AssertionError):
    """An injected fault did not take effect: judged anyway, the row would pass on a job that
    was never disturbed (the matrix once froze ``srun`` instead of the agent, and a session
    never expired)."""


def confirm(happened: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Wait until ``happened()``; else fail the row, saying which part of the fault is missing."""
    if not wait_until(happened, timeout, interval=0.1):
        raise FaultMissed(f"the fault did not take effect: {what} (waited {timeout:g} s)")


def waits_for_its_order(pid: int) -> bool:
    """Whether ``pid`` is a standby that still waits on its stdin pipe for a rank's order: a
    worker reads nothing there (the agent starts a cold one on /dev/null, and a standby points
    its stdin at /dev/null once its order came)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/0").startswith("pipe:")
    except OSError:
        return False


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, T, Z, ...); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def gone(pid: int) -> bool:
    """Whether ``pid`` has died: no longer listed, or a zombie that only waits to be reaped."""
    return process_state(pid) in (None, "Z", "X")


def stopped(pid: int) -> bool:
    return process_state(pid) in ("T", "t")


def slurmd_running(cluster: Cluster, node: str) -> bool:
    """Whether this cluster's slurmd of ``node`` runs (``slurmd -f <its slurm.conf> -N node``)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        words = [word.decode(errors="replace") for word in argv]
        ours = bool(words) and words[0].endswith("slurmd") and str(cluster.slurm_conf) in words
        if ours and node in words and not gone(int(proc.name)):
            return True
    return False


def zookeeper_answers(cluster: Cluster) -> bool:
    """Whether the cluster's ZooKeeper accepts a connection and answers ``ruok`` with imok."""
    try:
        with socket.create_connection((cluster.zk_host, cluster.zk_port), timeout=2) as sock:
            sock.sendall(b"ruok")
            sock.settimeout(2)
            return sock.recv(16) == b"imok"
    except OSError:
        return False


def node_state(cluster: Cluster, node: str) -> str:
    """``State=`` of ``scontrol show node``, e.g. ``MIXED+DRAIN`` or ``IDLE``."""
    record = cluster.run(["scontrol", "-o", "show", "node", node], check=False).stdout
    found = re.search(r"\bState=(\S+)", record)
    return found.group(1) if found else ""


def hostnames(cluster: Cluster, nodelist: str) -> set[str]:
    """``n[1-3]`` as the node names it stands for."""
    shown = cluster.run(["scontrol", "show", "hostnames", nodelist], check=False).stdout
    return set(shown.split())


def reaches(cluster: Cluster, node: str, host: str, port: int) -> bool:
    """Whether a TCP connection from inside ``node``'s network namespace to host:port opens
    within 3 s (a cut link drops the packets, so the attempt times out)."""
    dial = f"exec 3<>/dev/tcp/{host}/{port}"
    argv = cluster.in_node_net(node, ["timeout", "3", "bash", "-c", dial])
    return cluster.run(argv, check=False, timeout=30).returncode == 0


def slurmd_port(cluster: Cluster, node: str) -> int:
    """The port ``node``'s slurmd listens on, on the node's own address (``--netns``)."""
    ports = (cluster.state_dir / "ports").read_text().splitlines()
    base = next(line.split("=", 1)[1] for line in ports if line.startswith("SLURMD_BASE_SAVED="))
    return int(base) + int(node[1:]) - 1


def peers_of(cluster: Cluster, node: str) -> list[str]:
    return [other for other in cluster.nodes if other != node]


def link_cut_works(cluster: Cluster, node: str, what: str, cut: bool) -> Callable[[], bool]:
    """A check that ``node``'s link to ``what`` (zk, peers, both) is cut (``cut``) or whole: it
    dials ZooKeeper for zk and the other nodes' slurmd for peers, from inside the node."""

    def check() -> bool:
        targets = []
        if what in ("zk", "both"):
            targets.append((cluster.zk_host, cluster.zk_port))
        if what in ("peers", "both"):
            targets += [
                (cluster.node_address(other), slurmd_port(cluster, other))
                for other in peers_of(cluster, node)
            ]
        # In parallel: each dial over a cut link waits out its 3 s.
        with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
            reached = list(pool.map(lambda target: reaches(cluster, node, *target), targets))
        return all(ok != cut for ok in reached)

    return check


def link_slowed(cluster: Cluster, node: str) -> bool:
    """Whether ``node``'s link is shaped (a token bucket on its interface) and lossy."""
    argv = cluster.in_node_net(node, ["tc", "qdisc", "show", "dev", "hpe0"])
    shaped = " tbf " in cluster.run(argv, check=False).stdout
    rules = cluster.run(cluster.in_node_net(node, ["iptables", "-w", "-S"]), check=False).stdout
    return shaped and "statistic" in rules


@dataclass(frozen=True)
class Fault:
    """One row of the matrix: how to inject it, the outcome it must have, what records it."""

    name: str
    inject: Inject
    outcome: str
    """"finished" (every step ran) or "failed" (a clear reason in a failed event)."""
    recorded_by: tuple[str, ...]
    """Event kinds of which at least one must appear; () where nothing in the job changes."""
    submit_args: tuple[str, ...] = ()
    train_args: tuple[str, ...] = ()
    scratch_fs: bool = False
    """Checkpoints on a small tmpfs of their own, for the disk-full fault."""
    root_cause: str = ""
    """What the failed event's reason must say, for a fault that must fail the job."""
    nodes: str = "1:2"
    hold_nodes: int = 0
    """Nodes a placeholder job holds from before the submit until the fault frees them."""
    steps: int = STEPS
    """Optimizer steps the job runs; its reference run must run as many."""
    netns: bool = False
    """Needs a cluster whose nodes live in network namespaces (``scripts/dev-cluster --netns``)."""
    hangs: int = 0
    """Rounds in which a hang must be caught: one for the planted hang, none anywhere else. A
    hang caught in a row that plants none is a false alarm (the matrix once saw them at a
    fixed ``--hang-timeout 4`` on the loaded machine)."""

    @property
    def world(self) -> int:
        """The job's full size: the world at which its losses must match the reference run."""
        return int(self.nodes.split(":")[-1])


def _signal_worker(sig: signal.Signals, task: int = 1) -> Inject:
    def inject(run: Run) -> None:
        signalled: list[int] = []

        def signal_one() -> bool:
            # One listing, then the signal: during a re-rendezvous a worker listed a moment
            # ago may have ended since, so a listing is never read twice.
            for worker in run.workers(task)[:1]:
                try:
                    os.kill(worker, sig)
                except ProcessLookupError:  # ended between the listing and the signal
                    return False
                signalled.append(worker)
            return bool(signalled)

        confirm(signal_one, f"slot {task} has no worker to signal")
        worker = signalled[0]
        if sig == signal.SIGKILL:
            confirm(lambda: gone(worker), f"worker {worker} of slot {task} outlived SIGKILL")
        elif sig == signal.SIGSTOP:
            # Checked at once: the learned deadline kills it a minute later.
            confirm(lambda: stopped(worker), f"worker {worker} of slot {task} is not stopped")

    return inject


def _kill_agent(run: Run) -> None:
    agent = run.agent(1)
    os.kill(agent, signal.SIGKILL)
    confirm(lambda: gone(agent), f"slot 1's agent {agent} outlived SIGKILL")


def _node_down(run: Run) -> None:
    """The node crashes (slurmd and its steps die), then comes back once the job shrank."""
    node = run.node(1)
    confirm(lambda: bool(node), "slot 1 runs on no node")
    run.cluster.node_kill(node)
    confirm(lambda: not slurmd_running(run.cluster, node), f"the slurmd of {node} still runs")
    confirm(lambda: not run.processes(1), f"slot 1's processes on {node} outlived its crash")
    assert wait_until(lambda: any(w == 1 for _, _, w in run.steps()), SHRINK_DEADLINE), (
        "never shrank"
    )
    run.cluster.node_start(node)
    confirm(lambda: slurmd_running(run.cluster, node), f"the slurmd of {node} did not come back")


def _drain(run: Run) -> None:
    """A drain keeps new work off the node; the running task must not notice."""
    node = run.node(1)
    run.cluster.run(["scontrol", "update", f"nodename={node}", "state=drain", "reason=fault"])
    try:
        confirm(lambda: "DRAIN" in node_state(run.cluster, node), f"{node} is not draining")
        time.sleep(3)  # the drain lasts 3 s: the scenario itself
    finally:
        run.cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
    confirm(lambda: "DRAIN" not in node_state(run.cluster, node), f"{node} was not resumed")


def _preempt(run: Run) -> None:
    """A high-partition job needs three of the four nodes: one of the job's slots must go."""

    def job_nodes() -> set[str]:
        return {run.node(task) for task in (0, 1)} - {""}

    confirm(lambda: len(job_nodes()) == 2, "the job does not run on two nodes to preempt")
    ours = job_nodes()
    holder = run.cluster.run(
        [
            "sbatch",
            "--parsable",
            "--partition=high",
            "--nodes=3",
            "--output=/dev/null",
            "--wrap=srun sleep 8",
        ]
    ).stdout.strip()
    confirm(lambda: (holder, "RUNNING") in run.cluster.squeue(), f"high job {holder} never ran", 60)
    # Three nodes of four while the job held two: at least one was taken from the job.
    held = run.cluster.run(["squeue", "-h", "-j", holder, "-o", "%N"]).stdout.strip()
    taken = ours & hostnames(run.cluster, held)
    confirm(lambda: bool(taken), f"high job {holder} took none of the nodes {sorted(ours)}", 0)


def _zk_outage(seconds: float) -> Inject:
    def inject(run: Run) -> None:
        run.cluster.zk_stop()
        try:
            confirm(lambda: not zookeeper_answers(run.cluster), "ZooKeeper still answers ruok")
            time.sleep(seconds)  # the outage's length: the scenario itself
        finally:
            run.cluster.zk_start()
        confirm(lambda: zookeeper_answers(run.cluster), "ZooKeeper did not come back")

    return inject


def _expire_session(run: Run) -> None:
    """A frozen agent misses its heartbeats: the server expires its session while it sleeps."""
    agent = run.agent(1)
    os.kill(agent, signal.SIGSTOP)
    try:
        confirm(lambda: stopped(agent), f"slot 1's agent {agent} is not stopped")
        time.sleep(SESSION_TIMEOUT * 2 + 2)  # frozen for twice the session: the scenario
    finally:
        os.kill(agent, signal.SIGCONT)
    confirm(lambda: not stopped(agent), f"slot 1's agent {agent} did not continue")


def _fill_disk(run: Run) -> None:
    """Leave a few kB on the checkpoint filesystem: the next save runs out of space."""
    stats = os.statvfs(run.checkpoint_dir)
    free = stats.f_bavail * stats.f_frsize
    with open(run.checkpoint_dir / "filler", "wb") as filler:
        filler.write(b"\0" * max(free - 8192, 0))

    def full() -> bool:
        stats = os.statvfs(run.checkpoint_dir)
        return stats.f_bavail * stats.f_frsize <= 16384

    confirm(full, f"{run.checkpoint_dir} still has room for a checkpoint", 0)


def _corrupt_then_kill_worker(run: Run) -> None:
    """Flip bytes inside the newest checkpoint's records, then make the workers load it."""
    newest = max(run.checkpoint_dir.glob("step-*"))
    state = newest / "state.pt"
    data = bytearray(state.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(byte ^ 0xFF for byte in data[middle : middle + 64])
    state.write_bytes(bytes(data))
    confirm(lambda: state.read_bytes() == bytes(data), f"{state} was not corrupted", 0)
    run.spoiled.add(newest.name)
    _signal_worker(signal.SIGKILL)(run)


def _rank_zero_node(run: Run) -> str:
    """The node of rank 0: it writes the step log and the checkpoints, so cutting it off is what
    can make two writers (the split brain of issue 11) if the product does not fence it."""
    assert wait_until(lambda: run.rank_zero_task() is not None, 30), "no rank 0 worker"
    task = run.rank_zero_task()
    assert task is not None
    return run.node(task)


def _partition(
    what: str, seconds: float = PARTITION_S, free_nodes: bool = False, until_dropped: bool = False
) -> Inject:
    """Cut rank 0's node off from ``what`` (zk, peers or both) for ``seconds``, then heal it;
    with ``free_nodes``, free the placeholder's nodes as soon as the link is cut.

    With ``until_dropped``, the cut lasts (after ``seconds``) until the others have formed a
    round without the cut node, or DROP_DEADLINE passed. A fixed cut raced that round: on a
    loaded machine the others formed it 11 s after a 10-s cut, the healed node was back in
    time to join it, and the row's ``node_lost`` never came (a bug in the test, seen in CI)."""

    def inject(run: Run) -> None:
        node = _rank_zero_node(run)
        cut_slot = str(run.rank_zero_task())
        run.cluster.link_cut(node, what)
        run.cut_at = time.time()
        try:
            if free_nodes:
                run.cluster.run(["scancel", run.placeholder])
            cut = link_cut_works(run.cluster, node, what, cut=True)
            confirm(cut, f"{node} still reaches {what}")
            time.sleep(max(seconds - (time.time() - run.cut_at), 0))
            if until_dropped:
                wait_until(lambda: run.formed_without(cut_slot), DROP_DEADLINE)
        finally:
            run.cluster.link_heal(node)
        confirm(link_cut_works(run.cluster, node, what, cut=False), f"{node}'s link was not healed")

    return inject


def _hold(cluster: Cluster, nodes: int) -> str:
    """A job on ``nodes`` nodes, running before the elastic job is submitted, so that the elastic
    job starts with the nodes left and grows when the placeholder is cancelled."""
    job = cluster.run(
        ["sbatch", "--parsable", f"--nodes={nodes}", "--output=/dev/null", "--wrap=srun sleep 600"]
    ).stdout.strip()
    assert wait_until(lambda: (job, "RUNNING") in cluster.squeue(), 60), "placeholder never ran"
    return job


def _slow_link(run: Run) -> None:
    """Rank 0's link at 256 kbit/s each way, losing 20 % of its packets, for PARTITION_S."""
    node = _rank_zero_node(run)
    run.cluster.link_slow(node, "256kbit", 20)
    try:
        confirm(lambda: link_slowed(run.cluster, node), f"{node}'s link is not slowed", 0)
        time.sleep(PARTITION_S)  # how long the link stays slow: the scenario itself
    finally:
        run.cluster.link_heal(node)
    confirm(lambda: not link_slowed(run.cluster, node), f"{node}'s link is still slowed")


def _kill_worker_during_rerendezvous(run: Run) -> None:
    """Slot 1's agent dies; while slot 0 re-forms without it, slot 0's worker dies too."""
    _kill_agent(run)
    _signal_worker(signal.SIGKILL, task=0)(run)  # each confirms its own kill


FAULTS = {
    fault.name: fault
    for fault in (
        Fault("worker-kill", _signal_worker(signal.SIGKILL), "finished", ("restart",)),
        # No --hang-timeout: the learned step deadline (a minute at least) must catch it.
        Fault("worker-stop", _signal_worker(signal.SIGSTOP), "finished", ("restart",), hangs=1),
        Fault("agent-kill", _kill_agent, "finished", ("node_lost",)),
        Fault("node-down", _node_down, "finished", ("node_lost",)),
        Fault("node-drain", _drain, "finished", ()),
        Fault("preemption", _preempt, "finished", ("preempt", "requeue")),
        Fault("zk-stop-2s", _zk_outage(2), "finished", ()),
        Fault("zk-stop-30s", _zk_outage(30), "finished", ()),
        Fault("zk-session-expiry", _expire_session, "finished", ("node_lost",)),
        Fault(
            "disk-full",
            _fill_disk,
            "failed",
            ("failed",),
            scratch_fs=True,
            root_cause="Could not write checkpoint step",
        ),
        Fault("checkpoint-corrupt", _corrupt_then_kill_worker, "finished", ("restart",)),
        Fault(
            "worker-kill-during-rerendezvous",
            _kill_worker_during_rerendezvous,
            "finished",
            ("node_lost", "restart"),
        ),
        *(
            Fault(
                f"partition-{what}",
                _partition(what, until_dropped="node_lost" in recorded_by),
                "finished",
                recorded_by,
                nodes=PARTITION_NODES,
                train_args=PARTITION_TRAIN_ARGS,
                steps=steps,
                netns=True,
            )
            for what, recorded_by, steps in (
                ("zk", ("node_lost",), STEPS),
                ("peers", (), PARTITION_STEPS),
                ("both", ("node_lost",), PARTITION_STEPS),
            )
        ),
        # The split brain of issue 11, made by a real partition: the job trains on one node while
        # the others are busy; that node loses ZooKeeper (its agent only sees SUSPENDED), the
        # others free up and, once its session expired, form a round without it. Unless the
        # product fences the lone node, both train and write checkpoints at once.
        Fault(
            "partition-zk-lone-writer",
            # The cut outlasts what the freed nodes need to form their round (the session's
            # expiry, the last call and the workers' start: about 11 s), or the healed agent
            # learns it lost its session and stops its workers before the round starts.
            _partition("zk", seconds=SESSION_TIMEOUT * 5, free_nodes=True),
            "finished",
            (),
            nodes="1:3",
            hold_nodes=3,
            # Slow enough, and steps enough (the matrix's 40), that the lone node is still
            # training when the new round starts.
            train_args=(*PARTITION_TRAIN_ARGS, "--sleep-per-step=0.7"),
            netns=True,
        ),
        Fault(
            "partition-slow-link",
            _slow_link,
            "finished",
            (),
            nodes=PARTITION_NODES,
            train_args=PARTITION_TRAIN_ARGS,
            steps=PARTITION_STEPS,
            netns=True,
        ),
    )
}


@dataclass(frozen=True)
class Result:
    fault: str
    outcome: str
    recovery_s: float | None
    violations: tuple[str, ...]
    detail: str
    events: str = ""
    """How many events of each kind the timeline holds, e.g. "node_lost 1, round 3"."""
    after_cut: str = ""
    """For a partition row: how long after the cut the cut-off node's workers were fenced and
    the next round started, e.g. "fenced 1.6 s, round 6.9 s after the cut"."""
    ended_s: float | None = None
    """``Run.ended_s``."""


def submit(
    cluster: Cluster,
    workdir: Path,
    checkpoint_dir: Path,
    submit_args: tuple[str, ...] = (),
    train_args: tuple[str, ...] = (),
    *,
    nodes: str = "1:2",
    steps: int = STEPS,
    nproc: int = 1,
) -> Run:
    """Submit the example job through the real CLI; returns it once submitted."""
    argv = [
        sys.executable,
        "-m",
        "hpc_elastic",
        "submit",
        f"--nodes={nodes}",
        f"--nproc-per-node={nproc}",
        "--partition=low",
        f"--zk={cluster.zk_hosts}",
        "--last-call=5",
        "--signal=USR2@15",
        f"--session-timeout={SESSION_TIMEOUT}",
        "--max-restarts=2",
        *submit_args,
        str(TRAIN),
        "--",
        *TRAIN_ARGS,
        f"--steps={steps}",
        "--sleep-per-step=0.3",
        f"--checkpoint-dir={checkpoint_dir}",
        f"--log-file={workdir / 'steps.log'}",
        *train_args,
    ]
    env = {**cluster.env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    job = re.search(r"Submitted batch job (\d+)", result.stdout)
    job_dir = re.search(r"Job directory: (\S+)", result.stdout)
    if result.returncode != 0 or job is None or job_dir is None:
        raise RuntimeError(f"submit failed: {result.stdout}{result.stderr}")
    return Run(cluster, workdir, job.group(1), Path(job_dir.group(1)), checkpoint_dir)


def committed(directory: Path) -> dict[str, str]:
    """Committed checkpoint name -> SHA-256 of its state file."""
    return {
        path.name: hashlib.sha256((path / "state.pt").read_bytes()).hexdigest()
        for path in sorted(directory.glob("step-*"))
        if (path / "state.pt").is_file()
    }


@contextlib.contextmanager
def scratch_filesystem(path: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path`` (needs root), unmounted afterwards."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def run_fault(cluster: Cluster, workdir: Path, fault: Fault, reference: Reference) -> Result:
    """Submit, inject at INJECT_AT, wait for the end, and check every invariant."""
    if reference.steps != fault.steps:
        raise ValueError(f"{fault.name} runs {fault.steps} steps, its reference {reference.steps}")
    with contextlib.ExitStack() as stack:
        checkpoint_dir = workdir / "checkpoints"
        if fault.scratch_fs:
            stack.enter_context(scratch_filesystem(checkpoint_dir))
        placeholder = _hold(cluster, fault.hold_nodes) if fault.hold_nodes else ""
        if placeholder:
            stack.callback(cluster.run, ["scancel", placeholder], check=False)
        run = submit(
            cluster,
            workdir,
            checkpoint_dir,
            fault.submit_args,
            fault.train_args,
            nodes=fault.nodes,
            steps=fault.steps,
        )
        run.placeholder = placeholder
        stack.callback(_cancel, run)
        if not wait_until(lambda: run.last_step() >= INJECT_AT, 180, interval=0.2):
            return Result(fault.name, "never started", None, ("training never started",), "")
        run.committed_before = committed(checkpoint_dir)
        run.injected_at_step = run.last_step()
        with longest_stall(run, fault.steps) as stall:
            injected = time.monotonic()
            try:
                fault.inject(run)
            except FaultMissed as missed:
                return Result(fault.name, "fault not injected", None, (str(missed),), "")
            if cluster.wait_queue_empty(QUEUE_DEADLINE):
                run.ended_s = time.monotonic() - injected
        run.recovery_s = stall[0]
        cluster.wait_no_strays(30)
        return check(run, fault, reference)


@contextlib.contextmanager
def longest_stall(run: Run, steps: int) -> Iterator[list[float]]:
    """The longest time without a new step from now until the last step: the fault's cost."""
    longest = [0.0]
    done = threading.Event()

    def watch() -> None:
        step, since = run.last_step(), time.monotonic()
        while not done.wait(0.2) and step < steps:
            if run.last_step() > step:
                step, since = run.last_step(), time.monotonic()
            longest[0] = max(longest[0], time.monotonic() - since)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield longest
    finally:
        done.set()
        watcher.join()


def _cancel(run: Run) -> None:
    """Whatever happened, leave no job behind (a no-op once the job ended by itself)."""
    run.cluster.run(["scancel", run.job], check=False)
    run.cluster.wait_queue_empty(60)


def outcome_of(run: Run, fault: Fault, log: str) -> tuple[str, str]:
    """How the run ended ("finished", "failed" or "unclear") and the evidence for it."""
    lines = run.steps()
    failed = [str(e.details.get("reason", "")) for e in run.events() if e.kind == "failed"]
    if f"done step={fault.steps} " in log and {s for s, _, _ in lines} == set(
        range(1, fault.steps + 1)
    ):
        return "finished", f"all {fault.steps} steps"
    if failed and all(failed):
        return "failed", failed[0]
    return "unclear", f"last step {run.last_step()}, no failed event with a reason"


def checkpoint_violations(run: Run) -> list[str]:
    """Committed checkpoints are never overwritten, never go back, never left half-written."""
    violations = []
    now = committed(run.checkpoint_dir)
    for name, digest in run.committed_before.items():
        if name in now and now[name] != digest and name not in run.spoiled:
            violations.append(f"checkpoint {name} was overwritten")
    if run.committed_before and max(now, default="") < max(run.committed_before):
        violations.append(f"newest checkpoint went back from {max(run.committed_before)}")
    if any(path.name.startswith(".") for path in run.checkpoint_dir.glob(".*step*")):
        violations.append("a partial checkpoint was left next to the committed ones")
    return violations


def check(run: Run, fault: Fault, reference: Reference) -> Result:
    violations = []
    lines = run.steps()
    log = run.log.read_text() if run.log.exists() else ""
    outcome, detail = outcome_of(run, fault, log)
    if outcome != fault.outcome:
        violations.append(f"expected {fault.outcome}, got {outcome} ({detail})")
    if fault.root_cause not in detail:
        violations.append(f"the reason does not say {fault.root_cause!r}: {detail}")
    violations.extend(checkpoint_violations(run))

    for step, loss, world in lines:
        if world != reference.world:
            break
        if reference.losses.get(step) != loss:
            violations.append(f"step {step} loss {loss} differs from {reference.losses.get(step)}")
            break
    violations.extend(writer_violations(lines, run.events()))
    final = DONE_LINE.search(log)
    same_world = all(world == reference.world for _, _, world in lines)
    if outcome == "finished" and same_world and (final is None or final[1] != reference.weights):
        violations.append("the final weights differ from the uninterrupted run's")

    if run.cluster.squeue():
        violations.append(f"jobs left in the queue: {run.cluster.squeue()}")
    if run.cluster.strays():
        violations.append(f"processes left behind: {run.cluster.strays()}")
    caught = hang_rounds(run.events())
    if len(caught) != fault.hangs:
        violations.append(f"hangs caught in {len(caught)} rounds ({caught}), {fault.hangs} planted")
    if fault.recorded_by and not set(fault.recorded_by) & set(run.kinds()):
        violations.append(f"no {' or '.join(fault.recorded_by)} event in {run.kinds()}")
    recovery = run.recovery_s if outcome == "finished" else None
    counts = Counter(run.kinds())
    summary = ", ".join(f"{kind} {count}" for kind, count in sorted(counts.items()))
    return Result(
        fault.name,
        outcome,
        recovery,
        tuple(violations),
        detail,
        summary,
        after_cut(run),
        run.ended_s,
    )


def hang_failures(timeline: list[events.Event]) -> list[events.Event]:
    """The failures that were caught hangs (a rank past its deadline, killed by its agent)."""
    return [event for event in timeline if event.kind == "failure" and event.details.get("hung")]


def hang_rounds(timeline: list[events.Event]) -> list[int | None]:
    """The rounds in which a hang was caught, each once: every rank of a job that trains in
    lockstep stalls behind a frozen one, so two agents may each catch theirs in that round."""
    return sorted({event.round for event in hang_failures(timeline)}, key=lambda r: r or 0)


def after_cut(run: Run) -> str:
    """The fencing figures of docs/reliability.md: seconds from the cut to the first fencing
    (a worker's stale lease, or the agent's own fence) and to the first round formed after it."""
    if run.cut_at is None:
        return ""
    cut_at = run.cut_at
    later = [event for event in run.events() if event.time >= cut_at]
    fenced = next(
        (
            event.time - cut_at
            for event in later
            if event.kind == "fenced" or event.details.get("reason") == "connection lost"
        ),
        None,
    )
    formed = next((event.time - cut_at for event in later if event.kind == "round"), None)
    parts = [
        f"{name} {seconds:.1f} s"
        for name, seconds in (("fenced", fenced), ("round", formed))
        if seconds is not None
    ]
    return (
        f"{', '.join(parts)} after the cut" if parts else "no fence and no new round after the cut"
    )


def writer_violations(lines: list[tuple[int, str, int]], timeline: list[events.Event]) -> list[str]:
    """Signs of two writers at once: rank 0 of two different rounds training side by side.

    The step log may go back only to resume: to one past a committed checkpoint (or to step
    1), at or below where it was. Any other jump means a second rank 0 is logging too (the split
    brain of issue 11 made the log go back 193 times in 25 s). And checkpoint commits, in time
    order, never go from a newer round back to an older one.
    """
    found = []
    commits = sorted(
        (event for event in timeline if event.kind == "checkpoint" and event.round is not None),
        key=lambda event: event.time,
    )
    resume_points = {1} | {int(event.details.get("step", -1)) + 1 for event in commits}
    previous = 0
    for step, _, _ in lines:
        if step != previous + 1 and not (step in resume_points and step <= previous + 1):
            found.append(f"the step log went from step {previous} to {step}: two writers")
            break
        previous = step
    newest: int | None = None
    for event in commits:
        assert event.round is not None
        if newest is not None and event.round < newest:
            stale = event.details.get("step")
            found.append(f"round {event.round} committed step {stale} after round {newest} had")
            break
        newest = event.round
    return found


def reference_run(
    workdir: Path, world: int = 2, train_args: tuple[str, ...] = (), steps: int = STEPS
) -> Reference:
    """The uninterrupted run of ``steps`` steps at world size ``world``, under plain torchrun."""
    env = {key: value for key, value in ranks.environment().items() if key != MARKER}
    subprocess.run(
        ranks.torchrun_command(
            world,
            TRAIN,
            *TRAIN_ARGS,
            f"--steps={steps}",
            f"--checkpoint-dir={workdir / 'reference-checkpoints'}",
            f"--log-file={workdir / 'reference.log'}",
            *train_args,
        ),
        cwd=workdir,
        env=env,
        capture_output=True,
        timeout=300,
        check=True,
    )
    text = (workdir / "reference.log").read_text()
    final = DONE_LINE.search(text)
    assert final is not None, text[-2000:]
    losses = {int(step): loss for step, loss, _ in STEP_LINE.findall(text)}
    return Reference(losses, final.group(1), world, steps)


def describe(result: Result) -> str:
    stall = "" if result.recovery_s is None else f"; longest stall {result.recovery_s:.1f} s"
    cut = f"; {result.after_cut}" if result.after_cut else ""
    ended = (
        f"; queue empty {result.ended_s:.0f} s after the fault (deadline {QUEUE_DEADLINE} s)"
        if result.ended_s is not None
        else f"; queue not empty {QUEUE_DEADLINE} s after the fault"
    )
    return (
        f"{result.fault}: {result.outcome} ({result.detail[:200]}){stall}{cut}{ended}; "
        f"{result.events}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="Inject one fault into a real elastic job.")
    parser.add_argument("--fault", choices=sorted(FAULTS), required=True)
    parser.add_argument("--state-dir", type=Path, default=os.environ.get(MARKER))
    args = parser.parse_args()
    if args.state_dir is None:
        parser.error(f"give --state-dir or set {MARKER} to a running scripts/dev-cluster")
    cluster = Cluster.from_state_dir(args.state_dir)
    workdir = Path(tempfile.mkdtemp(prefix=f"fault-{args.fault}-"))
    fault = FAULTS[args.fault]
    if fault.netns and not cluster.netns:
        parser.error(f"{fault.name} needs a cluster started with `scripts/dev-cluster up --netns`")
    reference = reference_run(workdir, fault.world, fault.train_args, fault.steps)
    result = run_fault(cluster, workdir, fault, reference)
    print(describe(result))
    for violation in result.violations:
        print(f"  violated: {violation}")
    print(f"  files: {workdir}")
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
