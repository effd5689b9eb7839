"""Rendezvous benchmark: hpc-elastic's ZooKeeper rendezvous next to torchrun's c10d one.

Same run, same machine, protocol only (no workers are started). Measures
  * round latency for N real agent processes (a tiny driver that only does the rendezvous)
    and for N simulated agents in one process (ours: many handlers over a few ZooKeeper
    connections; torch's: many DynamicRendezvousHandlers over one TCPStore); ours also with
    the N handlers spread over 16 processes of one connection each, as real agents are
    spread over processes, so that one GIL does not starve every connection;
  * time from an agent's SIGKILL until every survivor knows it is gone;
  * time from a new agent's arrival until the next round is complete everywhere.

Usage: ``python bench/rendezvous_bench.py [--quick]``; prints a Markdown table.
``--ours N`` instead times only our simulated round of N agents, ``--repeats`` times;
``--ours-scenarios`` only our kill-detection and join figures.
The script re-invokes itself as ``... driver <json>`` for each agent process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpc_elastic.rendezvous import testing  # noqa: E402
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings  # noqa: E402
from hpc_elastic.rendezvous.handler import StoreRendezvous  # noqa: E402
from hpc_elastic.rendezvous.zookeeper import (  # noqa: E402
    ZooKeeperAddress,
    ZooKeeperStore,
    connect,
    open_client,
)
from hpc_elastic.spec import NodeRange  # noqa: E402

SESSION = 2.0
"""Session timeout used for the detection figure (our default is 6 s; see docs/rendezvous.md)."""
LAST_CALL = 2.0


# ---------------------------------------------------------------- agent drivers (subprocesses)


def until(t0: float) -> None:
    time.sleep(max(0.0, t0 - time.time()))


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def zk_driver(job: dict[str, Any]) -> None:
    """One of our agents: join at ``t0``, then follow the scenario."""
    nodes = NodeRange(job["min"], job["max"])
    settings = RendezvousSettings(
        run_id=job["run_id"], nodes=nodes, last_call=LAST_CALL, session_timeout=SESSION
    )
    node = NodeInfo(f"agent-{job['index']}", "127.0.0.1", 1)
    agent = connect(job["endpoint"], settings, node, open_acl=True)
    until(job["t0"])
    arrived = time.time()
    agent.next_round()
    say(arrived=arrived, done=time.time())
    if job["scenario"] in ("kill", "join"):
        agent.changed.wait()
        say(noticed=time.time())
        if job["scenario"] == "join":
            agent.next_round()
            say(done=time.time())
    time.sleep(3600)


def zk_many_driver(job: dict[str, Any]) -> None:
    """``job["handlers"]`` of our agents in one process, over one connection: together, the
    drivers of one measurement simulate N agents without putting them all behind one GIL."""
    address = ZooKeeperAddress.parse(job["endpoint"])
    store = ZooKeeperStore(open_client(address, None, 10.0), address, job["run_id"], None)
    settings = RendezvousSettings(
        run_id=job["run_id"], nodes=NodeRange(job["min"], job["max"]), session_timeout=10.0
    )
    handlers = [
        StoreRendezvous(
            settings,
            NodeInfo(f"sim-{job['index']}-{i}", "127.0.0.1", 1),
            store,
            owns_store=False,
        )
        for i in range(job["handlers"])
    ]
    until(job["t0"])
    with ThreadPoolExecutor(len(handlers)) as pool:
        list(pool.map(lambda handler: handler.next_round(), handlers))
    say(done=time.time())
    time.sleep(3600)


def c10d_handler(job: dict[str, Any]) -> Any:
    """Imports torch here, so that our own drivers never pay for it."""
    from torch.distributed import TCPStore  # noqa: PLC0415
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (  # noqa: PLC0415
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: PLC0415
        DynamicRendezvousHandler,
    )

    store = TCPStore("127.0.0.1", job["port"], is_master=False, use_libuv=True)
    backend = C10dRendezvousBackend(store, job["run_id"])
    return DynamicRendezvousHandler.from_backend(
        job["run_id"], store, backend, job["min"], job["max"], local_addr="127.0.0.1"
    )


def c10d_driver(job: dict[str, Any]) -> None:
    """One torchrun agent's rendezvous, as torchrun 2.13 drives it (defaults untouched)."""
    handler = c10d_handler(job)
    until(job["t0"])
    arrived = time.time()
    info = handler.next_rendezvous()
    say(arrived=arrived, done=time.time())
    if job["scenario"] == "kill":
        # torch never tells survivors; the dead node leaves the state once its heartbeats
        # are overdue, which survivors see when they sync (as num_nodes_waiting does).
        while True:
            handler.num_nodes_waiting()
            if len(handler._state_holder.state.participants) < info.world_size:
                say(noticed=time.time())
                break
            time.sleep(0.1)
    if job["scenario"] == "join":
        while handler.num_nodes_waiting() == 0:  # torchrun's monitor loop
            time.sleep(0.1)
        say(noticed=time.time())
        handler.next_rendezvous()
        say(done=time.time())
    time.sleep(3600)


