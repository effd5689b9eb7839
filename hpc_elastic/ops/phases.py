"""Where a restart's seconds go: a job's events turned into one phase breakdown per restart.

A restart is the step from one round that ran workers to the next. Its clock starts when the
first agent saw the round end (a worker's exit, a membership change): that is the earliest
moment the events can know of, since a killed node writes nothing. Every later phase is the
moment the *last* node (or rank) reached it, because the job only moves on when all have:

    seen      an agent saw the round end              ``round_ended`` (earliest)
    told      the failure was written to the store    ``failure_reported`` (earliest)
    stopped   the old workers are gone                ``workers_stopped`` (latest)
    formed    the next round exists                   ``round`` (earliest)
    spawned   the new workers were started            ``start`` (latest)
    connected every rank's store client connected ``store_connected`` (latest; the agents
              see it in ``/proc``: a plain script without the training helpers has it too)
    ready     the new ranks reached their first step  ``worker_ready`` (latest; training helpers)
    stepped   the first step is done on every rank    ``first_step`` (latest; training helpers),
              else every rank's first heartbeat       ``first_heartbeat`` (latest; the agent)

An in-place restart (``agent --in-place``: the new round has a ``workers_kept`` event) stops
and spawns nothing that survived, so its row has other columns (``IN_PLACE_PHASES``): instead
of stopped and spawned, the moment the last agent handed its survivors the new round:

    kept      every survivor was handed the round     ``workers_kept`` (latest)

It comes after ``formed`` (an agent hands out a round once it exists); ``connected`` is when
the survivors and newcomers joined the new round's store, ``ready`` the survivors' new group
(``InPlace`` writes ``worker_ready`` when it re-formed) and a newcomer's.

Pure: events in, records out, so it is tested on recorded events and used by the CLI and the
restart benchmark alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hpc_elastic.events import Event

PHASES = ("told", "stopped", "formed", "spawned", "connected", "ready", "stepped")
"""The phases after ``seen``, in the order a restart goes through them."""

IN_PLACE_PHASES = ("told", "formed", "kept", "connected", "ready", "stepped")
"""The phases of an in-place restart, in order: the survivors are neither stopped nor spawned."""

_SOURCES: dict[str, tuple[str, bool, bool]] = {
    # phase: (event kind, from the old round?, earliest rather than latest?)
    "told": ("failure_reported", True, True),
    "stopped": ("workers_stopped", True, False),
    "formed": ("round", False, True),
    "spawned": ("start", False, False),
    "kept": ("workers_kept", False, False),
    "connected": ("store_connected", False, False),
    "ready": ("worker_ready", False, False),
    "stepped": ("first_step", False, False),
}
_STEP_FALLBACK = "first_heartbeat"
MARKERS = frozenset(
    {
        "round_ended",
        "failure_reported",
        "workers_stopped",
        "store_connected",
        "worker_ready",
        "first_step",
        _STEP_FALLBACK,
    }
)
"""Event kinds written only for this breakdown: ``events`` leaves them out of its story (they
are in ``--all`` and ``--json``)."""


@dataclass(frozen=True)
class Restart:
    """One restart: from round ``previous`` to round ``round``."""

    previous: int
    round: int
    reason: str
    """What the first agent saw end the old round: failed, changed, fenced, ..."""
    seen: float
    """Epoch seconds when the first agent saw the old round end."""
    after: dict[str, float | None]
    """Phase -> seconds after ``seen`` (None: no event says when, e.g. no training helpers)."""
    in_place: bool = False
    """Whether an agent kept its surviving workers into the new round (``workers_kept``)."""

    @property
    def phases(self) -> tuple[str, ...]:
        """The columns that describe this restart: ``IN_PLACE_PHASES`` or ``PHASES``."""
        return IN_PLACE_PHASES if self.in_place else PHASES

    @property
    def total(self) -> float | None:
        """Seconds from the failure seen to the first step of the new round, if known."""
        return self.after.get("stepped")


def restarts(history: Iterable[Event]) -> list[Restart]:
    """One record per restart, in round order. Rounds that never started workers are skipped:
    one that formed and changed again before it started only makes the next restart longer
    (its ``formed`` is the round that finally started)."""
    by_round: dict[int, list[Event]] = {}
    for event in history:
        if event.round is not None:
            by_round.setdefault(event.round, []).append(event)
    started = sorted(number for number, found in by_round.items() if _kind(found, "start"))
    breakdowns = []
    for previous, current in itertools.pairwise(started):
        ended = _kind(by_round[previous], "round_ended")
        if not ended:
            continue  # No agent saw the old round end (an older agent wrote these events).
        first = min(ended, key=lambda event: event.time)
        breakdowns.append(
            Restart(
                previous=previous,
                round=current,
                reason=str(first.details.get("outcome", "")),
                seen=first.time,
                after=_after(first.time, by_round[previous], by_round[current]),
                in_place=bool(_kind(by_round[current], "workers_kept")),
            )
        )
    return breakdowns


def _after(seen: float, old: list[Event], new: list[Event]) -> dict[str, float | None]:
    after: dict[str, float | None] = {}
    for phase, (kind, from_old, earliest) in _SOURCES.items():
        found = _kind(old if from_old else new, kind)
        if phase == "stepped" and not found:
            found = _kind(new, _STEP_FALLBACK)
        times = [event.time for event in found]
        moment = (min(times) if earliest else max(times)) if times else None
        after[phase] = None if moment is None else moment - seen
    return after


def _kind(found: Sequence[Event], kind: str) -> list[Event]:
    return [event for event in found if event.kind == kind]


def table(breakdowns: Sequence[Restart]) -> list[str]:
    """The breakdown as text lines: one row per restart (how the old round ended, then each
    phase in seconds after that was first seen). In-place and normal restarts have different
    columns, so a header line comes first and again wherever the kind of restart changes."""
    rows: list[str] = []
    columns: tuple[str, ...] | None = None
    for restart in breakdowns:
        if restart.phases != columns:
            columns = restart.phases
            rows.append(_header(columns))
        cells = "".join(_seconds(restart.after[phase]) for phase in columns)
        rows.append(f"{restart.previous:>4} -> {restart.round:<2}  {restart.reason:<10}{cells}")
    return rows or [_header(PHASES)]


def _header(columns: Sequence[str]) -> str:
    return f"{'round':>9}  {'ended':<10}" + "".join(f"{phase:>10}" for phase in columns)


def _seconds(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value:>9.2f}s"
