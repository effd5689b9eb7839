"""A hang's evidence at scale: N nodes' notes on one topic, over C connections, on a real ZooKeeper.

When a job's ranks hang, every agent shares what it saw of its own (a note on the
investigation's topic, ``Rendezvous.share``), and the first member in the round's order
gathers them all and proposes the verdict. Each connection is the real ``ZooKeeperStore``; N
writes are spread over the C connections (64 threads), as N agents would share at about the
same moment.

  * the product: one connection follows the topic (``note_keys``), the one that proposes;
    every connection is told of the topic itself (one name under ``notes``);
  * ``--all-follow``: every connection follows the topic: what every connection did when
    each listed every note of the job after each burst of them.

Measured: the time from the first write until every follower is told of all N notes, then
the proposer's read of them all (``notes``); the bytes the connections read (counted in kazoo,
as ``rendezvous_scale.py`` does), in all and for a connection that does not follow; and
ZooKeeper's CPU and this process's. Usage::

    python bench/notes_scale.py --notes 4096 --connections 256
    python bench/notes_scale.py --notes 4096 --connections 256 --all-follow
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from rendezvous_scale import Traffic, cpu_seconds, zookeeper  # noqa: E402

from hpc_elastic.agent import hangs  # noqa: E402
from hpc_elastic.rendezvous.zookeeper import (  # noqa: E402
    ZooKeeperAddress,
    ZooKeeperStore,
    open_client,
)

SECRET = "bench-secret"
SESSION = 6.0
TOPIC = "hang-7-1.look"
WRITERS = 64
"""Threads writing the notes: N agents share theirs at about the same moment."""
RANKS = 8
"""Ranks a node: the evidence of eight GPUs' ranks, each waiting in a collective."""


def evidence(node_id: str) -> bytes:
    """A node's note as the agent writes it: the real ``NodeEvidence`` of eight waiting ranks."""
    ranks = tuple(
        hangs.RankEvidence(
            rank,
            state="S",
            age=61.0,
            waited=61.2,
            deadline=60.0,
            wchan="futex_wait_queue",
            marker="in all_reduce #1207",
            inside=True,
        )
        for rank in range(RANKS)
    )
    return hangs.NodeEvidence(node_id, f"slot-{node_id}", ranks, 1, None).encode()


def wait_for(condition: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run(notes: int, connections: int, all_follow: bool, servers: int) -> dict[str, object]:
    traffic = Traffic()
    traffic.install()
    with (
        tempfile.TemporaryDirectory(prefix="notes-scale-") as scratch,
        zookeeper(servers, Path(scratch)) as made,
    ):
        hosts = ",".join(server.hosts for server in made)
        address = ZooKeeperAddress.parse(f"{hosts}/notes-scale")
        stores = [
            ZooKeeperStore(open_client(address, SECRET, SESSION), address, "job", SECRET)
            for _ in range(connections)
        ]
        pids = [server.process.pid for server in made if server.process is not None]
        try:
            followers = stores if all_follow else stores[:1]
            return {
                "servers": servers,
                "followers": len(followers),
                **measure(traffic, stores, followers, notes, pids),
            }
        finally:
            for store in stores:
                store.release()


def measure(
    traffic: Traffic,
    stores: list[ZooKeeperStore],
    followers: list[ZooKeeperStore],
    notes: int,
    pids: list[int],
) -> dict[str, object]:
    """N notes written over the connections; every follower waited for until told of all."""
    for store in followers:
        store.note_keys(TOPIC)  # its first listing is made before it returns
    ids = [f"node{index:05d}-{os.getpid()}-{index * 7919 % 65536:04x}" for index in range(notes)]
    payloads = [evidence(node_id) for node_id in ids]
    wanted = frozenset(f"{TOPIC}@{node_id}" for node_id in ids)
    before, zk_before = traffic.snapshot(), sum(cpu_seconds(pid) for pid in pids)
    own_before, started = time.process_time(), time.monotonic()

    def write(index: int) -> None:
        stores[index % len(stores)].put_note(f"{TOPIC}@{ids[index]}", payloads[index])

    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(write, range(notes)))
    written = time.monotonic() - started
    told = wait_for(lambda: all(s.note_keys(TOPIC) == wanted for s in followers), 600)
    seen = time.monotonic() - started
    read_started = time.monotonic()
    gathered = stores[0].notes(TOPIC)
    read = time.monotonic() - read_started
    if not told or len(gathered) != notes:
        raise SystemExit(f"not every note arrived: told {told}, read {len(gathered)} of {notes}")
    wait_for(lambda: all(s.note_topics() == {TOPIC} for s in stores), 600)
    after = traffic.snapshot()
    bytes_in = after["bytes_in"] - before["bytes_in"]
    listings = sum(after[op] - before[op] for op in ("op:GetChildren", "op:GetChildren2"))
    return {
        "notes": notes,
        "connections": len(stores),
        "note_bytes": len(payloads[0]),
        "written_s": round(written, 2),
        "all_told_s": round(seen, 2),
        "proposer_read_s": round(read, 2),
        "bytes_in_total": bytes_in,
        "bytes_in_per_connection": bytes_in // len(stores),
        "children_listings": listings,
        "zookeeper_cpu_s": round(sum(cpu_seconds(pid) for pid in pids) - zk_before, 2),
        "clients_cpu_s": round(time.process_time() - own_before, 2),
    }


def row(result: dict[str, object], load: float) -> str:
    mib = 1024 * 1024
    return (
        f"| {result['notes']:,} notes of {result['note_bytes']} B, {result['connections']} "
        f"connections, {result['followers']} following (load {load:.1f}) "
        f"| {result['written_s']} s | {result['all_told_s']} s | {result['proposer_read_s']} s "
        f"| {int(result['bytes_in_total']) / mib:.1f} MiB "  # type: ignore[call-overload]
        f"| {result['children_listings']} | {result['zookeeper_cpu_s']} s "
        f"| {result['clients_cpu_s']} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notes", type=int, default=4096)
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--servers", type=int, choices=(1, 3), default=1)
    parser.add_argument("--all-follow", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    threading.stack_size(256 * 1024)
    load = os.getloadavg()[0]
    result = run(args.notes, args.connections, args.all_follow, args.servers)
    print(json.dumps(result))
    print(row(result, load))
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
