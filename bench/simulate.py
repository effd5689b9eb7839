"""Run many simulated schedules in parallel: ``python bench/simulate.py --schedules 1000000``.

Each schedule is one seed of ``hpc_elastic.simulation`` (the real rendezvous and agent rules
in a simulated world, see docs/reliability.md); a violated property prints the one command
that replays it. The result for docs/reliability.md comes from this script.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpc_elastic.simulation.world import Report, run_many

CHUNK = 5000


def _chunk_of(chunk: tuple[int, int]) -> Report:
    first, count = chunk
    return run_many(first, count)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    starts = range(args.seed, args.seed + args.schedules, CHUNK)
    chunks = [(start, min(CHUNK, args.seed + args.schedules - start)) for start in starts]
    began = time.monotonic()
    total = Report(args.seed, args.schedules)
    with multiprocessing.Pool(args.jobs) as pool:
        # Unordered, with a line per chunk on stderr: a run of an hour shows where it is, and
        # a stopped run still says how many schedules passed.
        done = 0
        for report in pool.imap_unordered(_chunk_of, chunks):
            done += report.schedules
            total.merge(report)
            for failure in report.failures:  # at once: an hour-long run shows its seeds early
                print(failure.summary(), file=sys.stderr, flush=True)
            print(
                f"{done} schedules, {len(total.failures)} violations, "
                f"{time.monotonic() - began:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    elapsed = time.monotonic() - began
    print(total.summary())
    print(f"{args.schedules} schedules in {elapsed:.1f} s on {args.jobs} processes")
    return 1 if total.failures else 0


if __name__ == "__main__":
    sys.exit(main())
