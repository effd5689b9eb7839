"""Recovery time and idle cost of the node agent, side by side with torchrun.

4 agents x 1 worker on this machine, the same tiny gloo script (tests/workloads/train_gloo.py)
for both launchers, in the same run:

* worker SIGKILL -> first step completed by the restarted group;
* agent SIGKILL  -> first step completed at the smaller world size (``--nodes 3:4``);
* idle agent CPU (%) and RSS (MB) over a few seconds of training.

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with 2.13's default no restart
recovers at all) and the c10d rendezvous; an attempt that has not recovered within
``--give-up`` seconds counts as "did not recover". Usage::

    python bench/agent_bench.py --zk 127.0.0.1:2181 [--repeats 3] [--node-repeats 10]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "tests" / "workloads" / "train_gloo.py"
AGENTS = 4

SETTLE = 15.0
"""Seconds of training before the fault: a failure in the first seconds is rare, and the next
set of standby workers needs that long to import torch on this loaded two-core machine."""

Probe = Callable[["Launch", float], "float | None"]


@dataclass
class Launch:
    """One run of 4 agents; ``progress`` rows are (time, step, world, rank 0's pid)."""

    agents: list[subprocess.Popen[bytes]]
    out: Path
    standbys: bool = False

    def progress(self) -> list[tuple[float, int, int, int]]:
        path = self.out / "progress"
        if not path.exists():
            return []
        rows = [line.split() for line in path.read_text().splitlines() if line.count(" ") == 4]
        return [(float(t), int(s), int(w), int(pid)) for t, s, w, _, pid in rows]

    def workers(self, agent: subprocess.Popen[bytes]) -> list[int]:
        """The agent's training processes: they run the script and write to a log file
        (standby workers also run it, but their output still goes to /dev/null)."""
        return [
            pid
            for pid in _descendants(agent.pid)
            if str(TRAIN) in _cmdline(pid)
            and "torch.distributed.run" not in _cmdline(pid)
            and not (self.standbys and _stdout(pid) == os.devnull)
        ]

    def stop(self) -> None:
        """Kill the agents and everything they started (torchrun's workers may outlive it)."""
        everything = [pid for agent in self.agents for pid in _descendants(agent.pid)]
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        for pid in everything:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for agent in self.agents:
            agent.wait()


def ours(zk: str, nodes: str, out: Path, prewarm: bool) -> Launch:
    run_id = uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    agents = [
        subprocess.Popen(
            [
                sys.executable, "-m", "hpc_elastic", "agent",
                f"--run-id={run_id}", f"--job-dir={out / 'job'}", f"--zk={zk}/bench",
                f"--nodes={nodes}", "--session-timeout=2", "--last-call=1", "--grace=3",
                f"--slot=a{index}", "--host=127.0.0.1", *(["--prewarm=torch"] if prewarm else []),
                "--", sys.executable, "-u", str(TRAIN), f"--out={out}", "--steps=100000",
            ],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for index in range(AGENTS)
    ]  # fmt: skip
    return Launch(agents, out, standbys=prewarm)


def torchrun(nodes: str, out: Path) -> Launch:
    port = _free_port()
    run_id = uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = []
    for _ in range(AGENTS):
        agents.append(
            subprocess.Popen(
                [
                    sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                    "--nproc-per-node=1", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
                    "--max-restarts=3", "--monitor-interval=0.1", "--local-addr=127.0.0.1",
                    str(TRAIN), f"--out={out}", "--steps=100000",
                ],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )  # fmt: skip
        time.sleep(0.3 if not agents[1:] else 0.0)
    return Launch(agents, out)


def _trained(launch: Launch, world: int = AGENTS) -> bool:
    """Training has run for ``SETTLE`` seconds at this world size, so standbys are warm."""
    rows = launch.progress()
    return bool(rows) and rows[-1][2] == world and time.time() - rows[0][0] > SETTLE


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def worker_kill(launch: Launch, give_up: float) -> float | None:
    """Seconds from a worker's SIGKILL to the first step of the restarted group (a new rank 0
    process: torchrun's restart count does not move on nodes whose own workers did not fail)."""
    if not _wait(lambda: _trained(launch), 120):
        return None
    victim = launch.workers(launch.agents[-1])[0]
    before = launch.progress()[-1][3]
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    if not _wait(lambda: launch.progress()[-1][3] != before, give_up):
        return None
    return next(t for t, _, _, pid in launch.progress() if t > killed and pid != before) - killed


def agent_kill(launch: Launch, give_up: float) -> float | None:
    """Seconds from an agent's SIGKILL to the first step at world size 3."""
    if not _wait(lambda: _trained(launch), 120):
        return None
    victim = launch.agents[-1]
    node = _descendants(victim.pid)
    killed = time.time()
    os.killpg(victim.pid, signal.SIGKILL)
    for pid in node:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not _wait(lambda: launch.progress()[-1][2] == 3, give_up):
        return None
    return next(t for t, _, w, _ in launch.progress() if t > killed and w == 3) - killed


def idle_cost(launch: Launch, seconds: float = 5.0) -> tuple[float, float]:
    """(CPU %, RSS MB) of one agent process while its worker trains."""
    _wait(lambda: len(launch.progress()) >= 10, 90)
    pid = launch.agents[1].pid
    first = _cpu_seconds(pid)
    time.sleep(seconds)
    cpu = (_cpu_seconds(pid) - first) / seconds * 100
    rss = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
    return cpu, rss


def measure(
    name: str,
    start: Callable[[Path], Launch],
    probe: Probe,
    give_up: float,
) -> float | None:
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        launch = start(Path(tmp))
        try:
            result = probe(launch, give_up)
        finally:
            launch.stop()
    print(f"  {name}: {'did not recover' if result is None else f'{result:.2f} s'}", flush=True)
    return result


def report(label: str, results: list[float | None]) -> str:
    done = [value for value in results if value is not None]
    median = f"{statistics.median(done):.1f} s" if done else "-"
    spread = f"{min(done):.1f}-{max(done):.1f} s" if done else "-"
    return f"| {label} | {median} | {spread} | {len(done)} of {len(results)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zk", default=os.environ.get("HPC_ELASTIC_ZK_HOSTS", "127.0.0.1:2181"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--node-repeats", type=int, default=10)
    parser.add_argument("--torchrun-node-repeats", type=int, default=3)
    parser.add_argument("--give-up", type=float, default=60.0)
    args = parser.parse_args()
    give_up = args.give_up

    def ours_fixed(out: Path) -> Launch:
        return ours(args.zk, "4", out, prewarm=False)

    def ours_fixed_warm(out: Path) -> Launch:
        return ours(args.zk, "4", out, prewarm=True)

    def ours_elastic_warm(out: Path) -> Launch:
        return ours(args.zk, "3:4", out, prewarm=True)

    def torchrun_fixed(out: Path) -> Launch:
        return torchrun("4", out)

    def torchrun_elastic(out: Path) -> Launch:
        return torchrun("3:4", out)

    plan: list[tuple[str, Callable[[Path], Launch], Probe, int]] = [
        ("hpc-elastic --prewarm torch: worker SIGKILL -> next step", ours_fixed_warm,
         worker_kill, args.repeats),
        ("hpc-elastic (cold workers): worker SIGKILL -> next step", ours_fixed, worker_kill,
         args.repeats),
        ("torchrun: worker SIGKILL -> next step", torchrun_fixed, worker_kill, args.repeats),
        ("hpc-elastic --prewarm torch: agent SIGKILL -> step at 3 nodes", ours_elastic_warm,
         agent_kill, args.node_repeats),
        ("torchrun: agent SIGKILL -> step at 3 nodes", torchrun_elastic, agent_kill,
         args.torchrun_node_repeats),
    ]  # fmt: skip
    rows = []
    for label, start, probe, repeats in plan:
        print(label, flush=True)
        results = [measure(f"try {n + 1}", start, probe, give_up) for n in range(repeats)]
        rows.append(report(label, results))
    for label, start in (
        ("hpc-elastic", ours_fixed),
        ("hpc-elastic --prewarm torch", ours_fixed_warm),
        ("torchrun", torchrun_fixed),
    ):
        with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
            launch = start(Path(tmp))
            try:
                cpu, rss = idle_cost(launch)
            finally:
                launch.stop()
        rows.append(f"| {label}: idle agent CPU / RSS | {cpu:.2f} % / {rss:.0f} MB | | |")
    print("| Measure | Median | Range | Recovered |")
    print("|---|---|---|---|")
    print("\n".join(rows))


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return found
    for child in map(int, children):
        found += [child, *_descendants(child)]
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _stdout(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


if __name__ == "__main__":
    main()
