"""A round's table as ZooKeeper keeps it: the bytes a newcomer reads, and the cost of packing.

Every agent new to a round reads its table whole, so a join storm of N agents (a full job
requeued) has the ensemble serve N tables of N records: O(N²) bytes, the largest cost of the
layout that grows faster than N. The ZooKeeper store keeps each 512 KB of a table compressed
on its own (``zookeeper.packed``). This builds tables of records as agents on a cluster make
them (ids of ``<slot>-<pid>-<hex>``, host names, link ports) and prints, for each N, the bytes
a member takes raw and as kept, the znodes, the time to pack (the proposer, once a round) and
to unpack (each connection new to the table), and what a join storm with a session an agent
would have the ensemble serve.

Usage: ``python bench/table_bytes.py [--sizes 1024,4096,12500,16384] [--level 6]``. Prints
one Markdown row a size.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpc_elastic.rendezvous import zookeeper
from hpc_elastic.rendezvous.api import NodeInfo
from hpc_elastic.rendezvous.state import encode_table


def records(members: int, seed: int = 7) -> tuple[NodeInfo, ...]:
    """Members as ``agent.command`` names them: ``<slot>-<pid>-<6 hex>``, on hosts named as
    on a typical cluster, each with a link port."""
    pick = random.Random(seed)
    return tuple(
        NodeInfo(
            f"{slot}-{pick.randrange(1_000, 4_000_000)}-{pick.randbytes(3).hex()}",
            f"gpu{slot // 1000:02d}-{slot % 1000:03d}.cluster.example.org",
            8,
            str(slot),
            pick.randrange(32_768, 60_999),
        )
        for slot in range(members)
    )


def best_of(times: int, action: Callable[[], object]) -> float:
    """The shortest of ``times`` runs: the cost without the machine's noise."""
    spent = []
    for _ in range(times):
        began = time.perf_counter()
        action()
        spent.append(time.perf_counter() - began)
    return min(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,12500,16384")
    parser.add_argument("--level", type=int, default=zookeeper.TABLE_LEVEL)
    args = parser.parse_args()
    print(
        "| members | raw a member | kept a member | znodes | pack | unpack "
        "| a join storm serves (a session an agent), raw → kept | load |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for members in (int(size) for size in args.sizes.split(",")):
        table = encode_table(records(members))
        chunks = zookeeper.packed(table, args.level)
        assert zookeeper.unpacked(chunks) == table
        kept = sum(map(len, chunks))
        pack = best_of(3, partial(zookeeper.packed, table, args.level))
        unpack = best_of(3, partial(zookeeper.unpacked, chunks))
        print(
            f"| {members:,} | {len(table) / members:.0f} B | {kept / members:.1f} B "
            f"| {len(chunks)} | {pack * 1e3:.1f} ms | {unpack * 1e3:.1f} ms "
            f"| {members * len(table) / 1e9:.2f} GB → {members * kept / 1e9:.2f} GB "
            f"| {os.getloadavg()[0]:.1f} |"
        )


if __name__ == "__main__":
    main()
