"""Mutation testing of the decision core: ``scripts/mutation-test`` (docs/reliability.md).

Each planted bug of ``bench/mutants.toml`` (a file, an original snippet, its replacement, a
description) is applied alone in a copy of the repository under /tmp, never in the working
tree, which other people test in. For each, two stages run in that copy:

* **tests**: the fast test files that cover the decision core (``TEST_FILES``, the
  20,000-schedule simulation left out), stopping at the first failure;
* **simulation**: the simulation alone, seeds 0, 1, ... until the first schedule that
  violates a property (``--seeds``, 5,000 at most by default): the pinned outcome counts
  play no part.

A stage that fails, crashes or runs out of time kills the mutant. The report gives each
mutant's verdict per stage (with the test or the seed that killed it) and the two scores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MUTANTS = REPO / "bench" / "mutants.toml"
TEST_FILES = (
    "tests/rendezvous/test_rendezvous_state.py",
    "tests/rendezvous/test_rendezvous_handler.py",
    "tests/rendezvous/test_rendezvous_tables.py",
    "tests/rendezvous/test_rendezvous_once.py",
    "tests/agent/test_watchdog.py",
    "tests/agent/test_agent_rules.py",
    "tests/simulation/test_simulation.py",
    "tests/agent/test_agent.py",
)
"""Fastest first: the run stops at the first failure."""
LEFT_OUT = (
    "tests/simulation/test_simulation.py::test_every_property_holds_on_twenty_thousand_schedules"
)
"""The 20,000-schedule run (a minute or more); its first 2,000 seeds are pinned by a test of
their own, which stays in."""
PINNED = "tests/simulation/test_simulation.py::test_the_outcomes_of_the_first_seeds_are_pinned"
"""Run after the others: a behaviour change that no other test judges is killed by it."""
SEEDS = 5000
"""A quarter of the simulation's run in CI, so that a whole run takes about an hour and a
half on 2 busy cores (a surviving mutant runs every seed); ``--seeds 20000`` runs CI's."""
TESTS_TIMEOUT = 900.0
SIMULATION_TIMEOUT = 600.0
PER_TEST_TIMEOUT = "120"
"""pytest-timeout for one test under a mutant (the slowest takes about 10 s unmutated)."""

PROFILE_PLUGIN = "_mutation_profile"
PROFILE = """
from hypothesis import settings
# Written into the copy only: the same examples for every mutant, and no deadline, which a
# loaded machine (two mutants at once beside other work) would miss with healthy code.
settings.register_profile("mutation", derandomize=True, deadline=None, database=None)
settings.load_profile("mutation")
"""
SIMULATION_STAGE = """
import logging, sys
from hpc_elastic.simulation.world import simulate
logging.disable(logging.WARNING)
for seed in range({seeds}):
    result = simulate(seed)
    if result.violation is not None:
        print(f"seed {{seed}}: {{result.violation}}")
        sys.exit(1)
print("no violation")
"""


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    description: str


@dataclass
class Verdict:
    """One stage's answer for one mutant: killed or not, by what, in how long."""

    killed: bool
    by: str
    seconds: float


@dataclass
class Outcome:
    mutant: Mutant
    tests: Verdict | None = None
    simulation: Verdict | None = None


def load(path: Path = MUTANTS) -> list[Mutant]:
    raw = tomllib.loads(path.read_text())
    mutants = [Mutant(**entry) for entry in raw["mutant"]]
    ids = [mutant.id for mutant in mutants]
    duplicated = sorted({name for name in ids if ids.count(name) > 1})
    if duplicated:
        raise SystemExit(f"error: mutant ids {duplicated} appear twice in {path}; rename them.")
    return mutants


def stale(mutants: list[Mutant], root: Path = REPO) -> list[str]:
    """Mutants whose original snippet is not in their file exactly once."""
    found = []
    for mutant in mutants:
        count = (root / mutant.file).read_text().count(mutant.original)
        if count != 1:
            found.append(f"{mutant.id}: its snippet is in {mutant.file} {count} times, not once")
    return found


