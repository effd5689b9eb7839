"""The ZooKeeper side of the proposed scalable layout, alone: what a restart round of N agents
costs the ensemble when each agent writes one fenced mark and reads one small commit.

This is a probe of the design in docs/rendezvous.md ("A layout for thousands of nodes"), not
the product: no ``StoreRendezvous`` runs here, only the requests the design makes, so its
figures bound what the layout can reach; ``bench/rendezvous_scale.py`` measures the product.

Per round: every agent writes ``multi(check(commit, v), create(back/<r>/<id>, ephemeral))``
at once; one proposer, watching ``back/<r>``, writes the next commit (~300 bytes: round,
count, digest, port) and the round's table (the ids in rank order) in one multi once all N
marks are there, then deletes the round before's marks and table; every session watches
``commit`` and the round ends for its agents when it reads the new version. Agents share
sessions as in ``rendezvous_scale`` (``--share``).

Usage: ``python bench/layout_probe.py --sizes 1024,4096 --servers 1,3 [--rounds 5] [--warm-up
W]``; ``--warm-up`` runs W rounds first and leaves them out, so that the servers' JIT has
compiled their hot paths, as on an ensemble that has served for a while.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rendezvous_scale import (
    SHARE_ABOVE,
    ServersCPU,
    Traffic,
    percentile,
    say,
    until,
    zookeeper,
)

from hpc_elastic.rendezvous import testing
from hpc_elastic.rendezvous.zookeeper import ZooKeeperAddress, open_client

ROOT = "/probe"
RECORD = json.dumps({"host": "127.0.0.1", "link_port": 0, "nproc": 1, "slot": ""}).encode()
"""About the size of an agent's member record (its node id is the znode's name)."""


def commit_data(round_number: int, ids: list[str]) -> bytes:
    digest = hashlib.sha256(",".join(ids).encode()).hexdigest()
    fields = {"round": round_number, "count": len(ids), "digest": digest, "port": 29500}
    return json.dumps({**fields, "restarts": [round_number, 1000], "failure": None}).encode()


def probe_driver(job: dict[str, Any]) -> None:
    """Agents ``first .. first+agents-1`` over sessions of ``share``; driver 0 also proposes."""
    traffic = Traffic()
    traffic.install()
    address = ZooKeeperAddress.parse(job["hosts"])
    ids = [f"agent-{job['first'] + i:05d}" for i in range(job["agents"])]
    clients = [
        open_client(address, None, 6.0, connect_timeout=120.0)
        for _ in range(math.ceil(len(ids) / job["share"]))
    ]
    by_client = [ids[i * job["share"] : (i + 1) * job["share"]] for i in range(len(clients))]
    for client, mine in zip(clients, by_client, strict=True):
        for result in [
            client.create_async(f"{ROOT}/members/{node}", RECORD, ephemeral=True) for node in mine
        ]:
            result.get()
    say(ready=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "stop":
            break
        before = traffic.snapshot()
        seen = Seen(clients, command["version"])
        until(command["at"])
        pending = []
        for client, mine in zip(clients, by_client, strict=True):
            for node in mine:
                transaction = client.transaction()
                transaction.check(f"{ROOT}/commit", command["version"])
                transaction.create(f"{ROOT}/back/{command['k']}/{node}", b"", ephemeral=True)
                pending.append(transaction.commit_async())
        refused = sum(
            any(isinstance(r, Exception) for r in result.get(timeout=300)) for result in pending
        )
        if command["propose"]:
            propose(clients[0], command)
            forget(clients[0], command["k"] - 1)
        last = seen.wait(300)
        traffic_used = traffic.snapshot()
        traffic_used.subtract(before)
        say(k=command["k"], last=last, refused=refused, traffic=dict(traffic_used))


class Seen:
    """When each session first reads a commit newer than ``version`` (its data watch)."""

    def __init__(self, clients: list[Any], version: int) -> None:
        self._times: list[float | None] = [None] * len(clients)
        self._done = threading.Event()
        self._lock = threading.Lock()
        for index, client in enumerate(clients):
            self._watch(client, index, version)

    def _watch(self, client: Any, index: int, version: int) -> None:
        def on_event(_: Any) -> None:
            if self._times[index] is None:  # a session that has seen the commit reads no more
                self._watch(client, index, version)

        _, stat = client.get(f"{ROOT}/commit", watch=on_event)
        if stat.version > version:
            with self._lock:
                if self._times[index] is None:
                    self._times[index] = time.time()
                if all(t is not None for t in self._times):
                    self._done.set()

    def wait(self, timeout: float) -> float | None:
        if not self._done.wait(timeout):
            return None
        return max(t for t in self._times if t is not None)


def propose(client: Any, command: dict[str, Any]) -> None:
    """Wait until every mark of round ``k`` is there (one children watch, re-listed at each
    change), then write the commit and the round's table in one multi."""
    path, changed = f"{ROOT}/back/{command['k']}", threading.Event()
    while True:
        changed.clear()
        marks = client.get_children(path, watch=lambda _: changed.set())
        if len(marks) >= command["n"]:
            break
        changed.wait(5)
    order = sorted(marks)
    transaction = client.transaction()
    transaction.set_data(f"{ROOT}/commit", commit_data(command["k"], order), command["version"])
    transaction.create(f"{ROOT}/rounds/{command['k']}", ",".join(order).encode())
    transaction.commit()


