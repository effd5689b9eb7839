"""Fault injection into a real elastic job on the local cluster, and the invariants after it.

One run: ``hpc-elastic submit --nodes=1:2`` of examples/train.py (one worker per node, a
short job), one fault injected once training is under way, then the checks that every fault
must pass: the job finishes with every step or fails with a clear reason; no committed
checkpoint is lost or replaced by a partial one; while the world stays at two ranks, every
logged loss equals the uninterrupted reference run's loss at that step (bitwise identity is
only promised at the same world size); nothing stays queued or running; the timeline records
the fault. tests/test_faults.py runs each fault as one test; by hand, with a running
``scripts/dev-cluster`` (``source <state dir>/env.sh`` first)::

    PYTHONPATH=. .venv/bin/python tests/faults.py --fault worker-kill
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cluster import MARKER, Cluster, wait_until

from hpc_elastic import events

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
STEPS = 40
INJECT_AT = 12
"""The step after which the fault comes: two checkpoints (5, 10) are committed by then."""
TRAIN_ARGS = (
    f"--steps={STEPS}",
    "--checkpoint-every=5",
    "--hidden=32",
    "--lr=0.01",
    "--batch-size=16",
    "--micro-batch-size=8",
    "--dataset-size=320",
)
SESSION_TIMEOUT = 4
STEP_LINE = re.compile(r"^step=(\d+) loss=(\S+) world=(\d+)$", re.M)
DONE_LINE = re.compile(r"^done step=\d+ weights_sha256=(\w+)$", re.M)


@dataclass(frozen=True)
class Reference:
    """The uninterrupted two-rank run: its loss at every step and its final weights."""

    losses: dict[int, str]
    weights: str


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
    committed_before: dict[str, str] = field(default_factory=dict)
    spoiled: set[str] = field(default_factory=set)
    """Checkpoints the fault itself damaged on purpose, which the run must skip, not keep."""

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
        return [
            pid
            for pid, args in self.processes(task).items()
            if str(TRAIN) in args and " agent " not in args
        ]


Inject = Callable[[Run], None]


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


def _signal_worker(sig: signal.Signals, task: int = 1) -> Inject:
    def inject(run: Run) -> None:
        assert wait_until(lambda: bool(run.workers(task)), 30), "no worker to signal"
        os.kill(run.workers(task)[0], sig)

    return inject


def _kill_agent(run: Run) -> None:
    os.kill(run.agent(1), signal.SIGKILL)


def _node_down(run: Run) -> None:
    """The node crashes (slurmd and its steps die), then comes back once the job shrank."""
    node = run.node(1)
    run.cluster.node_kill(node)
    assert wait_until(lambda: any(w == 1 for _, _, w in run.steps()), 60), "never shrank"
    run.cluster.node_start(node)


def _drain(run: Run) -> None:
    """A drain keeps new work off the node; the running task must not notice."""
    node = run.node(1)
    run.cluster.run(["scontrol", "update", f"nodename={node}", "state=drain", "reason=fault"])
    try:
        time.sleep(3)
    finally:
        run.cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)


def _preempt(run: Run) -> None:
    """A high-partition job needs three of the four nodes: one of the job's slots must go."""
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
    assert wait_until(lambda: (holder, "RUNNING") in run.cluster.squeue(), 60), "no preemption"


def _zk_outage(seconds: float) -> Inject:
    def inject(run: Run) -> None:
        run.cluster.zk_stop()
        try:
            time.sleep(seconds)
        finally:
            run.cluster.zk_start()

    return inject


def _expire_session(run: Run) -> None:
    """A frozen agent misses its heartbeats: the server expires its session while it sleeps."""
    agent = run.agent(1)
    os.kill(agent, signal.SIGSTOP)
    try:
        time.sleep(SESSION_TIMEOUT * 2 + 2)
    finally:
        os.kill(agent, signal.SIGCONT)


def _fill_disk(run: Run) -> None:
    """Leave a few kB on the checkpoint filesystem: the next save runs out of space."""
    stats = os.statvfs(run.checkpoint_dir)
    free = stats.f_bavail * stats.f_frsize
    with open(run.checkpoint_dir / "filler", "wb") as filler:
        filler.write(b"\0" * max(free - 8192, 0))


