"""The live progress view of ``hpc-elastic run``: new events, each told once, as they happen."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpc_elastic import events
from hpc_elastic.events import Kind
from hpc_elastic.ops import timeline

SHOWN = frozenset(
    {Kind.ROUND, Kind.FAILURE, Kind.FAILED, Kind.CHECKPOINT, Kind.PREEMPT, Kind.DONE, Kind.CHURN}
)
"""Events the progress view prints; ``hpc-elastic events`` shows them all."""


@dataclass
class Progress:
    """Prints new events once: a round is told by its first agent only."""

    path: Path
    say: Callable[[str], None]
    offset: int = 0
    seen: set[tuple[str, int | None, object, object]] = field(default_factory=set)

    def poll(self) -> list[events.Event]:
        """The events appended since the last poll; the news among them is printed."""
        new, self.offset = events.read_new(self.path, self.offset)
        for event in new:
            key = (event.kind, event.round, event.details.get("step"), _teller(event))
            if event.kind in SHOWN and key not in self.seen:
                self.seen.add(key)
                self.say(f"{timeline.clock(event.time)}  {timeline.describe(event)}")
        return new


def _teller(event: events.Event) -> object:
    """What makes an event news: every agent reports the same round, but each its own stop."""
    if event.kind == Kind.CHURN:
        return event.time
    return event.slot if event.kind == Kind.PREEMPT else None
