"""The per-step sample log: which samples each optimizer step trained on, and its check.

The training helpers write it when ``$HPC_ELASTIC_SAMPLE_LOG`` asks (``TrainState.log_samples``
collects a step's sample ids, ``finish_step`` writes them); ``hpc-elastic events JOB --data``
reads it and says whether any sample was trained twice, or never, in an epoch. Torch-free: the
CLI imports it.

One JSON line per optimizer step and rank, in one file per process
(``<job dir>/samples/<incarnation>-rank<R>-pid<P>.jsonl``), appended and flushed at every step:

    {"inc": 7, "step": 31, "epoch": 1, "pos": 6, "steps": 25, "batch": 24, "universe": 600,
     "world": 3, "rank": 2, "ids": [17, [40, 48]]}

``inc`` is the incarnation that trained the step: the agent's round (``$HPC_ELASTIC_ROUND``),
or, without an agent, rank 0's clock when the processes started logging; a later incarnation
has a larger one. ``pos`` is the step's place in its epoch, ``steps`` the epoch's steps,
``batch`` the global batch and ``universe`` the dataset's size, when the data says (an
``ElasticSampler`` or ``ElasticShards``); ``ids`` lists single ids and ``[first, end)`` runs.

**Steps trained again.** A restart resumes from the last checkpoint, so the steps after it are
trained again, by a new incarnation. The check keeps, for each step, what the *last*
incarnation that trained it logged: a record is void when a later incarnation started at or
before its step (it resumed from a checkpoint older than that step).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hpc_elastic import contract
from hpc_elastic.errors import DataError

SAMPLE_LOG_ENV = contract.SAMPLE_LOG_ENV
SHOWN = 10
"""Ids listed per problem; the count says how many more."""


@dataclass(frozen=True)
class Record:
    """One rank's samples of one optimizer step."""

    inc: int
    step: int
    world: int
    rank: int
    ids: tuple[int, ...]
    epoch: int | None = None
    pos: int | None = None
    steps: int | None = None
    batch: int | None = None
    universe: int | None = None

    def to_json(self) -> str:
        fields = {
            "inc": self.inc,
            "step": self.step,
            "epoch": self.epoch,
            "pos": self.pos,
            "steps": self.steps,
            "batch": self.batch,
            "universe": self.universe,
            "world": self.world,
            "rank": self.rank,
            "ids": runs(self.ids),
        }
        return json.dumps(fields, separators=(",", ":"))


def runs(ids: Iterable[int]) -> list[int | list[int]]:
    """``[3, 4, 5, 9]`` as ``[[3, 6], 9]``: token shards give long runs of consecutive ids."""
    found: list[int | list[int]] = []
    start = end = None
    for value in ids:
        if start is not None and end is not None and value == end:
            end += 1
            continue
        if start is not None and end is not None:
            found.append(start if end == start + 1 else [start, end])
        start, end = value, value + 1
    if start is not None and end is not None:
        found.append(start if end == start + 1 else [start, end])
    return found


