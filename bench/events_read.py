"""Reading a large job's events file: what the readers that want a few kinds pay for it.

Every agent appends to the job's one ``events.jsonl`` every round (a ``round``, a ``start``, a
``restart`` line at least), so the file of a job of N nodes grows by about 3·N lines a round.
The restart breaker reads it as a worker fails, on the way to the failure's report; the held
tasks' breaker, a drain's wait for a checkpoint and the metrics' checkpoint age read it too.
Each wants a kind or two (checkpoints, failures). This writes a file as N agents would over R
rounds (rank 0's checkpoint and one failure a round among them), then times the breaker's read
of it: every line decoded, and only the lines of the kinds it reads (``events.read``'s
``kinds``), which must give the same history.

Usage: ``python bench/events_read.py --agents 4096 --rounds 50``. Prints one Markdown row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpc_elastic.agent import watchdog
from hpc_elastic.events import Event, Kind, read


def lines(agents: int, rounds: int) -> list[str]:
    """What ``agents`` agents append over ``rounds`` rounds, as ``events.append`` writes it."""
    out = []
    started = time.time()
    for number in range(1, rounds + 1):
        at = started + number
        for slot in range(agents):
            writer = {"node_id": f"node{slot:05d}-4242-a1b2c3", "phase": "running"}
            for kind, details in (
                (Kind.ROUND, {"world_size": 8 * agents, "members": [str(i) for i in range(32)],
                              "restarts_used": 1, "member_count": agents}),
                (Kind.START, {"ranks": list(range(8 * slot, 8 * slot + 8))}),
                (Kind.RESTART, {"reason": "a member left"}),
            ):  # fmt: skip
                event = Event(
                    kind, "job", str(slot), round=number, details={**writer, **details}, time=at
                )
                out.append(json.dumps(asdict(event), sort_keys=True, default=str))
        for kind, details in (
            (Kind.CHECKPOINT, {"step": 100 * number, "path": f"/ckpt/{100 * number}"}),
            (Kind.FAILURE, {"rank": 3, "exit_code": 1, "message": "Traceback ..."}),
        ):
            event = Event(kind, "job", "0", round=number, details=details, time=at + 0.5)
            out.append(json.dumps(asdict(event), sort_keys=True, default=str))
    return out


def timed(path: Path, kinds: frozenset[Kind] | None) -> tuple[float, list[int | None]]:
    began = time.perf_counter()
    history = watchdog.checkpoints_at_restarts(read(path, kinds))
    return time.perf_counter() - began, history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "events.jsonl"
        written = lines(args.agents, args.rounds)
        path.write_text("\n".join(written) + "\n")
        size = os.path.getsize(path)
        every, history = timed(path, None)
        wanted, same = timed(path, watchdog.BREAKER_KINDS)
    assert same == history, "reading only the breaker's kinds changed its history"
    load = os.getloadavg()[0]
    print(
        "| agents | rounds | lines | file | every line decoded | the breaker's kinds only | load |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.agents:,} | {args.rounds} | {len(written):,} | {size / 1e6:.0f} MB "
        f"| {every:.2f} s | {wanted:.3f} s | {load:.1f} |"
    )


if __name__ == "__main__":
    main()
