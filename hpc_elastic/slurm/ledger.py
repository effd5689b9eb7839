"""A slot's ledger: what one slot has been through across its incarnations, in the job directory.

Each slot (array task) keeps its counts in ``<job dir>/slots/<slot>.json``: requeues by cause,
failures by node, the nodes it keeps away from, and whether an incarnation runs now (so the
next one can tell a clean exit from a death). Only one incarnation of a slot runs at a time,
so the file has a single writer (``ElasticSlot`` in slurm/elastic.py). The two ways the slots'
files in the shared job directory are written live here too: ``save_json`` (a whole record,
never half of one) and ``claim`` (a marker that exactly one process creates).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hpc_elastic import contract
from hpc_elastic.decoding import (
    Check,
    JsonRecord,
    mapping_of,
    one_of,
    optional,
    text,
    tuple_of,
    whole,
)
from hpc_elastic.errors import SlurmError
from hpc_elastic.jobdir import write_private
from hpc_elastic.slurm.departure import Departure


@dataclass(frozen=True)
class SlotLimits:
    """How often one slot may be requeued for each cause before it gives up."""

    max_preemptions: int = contract.DEFAULT_MAX_PREEMPTIONS
    max_time_limits: int = contract.DEFAULT_MAX_TIME_LIMITS
    exclude_after: int = contract.DEFAULT_EXCLUDE_AFTER
    """Failures of this slot on one node after which the node is excluded for the slot."""


@dataclass(frozen=True)
class SlotLedger:
    """What one slot has been through, across its incarnations."""

    preemptions: int = 0
    time_limits: int = 0
    node_failures: dict[str, int] = field(default_factory=dict)
    excluded: tuple[str, ...] = ()
    running_on: str | None = None
    """Set while an incarnation runs; still set at the next start means it died uncleanly."""
    leaving_for: str | None = None
    """The ``Departure`` value of a stop signal the incarnation was draining for: Slurm
    SIGKILLs a slot that is still saving after GraceTime, which is no fault of its node."""

    def failed_on(self, node: str) -> SlotLedger:
        failures = {**self.node_failures, node: self.node_failures.get(node, 0) + 1}
        return replace(self, node_failures=failures)

    def is_bad(self, node: str, limits: SlotLimits) -> bool:
        return self.node_failures.get(node, 0) >= limits.exclude_after

    def exclude(self, node: str) -> SlotLedger:
        return replace(self, excluded=tuple(sorted({*self.excluded, node})))

    def arrived(self, node: str) -> tuple[SlotLedger, Arrival]:
        """A new incarnation starts on ``node``: judge how the previous one ended.

        One that left cleanly cleared ``running_on``. One still marked running died uncleanly:
        if it was draining for preemption or its time limit, Slurm killed it after GraceTime
        (it counts as that requeue); otherwise it died with its node, a failure there.
        """
        arrival = Arrival(self.running_on, _known_departure(self.leaving_for))
        ledger = self
        if arrival.killed_leaving is not None:
            ledger = ledger.requeued(arrival.killed_leaving)
        elif arrival.crashed_on is not None:
            ledger = ledger.failed_on(arrival.crashed_on)
        return replace(ledger, running_on=node, leaving_for=None), arrival

    def requeued(self, why: Departure) -> SlotLedger:
        if why is Departure.TIME_LIMIT:
            return replace(self, time_limits=self.time_limits + 1)
        if why in (Departure.PREEMPTION, Departure.BY_HAND):
            return replace(self, preemptions=self.preemptions + 1)
        return self

    def over_limit(self, limits: SlotLimits) -> str | None:
        """The sentence that says which requeue budget is spent, or None."""
        if self.preemptions > limits.max_preemptions:
            return (
                f"it was preempted {self.preemptions} times "
                f"(--max-preemptions {limits.max_preemptions})"
            )
        if self.time_limits > limits.max_time_limits:
            return (
                f"it hit the time limit {self.time_limits} times "
                f"(--max-time-limits {limits.max_time_limits})"
            )
        return None


@dataclass(frozen=True)
class Arrival:
    """How the slot's previous incarnation ended, judged when the next one starts."""

    crashed_on: str | None = None
    """The node it still ran on when it died uncleanly (None: it left cleanly, or never ran)."""
    killed_leaving: Departure | None = None
    """Set when it died while draining for this cause: Slurm's SIGKILL after GraceTime."""

    @property
    def node_failure(self) -> str | None:
        """The node to blame: only a death that no stop signal explains."""
        return self.crashed_on if self.killed_leaving is None else None


KILLED_LEAVING_IS_EXPECTED = frozenset(
    {Departure.PREEMPTION, Departure.TIME_LIMIT, Departure.BACKFILL_END}
)
"""Causes whose stop Slurm itself ends with SIGKILL after GraceTime (or at the time limit)."""


def _known_departure(value: str | None) -> Departure | None:
    known = {why.value: why for why in KILLED_LEAVING_IS_EXPECTED}
    return known.get(value) if value is not None else None


LEDGER_FIELDS: dict[str, Check] = {
    "preemptions": whole(0),
    "time_limits": whole(0),
    "node_failures": mapping_of(whole(0)),
    "excluded": tuple_of(text(empty=False)),
    "running_on": optional(text()),
    "leaving_for": optional(one_of([why.value for why in Departure])),
}
"""``SlotLedger``'s fields (``decoding``): a node name is text (a list there once made the next
start crash, unhashable, and ``str()`` of it named no node), a count a whole number (never
``true`` or ``2.9``); a field missing (an older ledger) takes its default."""
UNREADABLE_LEDGER = (
    "{subject} is not a readable slot record ({why}); its counts start afresh, delete it if "
    "this keeps happening."
)
"""What a slot says of a ledger it cannot read or decode."""
_LEDGER = JsonRecord(
    SlotLedger,
    LEDGER_FIELDS,
    SlurmError,
    UNREADABLE_LEDGER,
    defaults=True,
)


def decode_ledger(data: bytes, where: str) -> SlotLedger:
    """The slot ledger in ``data`` (read from ``where``), each field of its type, or one
    ``SlurmError`` sentence naming the field and its value."""
    return _LEDGER.decode(data, where)


def load_ledger(path: Path) -> SlotLedger:
    """The slot's record; a missing file is an empty one, an unreadable one a SlurmError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return SlotLedger()
    except OSError as error:
        raise SlurmError(
            UNREADABLE_LEDGER.format(subject=f"'{path}'", why=error.strerror)
        ) from error
    return decode_ledger(data, str(path))


def save_ledger(path: Path, ledger: SlotLedger) -> None:
    save_json(path, asdict(ledger))


def save_json(path: Path, record: Mapping[str, object]) -> None:
    """Write a temporary file, fsync it, rename it over the record and fsync the directory:
    a killed agent never leaves half a record, and a crashed node never loses the rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with scratch.open("w") as out:
        out.write(json.dumps(record, sort_keys=True))
        out.flush()
        os.fsync(out.fileno())
    os.replace(scratch, path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def claim(path: Path) -> bool:
    """Create ``path`` if nobody has: True for the one process (of any agent, on any node of
    the shared job directory) that created it. O_EXCL makes the check and the creation one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_private(path, "", exclusive=True)
    except FileExistsError:
        return False
    return True