def copy_repository(into: Path) -> Path:
    """The working tree's files (tracked, and untracked but not ignored) copied to ``into``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = REPO / os.fsdecode(name)
        if source.is_file():
            target = into / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    (into / f"{PROFILE_PLUGIN}.py").write_text(PROFILE)
    return into


STOPPING = threading.Event()
"""Set when the script ends early: the workers start nothing more."""
RUNNING: set[int] = set()
"""Process groups of the stages running now, ended with this script (``main``'s finally)."""


def run(command: list[str], copy: Path, timeout: float) -> tuple[int | None, str]:
    """Run in the copy, with the copy's package first on the path; None on a timeout. The
    stage runs in a process group of its own, ended whole on a timeout (a test's workers
    included) and when this script ends."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("HPC_ELASTIC_TEST_CLUSTER", None)
    if STOPPING.is_set():
        return None, ""
    with subprocess.Popen(
        command,
        cwd=copy,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as process:
        RUNNING.add(process.pid)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_group(process.pid)
            process.communicate()
            return None, ""
        finally:
            RUNNING.discard(process.pid)
    return process.returncode, output


def stop() -> None:
    """Start nothing more, and end every stage running now."""
    STOPPING.set()
    for pid in list(RUNNING):
        end_group(pid)


def end_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def tests_stage(copy: Path, timeout: float) -> Verdict:
    """The test files, then the pinned outcome counts alone, so that a mutant is named
    after a test that judges its behaviour when there is one, and after the pin only when
    nothing else saw it (docs/reliability.md counts those apart)."""
    began = time.monotonic()
    verdict = pytest_run(copy, timeout, ["--deselect", PINNED, *TEST_FILES])
    if not verdict.killed:
        verdict = pytest_run(copy, timeout - (time.monotonic() - began), [PINNED])
    verdict.seconds = time.monotonic() - began
    return verdict


def pytest_run(copy: Path, timeout: float, selected: list[str]) -> Verdict:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        f"timeout={PER_TEST_TIMEOUT}",
        "-p",
        PROFILE_PLUGIN,
        "-m",
        "not integration",
        "--deselect",
        LEFT_OUT,
        *selected,
    ]
    code, output = run(command, copy, max(timeout, 1.0))
    if code is None:
        return Verdict(True, f"timeout after {timeout:g} s", 0.0)
    if code == 0:
        return Verdict(False, "", 0.0)
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return Verdict(True, failed.group(1) if failed else f"pytest exit {code}", 0.0)


def simulation_stage(copy: Path, seeds: int, timeout: float) -> Verdict:
    began = time.monotonic()
    script = SIMULATION_STAGE.format(seeds=seeds)
    code, output = run([sys.executable, "-c", script], copy, timeout)
    seconds = time.monotonic() - began
    if code is None:
        return Verdict(True, f"timeout after {timeout:g} s", seconds)
    if code == 0:
        return Verdict(False, "", seconds)
    found = re.search(r"^seed \d+: .*$", output, re.MULTILINE)
    lines = output.strip().splitlines()
    return Verdict(
        True, found.group(0) if found else f"crash: {lines[-1] if lines else code}", seconds
    )


def apply(mutant: Mutant | None, copy: Path, pristine: dict[str, str]) -> None:
    """Put every mutated file back as it was, then plant ``mutant`` (None: none)."""
    for name, text in pristine.items():
        (copy / name).write_text(text)
    if mutant is not None:
        path = copy / mutant.file
        path.write_text(path.read_text().replace(mutant.original, mutant.replacement, 1))


def worker(
    mutants: list[Mutant], args: argparse.Namespace, say: Callable[[str], None]
) -> list[Outcome]:
    """Test ``mutants`` one after the other in one copy of the repository of their own."""
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="hpc-elastic-mutants-") as scratch:
        copy = copy_repository(Path(scratch))
        files = sorted({mutant.file for mutant in mutants})
        pristine = {name: (copy / name).read_text() for name in files}
        for mutant in mutants:
            if STOPPING.is_set():
                break
            apply(mutant, copy, pristine)
            outcome = Outcome(mutant)
            if args.stage in ("both", "tests"):
                outcome.tests = tests_stage(copy, args.tests_timeout)
            if args.stage in ("both", "simulation"):
                outcome.simulation = simulation_stage(copy, args.seeds, args.simulation_timeout)
            if STOPPING.is_set():
                break  # its stages were ended, not judged
            say(line(outcome))
            outcomes.append(outcome)
        apply(None, copy, pristine)
    return outcomes


def line(outcome: Outcome) -> str:
    def shown(verdict: Verdict | None) -> str:
        if verdict is None:
            return "-"
        return f"killed ({verdict.by})" if verdict.killed else "SURVIVED"

    return (
        f"{outcome.mutant.id}: tests {shown(outcome.tests)}; simulation {shown(outcome.simulation)}"
    )


def score(outcomes: list[Outcome], stage: str) -> tuple[int, int]:
    verdicts = [getattr(outcome, stage) for outcome in outcomes]
    judged = [verdict for verdict in verdicts if verdict is not None]
    return sum(verdict.killed for verdict in judged), len(judged)


def baseline(args: argparse.Namespace) -> None:
    """The stages must pass without any mutant, or every mutant would look killed."""
    with tempfile.TemporaryDirectory(prefix="hpc-elastic-mutants-") as scratch:
        copy = copy_repository(Path(scratch))
        if args.stage in ("both", "tests"):
            verdict = tests_stage(copy, args.tests_timeout)
            if verdict.killed:
                raise SystemExit(f"error: the tests fail without any mutant ({verdict.by}).")
        if args.stage in ("both", "simulation"):
            verdict = simulation_stage(copy, args.seeds, args.simulation_timeout)
            if verdict.killed:
                raise SystemExit(f"error: the simulation fails without any mutant ({verdict.by}).")


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/mutation-test", description=__doc__)
    parser.add_argument("--only", help="comma-separated mutant ids (default: every one)")
    parser.add_argument("--stage", choices=("both", "tests", "simulation"), default="both")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="simulation: seeds at most")
    parser.add_argument("--jobs", type=int, default=1, help="mutants tested at once")
    parser.add_argument("--tests-timeout", type=float, default=TESTS_TIMEOUT)
    parser.add_argument("--simulation-timeout", type=float, default=SIMULATION_TIMEOUT)
    parser.add_argument("--json", type=Path, help="also write every verdict to this file")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    return parser.parse_args(argv)


def chosen(only: str | None) -> list[Mutant]:
    """The mutants asked for, every one of them current (its snippet in its file once)."""
    mutants = load()
    if only:
        wanted = set(only.split(","))
        unknown = wanted - {mutant.id for mutant in mutants}
        if unknown:
            raise SystemExit(f"error: no mutant {sorted(unknown)} in {MUTANTS}.")
        mutants = [mutant for mutant in mutants if mutant.id in wanted]
    problems = stale(mutants)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        raise SystemExit(f"error: {len(problems)} mutants are stale; update {MUTANTS}.")
    return mutants


def report(outcomes: list[Outcome]) -> None:
    print()
    for stage in ("tests", "simulation"):
        killed, judged = score(outcomes, stage)
        if judged:
            survivors = [o.mutant.id for o in outcomes if not getattr(o, stage).killed]
            print(f"{stage}: {killed} of {judged} killed ({100 * killed / judged:.0f} %)")
            pinned = [o.mutant.id for o in outcomes if getattr(o, stage).by == PINNED]
            if pinned:
                print(f"  by the pinned outcome counts alone: {', '.join(pinned)}")
            print(f"  survived: {', '.join(survivors) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    mutants = chosen(args.only)
    began = time.monotonic()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if not args.no_baseline:
        try:
            baseline(args)
        finally:
            stop()
        STOPPING.clear()

    def say(text: str) -> None:
        print(text, flush=True)

    jobs = max(1, min(args.jobs, len(mutants)))
    shares = [mutants[index::jobs] for index in range(jobs)]
    with ThreadPoolExecutor(jobs) as pool:
        try:
            results = list(pool.map(lambda share: worker(share, args, say), shares))
        finally:  # on SIGTERM or ^C too: no stage outlives this script
            stop()
    outcomes = sorted((o for part in results for o in part), key=lambda o: mutants.index(o.mutant))
    report(outcomes)
    print(f"{len(mutants)} mutants in {time.monotonic() - began:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(outcome) for outcome in outcomes], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