def forget(client: Any, k: int) -> None:
    """Delete round ``k``'s marks and table once the next round is committed, as the
    product's proposer forgets the round before its own: a transaction a 2,000 of them."""
    path = f"{ROOT}/back/{k}"
    if k < 1 or not client.exists(path):
        return
    doomed = [*(f"{path}/{mark}" for mark in client.get_children(path)), path]
    doomed.append(f"{ROOT}/rounds/{k}")
    for start in range(0, len(doomed), 2000):
        transaction = client.transaction()
        for node in doomed[start : start + 2000]:
            transaction.delete(node)
        transaction.commit()


def one_round(procs: list[subprocess.Popen[str]], command: dict[str, Any]) -> list[Any]:
    """Send round ``command`` to every driver (the first proposes); their reports."""
    for index, proc in enumerate(procs):
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({**command, "propose": index == 0}) + "\n")
        proc.stdin.flush()
    reports = []
    for proc in procs:
        assert proc.stdout is not None
        reports.append(json.loads(proc.stdout.readline()))
    return reports


def start_drivers(hosts: str, n: int, share: int, drivers: int) -> list[subprocess.Popen[str]]:
    """``drivers`` driver processes holding ``n`` agents, ``share`` a session, once ready."""
    sessions = math.ceil(n / share)
    per = [math.ceil(sessions / drivers) * share] * drivers
    per[-1] = n - sum(per[:-1])
    procs = []
    first = 0
    for count in per:
        job = {"hosts": hosts, "first": first, "agents": count, "share": share}
        first += count
        proc = subprocess.Popen(
            [sys.executable, __file__, "driver", json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
    for proc in procs:
        assert proc.stdout is not None
        json.loads(proc.stdout.readline())  # ready
    return procs


def run(n: int, servers: int, share: int, rounds: int, processes: int, *, warm_up: int = 0) -> str:
    """The row of ``rounds`` rounds of ``n`` agents, after ``warm_up`` rounds left out of it
    (the servers' JIT compiling their hot paths: ``rendezvous_scale --warm-up``)."""
    with tempfile.TemporaryDirectory() as scratch, zookeeper(servers, Path(scratch)) as zk:
        hosts = ",".join(server.hosts for server in zk)
        setup = open_client(ZooKeeperAddress.parse(hosts), None, 10.0)
        for path in ("members", "back", "rounds"):
            setup.ensure_path(f"{ROOT}/{path}")
        setup.create(f"{ROOT}/commit", commit_data(0, []))
        sessions = math.ceil(n / share)
        procs = start_drivers(hosts, n, share, max(1, min(processes, sessions)))
        times, bytes_in, zk_cpu, zk_jit, leader_cpu = [], [], [], [], []
        pids = [server.process.pid for server in zk if server.process]
        modes = [testing.mode(server.port) for server in zk]
        leader = modes.index("leader") if "leader" in modes else 0
        try:
            for k in range(1, warm_up + rounds + 1):
                setup.ensure_path(f"{ROOT}/back/{k}")
                _, stat = setup.get(f"{ROOT}/commit")
                at = time.time() + 0.5
                cpu = ServersCPU(pids)
                command = {"do": "round", "k": k, "n": n, "at": at, "version": stat.version}
                reports = one_round(procs, command)
                spent, compiling = cpu.spent()
                leading = cpu.each()[leader]
                last = [r["last"] for r in reports]
                if None in last or any(r["refused"] for r in reports):
                    print(f"N={n} round {k}: incomplete {reports}", flush=True)
                    break
                kind = "warm-up" if k <= warm_up else "round"
                print(
                    f"N={n} servers={servers} {kind} {k}: {max(last) - at:.3f} s, ZooKeeper CPU "
                    f"{spent:.2f} s (JIT {compiling:.2f} s)",
                    flush=True,
                )
                if k <= warm_up:
                    continue
                zk_cpu.append(spent)
                zk_jit.append(compiling)
                leader_cpu.append(leading)
                times.append(max(last) - at)
                bytes_in.append(sum(r["traffic"].get("bytes_in", 0) for r in reports) / n)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            setup.stop()
            setup.close()
    if not times:
        return f"| {n} | {servers} | {sessions} | no round |"
    return (
        f"| {n} | {'standalone' if servers == 1 else f'{servers} servers'} | {sessions} "
        f"| {statistics.median(times):.2f} s | {percentile(times, 0.99):.2f} s "
        f"| {statistics.median(bytes_in):.0f} B | {statistics.mean(zk_cpu):.2f} s "
        f"| {statistics.mean(zk_jit):.2f} s | {statistics.mean(leader_cpu):.2f} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,16384")
    parser.add_argument("--servers", default="1,3")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--share", type=int)
    parser.add_argument(
        "--warm-up", type=int, default=0, help="rounds before the measured ones, left out"
    )
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"load average at the start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for servers in (int(s) for s in args.servers.split(",")):
            share = args.share or (16 if n > SHARE_ABOVE else 1)
            rows.append(run(n, servers, share, args.rounds, args.processes, warm_up=args.warm_up))
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(
        "| agents | ZooKeeper | sessions | round, median | round, p99 | read per agent | ZK CPU "
        "| of it, the JIT's | of it, the leader's (or the one server's) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "driver":
        probe_driver(json.loads(sys.argv[2]))
    else:
        main()