# ---------------------------------------------------------------------------- orchestration


class Agents:
    """Driver processes of one measurement; their JSON lines are collected per process."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[str]] = []
        self.lines: list[list[dict[str, Any]]] = []
        self._threads: list[threading.Thread] = []

    def start(self, job: dict[str, Any]) -> int:
        process = subprocess.Popen(
            [sys.executable, __file__, "driver", json.dumps(job)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        lines: list[dict[str, Any]] = []
        self.processes.append(process)
        self.lines.append(lines)
        reader = threading.Thread(target=self._read, args=(process, lines), daemon=True)
        reader.start()
        self._threads.append(reader)
        return len(self.processes) - 1

    @staticmethod
    def _read(process: subprocess.Popen[str], lines: list[dict[str, Any]]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("{"):
                lines.append(json.loads(line))

    def launch(self, count: int, **job: Any) -> dict[str, Any]:
        """Start ``count`` drivers of one job, told to begin together once all have imported."""
        job["t0"] = time.time() + import_lead(count)
        for index in range(count):
            self.start({**job, "index": index})
        return job

    def wait_for(self, count: int, which: list[int], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while any(len(self.lines[i]) < count for i in which):
            if time.monotonic() > deadline:
                raise TimeoutError(f"agents {which} did not report {count} lines")
            time.sleep(0.02)

    def kill(self, index: int) -> float:
        killed = time.time()
        self.processes[index].send_signal(signal.SIGKILL)
        return killed

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def import_lead(n: int) -> float:
    """Seconds to give N drivers to start (torch's import alone takes ~2 s a process)."""
    return 4.0 + 1.2 * n


def real_round(backend: str, n: int, endpoint: str, port: int, run_id: str) -> float:
    agents = Agents()
    try:
        agents.launch(
            n,
            backend=backend,
            endpoint=endpoint,
            port=port,
            run_id=run_id,
            min=n,
            max=n,
            scenario="round",
        )
        agents.wait_for(1, list(range(n)))
        # From the last arrival, so a driver slow to import torch does not count.
        last_arrival = max(lines[0]["arrived"] for lines in agents.lines)
        return float(max(lines[0]["done"] for lines in agents.lines) - last_arrival)
    finally:
        agents.stop()


def kill_detection(backend: str, endpoint: str, port: int, run_id: str, n: int = 4) -> float:
    agents = Agents()
    try:
        agents.launch(
            n,
            backend=backend,
            endpoint=endpoint,
            port=port,
            run_id=run_id,
            min=1,
            max=n,
            scenario="kill",
        )
        agents.wait_for(1, list(range(n)))
        time.sleep(1.0)
        killed = agents.kill(n - 1)
        survivors = list(range(n - 1))
        agents.wait_for(2, survivors, timeout=120)
        return float(max(agents.lines[i][1]["noticed"] for i in survivors)) - killed
    finally:
        agents.stop()


def join_to_round(backend: str, endpoint: str, port: int, run_id: str, n: int = 2) -> float:
    agents = Agents()
    try:
        job = agents.launch(
            n,
            backend=backend,
            endpoint=endpoint,
            port=port,
            run_id=run_id,
            min=1,
            max=4,
            scenario="join",
        )
        agents.wait_for(1, list(range(n)))
        late = agents.start({**job, "index": n, "t0": time.time() + import_lead(1)})
        agents.wait_for(1, [late], timeout=300)
        agents.wait_for(3, list(range(n)), timeout=300)
        arrived = float(agents.lines[late][0]["arrived"])
        done = max(agents.lines[i][2]["done"] for i in range(n))
        return float(max(done, agents.lines[late][0]["done"])) - arrived
    finally:
        agents.stop()


def simulated_zk(n: int, hosts: str, run_id: str) -> float:
    """N of our handlers in one process, multiplexed over a few ZooKeeper connections."""
    address = ZooKeeperAddress.parse(hosts)
    stores = [
        ZooKeeperStore(open_client(address, None, 10.0), address, run_id, None)
        for _ in range(min(16, n))
    ]
    settings = RendezvousSettings(run_id=run_id, nodes=NodeRange(n, n), session_timeout=10.0)
    handlers = [
        StoreRendezvous(
            settings,
            NodeInfo(f"sim-{i}", "127.0.0.1", 1),
            stores[i % len(stores)],
            owns_store=False,
        )
        for i in range(n)
    ]
    try:
        return timed_in_threads([h.next_round for h in handlers])
    finally:
        for handler in handlers:
            handler.leave()
        for store in stores:
            store.release()


def simulated_zk_processes(n: int, hosts: str, run_id: str, processes: int = 16) -> float:
    """N of our handlers spread over ``processes`` driver processes, one connection each;
    timed from the common start until the last driver has its round."""
    agents = Agents()
    try:
        job = agents.launch(
            processes,
            backend="zk-many",
            endpoint=hosts,
            run_id=run_id,
            min=n,
            max=n,
            handlers=n // processes,
        )
        agents.wait_for(1, list(range(processes)), timeout=300)
        return max(float(lines[0]["done"]) for lines in agents.lines) - float(job["t0"])
    finally:
        agents.stop()


def simulated_c10d(n: int, port: int, run_id: str, limit: float) -> float | None:
    """N torch handlers in one process, each with its own TCPStore client."""
    job = {"port": port, "run_id": run_id, "min": n, "max": n}
    handlers = [c10d_handler(job) for _ in range(n)]
    try:
        return timed_in_threads([h.next_rendezvous for h in handlers], limit)
    except TimeoutError:
        return None


def timed_in_threads(calls: list[Callable[[], Any]], limit: float = 600) -> float:
    barrier = threading.Barrier(len(calls) + 1)

    def run(call: Callable[[], Any]) -> float:
        barrier.wait()
        call()
        return time.monotonic()

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(run, call) for call in calls]
        barrier.wait()
        started = time.monotonic()
        return max(future.result(timeout=limit) for future in futures) - started


