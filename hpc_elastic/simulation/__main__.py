"""``python -m hpc_elastic.simulation --seed N [--trace]``: replay one schedule, or run many."""

from __future__ import annotations

import argparse
import sys

from hpc_elastic.simulation.world import Fault, run_many, shrink, simulate


def _faults(text: str) -> tuple[Fault, ...]:
    try:
        return tuple(Fault.parse(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"{error}; write faults as 'kind@seconds:slot', comma-separated"
        ) from error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_elastic.simulation")
    parser.add_argument("--seed", type=int, default=0, help="first (or only) schedule's seed")
    parser.add_argument("--schedules", type=int, default=1, help="how many seeds to run")
    parser.add_argument("--trace", action="store_true", help="print the schedule's trace")
    parser.add_argument(
        "--faults",
        type=_faults,
        help="run these faults instead of the seed's own: 'crash@12.5:1,preempt@40:0' "
        "(kind@seconds:slot; '' for none), as a shrunk schedule's replay command gives them",
    )
    parser.add_argument(
        "--no-shrink", action="store_true", help="report a violation without shrinking it"
    )
    args = parser.parse_args(argv)
    if args.schedules == 1:
        result = simulate(args.seed, args.faults)
        if args.trace or result.violation:
            print("\n".join(result.trace))
        print(result.summary())
        if result.violation and not args.no_shrink:
            print(f"shrunk: {shrink(result).summary()}")
        return 1 if result.violation else 0
    report = run_many(args.seed, args.schedules)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
