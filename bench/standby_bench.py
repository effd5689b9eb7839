"""Warm workers of examples/train.py: hand-over -> rank 0's first step, without a cluster.

The smallest reproduction of a prewarmed restart: ``--ranks`` standbys of
``examples/train.py`` start as the agent starts them (``standby_command`` through the PDEATHSIG
trampoline), the bench waits until every one has finished its imports and sits on its stdin,
then hands each its rank at once, as the agent does after a round forms, and times the hand-over
-> the first ``step=`` line of rank 0. Modes:

* ``torch``: the standbys import ``torch`` only (what ``--prewarm torch`` did before);
* ``warm``: they import ``warm_modules`` (``torch`` and what the script's calls import later);
* ``cold``: no standby, ``python examples/train.py`` started at the hand-over.

Each try trains from scratch in a fresh folder (no checkpoint to load), with a fresh port.

Usage::

    python bench/standby_bench.py [--ranks 2] [--repeats 3] [--mode torch --mode warm]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpc_elastic.agent.standby import hand_off, standby_command  # noqa: E402
from hpc_elastic.agent.workers import launch  # noqa: E402

TRAIN = REPO / "examples" / "train.py"
MODES = ("cold", "torch", "warm")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_idle(pids: list[int], quiet: float = 1.0, give_up: float = 300.0) -> None:
    """Until no standby has used CPU for ``quiet`` seconds: all imported, all reading stdin."""
    deadline = time.monotonic() + give_up
    last = {pid: -1 for pid in pids}
    since = time.monotonic()
    while time.monotonic() < deadline:
        now = {pid: cpu_ticks(pid) for pid in pids}
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.1)
    raise SystemExit("the standbys never went idle")


def wait_for(predicate: Callable[[], bool], start: float, give_up: float = 300.0) -> float:
    """Seconds from ``start`` until ``predicate`` holds (polled every 10 ms)."""
    while not predicate():
        if time.monotonic() - start > give_up:
            raise SystemExit("no first step")
        time.sleep(0.01)
    return time.monotonic() - start


def one_try(mode: str, ranks: int) -> float:
    """Seconds from the hand-over to rank 0's first step line."""
    with tempfile.TemporaryDirectory(prefix="standby-bench-") as folder:
        out = Path(folder)
        steps = out / "steps.log"
        command = [sys.executable, "-u", str(TRAIN), "--steps", "2", "--log-file", str(steps)]
        command += ["--checkpoint-dir", str(out / "ckpt")]
        base = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        port = free_port()

        def rank_env(rank: int) -> dict[str, str]:
            return base | {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }

        processes: list[subprocess.Popen[bytes]] = []
        if mode == "cold":
            start = time.monotonic()
            for rank in range(ranks):
                log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 - the child holds it
                processes.append(
                    launch(command, rank_env(rank), stdin=subprocess.DEVNULL, stdout=log)
                )
        else:
            argv = standby_command(command, ("torch",))
            assert argv is not None
            if mode == "torch":
                argv[argv.index("-c") + 2] = "torch"  # The modules argument, as it was.
            for _ in range(ranks):
                processes.append(
                    launch(argv, base, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
                )
            wait_idle([process.pid for process in processes])
            start = time.monotonic()
            for rank, process in enumerate(processes):
                assert hand_off(process, rank_env(rank), out / f"rank{rank}.log")
        elapsed = wait_for(lambda: steps.exists() and "step=1 " in steps.read_text(), start)
        for process in processes:
            process.wait(timeout=120)
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", action="append", choices=MODES)
    args = parser.parse_args()
    modes = args.mode or list(MODES)
    print(f"examples/train.py, {args.ranks} ranks, load {os.getloadavg()[0]:.1f}", flush=True)
    for mode in modes:
        tries = [one_try(mode, args.ranks) for _ in range(args.repeats)]
        cells = ", ".join(f"{value:.2f}" for value in tries)
        print(
            f"{mode:6} hand-over -> first step: median {statistics.median(tries):.2f} s ({cells})"
        )
    print(f"load after: {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