def ours_only(n: int | None, repeats: int) -> None:
    """Our side alone: the simulated round of ``n`` agents, or (None) the kill and join."""
    measures: list[tuple[str, Callable[[str, str], float]]] = (
        [
            (f"round, {n} simulated agents, one process", partial(simulated_zk, n)),
            (f"round, {n} simulated agents, 16 processes", partial(simulated_zk_processes, n)),
        ]
        if n
        else [
            (
                "SIGKILL of 1 of 4 agents -> all survivors know",
                lambda hosts, run: kill_detection("zk", hosts, 0, run),
            ),
            (
                "3rd agent arrives -> next round complete (1:4)",
                lambda hosts, run: join_to_round("zk", hosts, 0, run),
            ),
        ]
    )
    with tempfile.TemporaryDirectory() as scratch:
        server = testing.ZooKeeperServer(Path(scratch) / "zk")
        server.start()
        try:
            for label, measure in measures:
                took = sorted(measure(server.hosts, f"ours-{i}") for i in range(repeats))
                shown = ", ".join(f"{t:.2f}" for t in took)
                print(f"{label}: median {took[len(took) // 2]:.2f} s ({shown} s)", flush=True)
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 2, 4 and 64 only")
    parser.add_argument("--ours", type=int, help="only our simulated round of this many agents")
    parser.add_argument("--ours-scenarios", action="store_true", help="only our kill and join")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each --ours* measure")
    args = parser.parse_args()
    if args.ours or args.ours_scenarios:
        ours_only(args.ours, args.repeats)
        return
    from torch.distributed import TCPStore  # noqa: PLC0415

    real_sizes = [2, 4] if args.quick else [2, 4, 8, 16]
    simulated_sizes = [64] if args.quick else [64, 256, 1024]
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as scratch:
        server = testing.ZooKeeperServer(Path(scratch) / "zk")
        server.start()
        (port,) = testing.free_ports(1)
        master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True)
        try:
            for n in real_sizes:
                ours = real_round("zk", n, server.hosts, port, f"real-{n}")
                theirs = real_round("c10d", n, server.hosts, port, f"real-{n}")
                rows.append((f"round, {n} agent processes", f"{ours:.3f} s", f"{theirs:.3f} s"))
                print(rows[-1], flush=True)
            for n in simulated_sizes:
                ours = simulated_zk(n, server.hosts, f"sim-{n}")
                torch_time = simulated_c10d(n, port, f"sim-{n}", limit=120)
                shown = "no round within 120 s" if torch_time is None else f"{torch_time:.3f} s"
                rows.append((f"round, {n} simulated agents", f"{ours:.3f} s", shown))
                print(rows[-1], flush=True)
                spread = simulated_zk_processes(n, server.hosts, f"sim16-{n}")
                label = f"round, {n} simulated agents in 16 processes"
                rows.append((label, f"{spread:.3f} s", "-"))
                print(rows[-1], flush=True)
            for label, measure, run_id, note in (
                (
                    "SIGKILL of 1 of 4 agents -> all survivors know",
                    kill_detection,
                    "kill",
                    f"session {SESSION:g} s",
                ),
                (
                    "3rd agent arrives -> next round complete (1:4)",
                    join_to_round,
                    "join",
                    f"last call {LAST_CALL:g} s",
                ),
            ):
                ours = measure("zk", server.hosts, port, run_id)
                theirs = measure("c10d", server.hosts, port, run_id)
                rows.append((label, f"{ours:.2f} s ({note})", f"{theirs:.2f} s"))
                print(rows[-1], flush=True)
        finally:
            del master
            server.stop()
    print("\n| Measurement | hpc-elastic (ZooKeeper) | torchrun c10d |\n|---|---|---|")
    for row in rows:
        print(f"| {' | '.join(row)} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "driver":
        job = json.loads(sys.argv[2])
        drivers = {"zk": zk_driver, "zk-many": zk_many_driver, "c10d": c10d_driver}
        drivers[job["backend"]](job)
    else:
        main()