def _corrupt_then_kill_worker(run: Run) -> None:
    """Flip bytes inside the newest checkpoint's records, then make the workers load it."""
    newest = max(run.checkpoint_dir.glob("step-*"))
    state = newest / "state.pt"
    data = bytearray(state.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(byte ^ 0xFF for byte in data[middle : middle + 64])
    state.write_bytes(bytes(data))
    run.spoiled.add(newest.name)
    _signal_worker(signal.SIGKILL)(run)


def _kill_worker_during_rerendezvous(run: Run) -> None:
    """Slot 1's agent dies; while slot 0 re-forms without it, slot 0's worker dies too."""
    _kill_agent(run)
    _signal_worker(signal.SIGKILL, task=0)(run)


FAULTS = {
    fault.name: fault
    for fault in (
        Fault("worker-kill", _signal_worker(signal.SIGKILL), "finished", ("restart",)),
        Fault(
            "worker-stop",
            _signal_worker(signal.SIGSTOP),
            "finished",
            ("restart",),
            submit_args=("--hang-timeout=8",),
        ),
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


def submit(
    cluster: Cluster,
    workdir: Path,
    checkpoint_dir: Path,
    submit_args: tuple[str, ...] = (),
    train_args: tuple[str, ...] = (),
) -> Run:
    """Submit the example job through the real CLI; returns it once submitted."""
    argv = [
        sys.executable,
        "-m",
        "hpc_elastic",
        "submit",
        "--nodes=1:2",
        "--nproc-per-node=1",
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
    with contextlib.ExitStack() as stack:
        checkpoint_dir = workdir / "checkpoints"
        if fault.scratch_fs:
            stack.enter_context(scratch_filesystem(checkpoint_dir))
        run = submit(cluster, workdir, checkpoint_dir, fault.submit_args, fault.train_args)
        stack.callback(_cancel, run)
        if not wait_until(lambda: run.last_step() >= INJECT_AT, 180, interval=0.2):
            return Result(fault.name, "never started", None, ("training never started",), "")
        run.committed_before = committed(checkpoint_dir)
        run.injected_at_step = run.last_step()
        with longest_stall(run) as stall:
            fault.inject(run)
            cluster.wait_queue_empty(240)
        run.recovery_s = stall[0]
        cluster.wait_no_strays(30)
        return check(run, fault, reference)


@contextlib.contextmanager
def longest_stall(run: Run) -> Iterator[list[float]]:
    """The longest time without a new step from now until the last step: the fault's cost."""
    longest = [0.0]
    done = threading.Event()

    def watch() -> None:
        step, since = run.last_step(), time.monotonic()
        while not done.wait(0.2) and step < STEPS:
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


def check(run: Run, fault: Fault, reference: Reference) -> Result:
    violations = []
    lines = run.steps()
    log = run.log.read_text() if run.log.exists() else ""
    failed = [str(e.details.get("reason", "")) for e in run.events() if e.kind == "failed"]
    if f"done step={STEPS} " in log and {s for s, _, _ in lines} == set(range(1, STEPS + 1)):
        outcome, detail = "finished", f"all {STEPS} steps"
    elif failed and all(failed):
        outcome, detail = "failed", failed[0]
    else:
        outcome, detail = "unclear", f"last step {run.last_step()}, no failed event with a reason"
    if outcome != fault.outcome:
        violations.append(f"expected {fault.outcome}, got {outcome} ({detail})")
    if fault.root_cause not in detail:
        violations.append(f"the reason does not say {fault.root_cause!r}: {detail}")

    now = committed(run.checkpoint_dir)
    for name, digest in run.committed_before.items():
        if name in now and now[name] != digest and name not in run.spoiled:
            violations.append(f"checkpoint {name} was overwritten")
    if run.committed_before and max(now, default="") < max(run.committed_before):
        violations.append(f"newest checkpoint went back from {max(run.committed_before)}")
    if any(path.name.startswith(".") for path in run.checkpoint_dir.glob(".*step*")):
        violations.append("a partial checkpoint was left next to the committed ones")

    for step, loss, world in lines:
        if world != 2:
            break
        if reference.losses.get(step) != loss:
            violations.append(f"step {step} loss {loss} differs from {reference.losses.get(step)}")
            break
    final = DONE_LINE.search(log)
    same_world = all(world == 2 for _, _, world in lines)
    if outcome == "finished" and same_world and (final is None or final[1] != reference.weights):
        violations.append("the final weights differ from the uninterrupted run's")

    if run.cluster.squeue():
        violations.append(f"jobs left in the queue: {run.cluster.squeue()}")
    if run.cluster.strays():
        violations.append(f"processes left behind: {run.cluster.strays()}")
    if fault.recorded_by and not set(fault.recorded_by) & set(run.kinds()):
        violations.append(f"no {' or '.join(fault.recorded_by)} event in {run.kinds()}")
    recovery = run.recovery_s if outcome == "finished" else None
    counts = Counter(run.kinds())
    summary = ", ".join(f"{kind} {count}" for kind, count in sorted(counts.items()))
    return Result(fault.name, outcome, recovery, tuple(violations), detail, summary)


def reference_run(workdir: Path) -> Reference:
    """The uninterrupted run at the same world size (two ranks), under plain torchrun."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {key: value for key, value in os.environ.items() if key != MARKER}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.pop(events.EVENTS_FILE_ENV, None)
    subprocess.run(
        [
            str(torchrun),
            "--nnodes=1",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            str(TRAIN),
            *TRAIN_ARGS,
            f"--checkpoint-dir={workdir / 'reference-checkpoints'}",
            f"--log-file={workdir / 'reference.log'}",
        ],
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
    return Reference(losses, final.group(1))


def describe(result: Result) -> str:
    stall = "" if result.recovery_s is None else f"; longest stall {result.recovery_s:.1f} s"
    return f"{result.fault}: {result.outcome} ({result.detail[:200]}){stall}; {result.events}"


def main() -> int:
    parser = argparse.ArgumentParser(description="Inject one fault into a real elastic job.")
    parser.add_argument("--fault", choices=sorted(FAULTS), required=True)
    parser.add_argument("--state-dir", type=Path, default=os.environ.get(MARKER))
    args = parser.parse_args()
    if args.state_dir is None:
        parser.error(f"give --state-dir or set {MARKER} to a running scripts/dev-cluster")
    cluster = Cluster.from_state_dir(args.state_dir)
    workdir = Path(tempfile.mkdtemp(prefix=f"fault-{args.fault}-"))
    result = run_fault(cluster, workdir, FAULTS[args.fault], reference_run(workdir))
    print(describe(result))
    for violation in result.violations:
        print(f"  violated: {violation}")
    print(f"  files: {workdir}")
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
