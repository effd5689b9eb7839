"""The job's timeline: JSON lines appended by every agent and worker, read back across requeues.

Each event is one ``write`` on a file opened with O_APPEND, so lines from many processes on a
shared filesystem interleave whole instead of tearing.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EVENTS_FILE_ENV = "HPC_ELASTIC_EVENTS_FILE"
_MAX_LINE = 4000


@dataclass(frozen=True)
class Event:
    kind: str
    """join, leave, round, start, restart, failure, preempt, requeue, checkpoint, done, ..."""
    job: str = ""
    slot: str = ""
    node: str = field(default_factory=socket.gethostname)
    round: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


def append(path: Path | str, event: Event) -> None:
    """Append one event; a line too long for an atomic append loses its details, not its kind."""
    line = json.dumps(asdict(event), sort_keys=True, default=str)
    if len(line) > _MAX_LINE:
        line = json.dumps(asdict(Event(**{**asdict(event), "details": {"truncated": True}})))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def emit(kind: str, **details: Any) -> None:
    """Append to the events file the agent named in the environment; a no-op outside a job."""
    path = os.environ.get(EVENTS_FILE_ENV)
    if path:
        append(
            path,
            Event(
                kind=kind,
                job=os.environ.get("TORCHELASTIC_RUN_ID", ""),
                slot=os.environ.get("HPC_ELASTIC_SLOT", ""),
                round=_int_or_none(os.environ.get("HPC_ELASTIC_ROUND")),
                details=details,
            ),
        )


def read(path: Path | str) -> Iterator[Event]:
    """Events in time order; a torn or foreign line is skipped rather than trusted."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return iter(())
    return iter(sorted(_parse(lines), key=lambda event: event.time))


def read_new(path: Path | str, offset: int) -> tuple[list[Event], int]:
    """Events appended after byte ``offset`` (whole lines only), in file order, and the
    offset to read from next: for readers that follow the file as it grows."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            chunk = file.read()
    except FileNotFoundError:
        return [], offset
    complete = chunk[: chunk.rfind(b"\n") + 1]
    return _parse(complete.decode(errors="replace").splitlines()), offset + len(complete)


def _parse(lines: list[str]) -> list[Event]:
    events: list[Event] = []
    for line in lines:
        try:
            raw = json.loads(line)
            events.append(Event(**raw))
        except (ValueError, TypeError):
            continue
    return events


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None