def expand(encoded: Sequence[Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for item in encoded:
        if isinstance(item, list):
            ids.extend(range(int(item[0]), int(item[1])))
        else:
            ids.append(int(item))
    return tuple(ids)


def directory(environ: dict[str, str] | None = None) -> Path | None:
    """Where this process logs, from ``$HPC_ELASTIC_SAMPLE_LOG``: ``1`` the job directory's
    ``samples/``, a path that directory; unset (or ``0``) nowhere."""
    environ = dict(os.environ) if environ is None else environ
    value = environ.get(SAMPLE_LOG_ENV, "").strip()
    if value.lower() in ("", "0", "false", "no", "off"):
        return None
    if value.lower() not in ("1", "true", "yes", "on"):
        return Path(value)
    job_dir = environ.get(contract.JOB_DIR_ENV)
    if not job_dir:
        raise DataError(
            f"{SAMPLE_LOG_ENV}={value!r} logs into the job directory, but this process runs "
            f"outside a job; set {SAMPLE_LOG_ENV} to a directory instead."
        )
    return Path(job_dir) / contract.SAMPLES_DIR


class Writer:
    """Appends this process's records to its own file, one flushed line per step."""

    def __init__(self, where: Path, inc: int, rank: int) -> None:
        where.mkdir(parents=True, exist_ok=True)
        self.path = where / f"{inc}-rank{rank:05d}-pid{os.getpid()}.jsonl"
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, record: Record) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read(where: Path) -> list[Record]:
    """Every record under ``where``; a torn last line (a process killed mid-write) is skipped."""
    records: list[Record] = []
    for path in sorted(where.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            record = _parse(line)
            if record is not None:
                records.append(record)
    return records


def _parse(line: str) -> Record | None:
    try:
        raw = json.loads(line)
        return Record(
            inc=int(raw["inc"]),
            step=int(raw["step"]),
            world=int(raw["world"]),
            rank=int(raw["rank"]),
            ids=expand(raw["ids"]),
            epoch=_optional(raw.get("epoch")),
            pos=_optional(raw.get("pos")),
            steps=_optional(raw.get("steps")),
            batch=_optional(raw.get("batch")),
            universe=_optional(raw.get("universe")),
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


def _optional(value: Any) -> int | None:
    return None if value is None else int(value)


def kept(records: Sequence[Record]) -> list[Record]:
    """The records that count: those no later incarnation trained again (module docstring)."""
    first: dict[int, int] = {}
    for record in records:
        first[record.inc] = min(first.get(record.inc, record.step), record.step)
    return [
        record
        for record in records
        if not any(inc > record.inc and start <= record.step for inc, start in first.items())
    ]


@dataclass
class Epoch:
    """What the kept records say of one epoch (``None``: records without an epoch)."""

    number: int | None
    steps: dict[int, list[Record]] = field(default_factory=dict)
    """Global step -> its records."""

    def add(self, record: Record) -> None:
        self.steps.setdefault(record.step, []).append(record)

    def facts(self) -> tuple[int | None, int | None, int | None]:
        """The epoch's steps, global batch and dataset size, as its records say."""
        first = next(iter(self.steps.values()))[0]
        return first.steps, first.batch, first.universe


@dataclass(frozen=True)
class Report:
    lines: list[str]
    problems: int


def check(records: Sequence[Record]) -> Report:
    """Per epoch: was any sample trained twice, or never; were steps logged by every rank."""
    if not records:
        return Report(["No sample was logged yet."], 0)
    counted = kept(records)
    epochs: dict[int | None, Epoch] = {}
    for record in counted:
        epochs.setdefault(record.epoch, Epoch(record.epoch)).add(record)
    lines: list[str] = []
    problems = 0
    last = max(record.step for record in counted)
    for number in sorted(epochs, key=lambda e: -1 if e is None else e):
        found, trouble = _check_epoch(epochs[number], last)
        lines.extend(found)
        problems += trouble
    incarnations = len({record.inc for record in records})
    redone = len({(r.inc, r.step) for r in records}) - len({(r.inc, r.step) for r in counted})
    verdict = "No sample was trained twice or skipped" if not problems else f"{problems} problems"
    lines.append(
        f"{verdict}: steps {min(r.step for r in counted)}-{last} by {incarnations} "
        f"incarnations ({redone} steps trained again after a restart, their first records "
        f"set aside)."
    )
    return Report(lines, problems)


def _check_epoch(epoch: Epoch, last: int) -> tuple[list[str], int]:
    name = "Records without an epoch" if epoch.number is None else f"Epoch {epoch.number}"
    lines: list[str] = []
    problems = 0
    seen: dict[int, list[int]] = defaultdict(list)
    for step, records in sorted(epoch.steps.items()):
        world = records[0].world
        ranks = sorted(r.rank for r in records)
        if ranks != list(range(world)) and step != last:
            lines.append(f"{name}: step {step} was logged by ranks {ranks} of {world}.")
            problems += 1
        for record in records:
            for sample in record.ids:
                seen[sample].append(step)
    twice = {sample: steps for sample, steps in seen.items() if len(steps) > 1}
    if twice:
        shown = ", ".join(f"{s} (steps {_steps(twice[s])})" for s in sorted(twice)[:SHOWN])
        lines.append(f"{name}: {len(twice)} samples trained more than once: {shown}{_more(twice)}.")
        problems += 1
    steps, batch, universe = epoch.facts()
    positions = {r.pos for records in epoch.steps.values() for r in records}
    complete = steps is not None and positions >= set(range(steps))
    total = sum(len(steps) for steps in seen.values())
    if steps is None or batch is None or not complete:
        lines.append(f"{name}: {len(epoch.steps)} steps logged so far, {len(seen)} samples.")
        return lines, problems
    missing = steps * batch - len(seen)
    if missing:
        never = _never(seen, universe)
        lines.append(
            f"{name}: {missing} of its {steps * batch} samples were never trained"
            f"{never} (the dataset's last {(universe or 0) - steps * batch} samples are "
            f"left out of every epoch by design)."
        )
        problems += 1
    elif not twice:
        lines.append(f"{name}: {steps} steps, {total} samples, each trained once.")
    return lines, problems


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:4])) + (", ..." if len(steps) > 4 else "")


def _more(found: dict[int, Any]) -> str:
    return f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""


def _never(seen: dict[int, list[int]], universe: int | None) -> str:
    """Which ids of the dataset were not trained (the epoch's tail among them)."""
    if universe is None:
        return ""
    unseen = [sample for sample in range(universe) if sample not in seen]
    shown = ", ".join(map(str, unseen[:SHOWN]))
    return f"; not trained: {shown}{' and more' if len(unseen) > SHOWN else ''}"
