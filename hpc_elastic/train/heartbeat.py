"""The progress heartbeat: one small file per rank that the agent watches to detect hangs.

The file holds the last training step as text and its mtime says when the loop last moved.
Torch-free, so the agent reads it with the same code the worker writes it with.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HEARTBEAT_FILE_ENV = "HPC_ELASTIC_HEARTBEAT_FILE"
MIN_INTERVAL = 0.5
"""Seconds between two writes, so polling the heartbeat every step stays cheap."""


def write(path: Path | str, step: int) -> None:
    """Replace the file atomically, so the agent never reads a half-written step."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(f"{step}\n")
    os.replace(temporary, path)


def read(path: Path | str) -> tuple[float, int | None]:
    """When the loop last moved (mtime) and its step; the step is None if the text is not one."""
    path = Path(path)
    mtime = path.stat().st_mtime
    text = path.read_text().strip()
    return mtime, int(text) if text.isdigit() else None


class Heartbeat:
    """Writes the step at most every ``MIN_INTERVAL`` seconds; a no-op without a file to write."""

    def __init__(self, path: Path | str | None = None, min_interval: float = MIN_INTERVAL) -> None:
        target = path if path is not None else os.environ.get(HEARTBEAT_FILE_ENV)
        self.path = Path(target) if target else None
        self.min_interval = min_interval
        self._last_write = float("-inf")

    def beat(self, step: int) -> None:
        now = time.monotonic()
        if self.path is None or now - self._last_write < self.min_interval:
            return
        self._last_write = now
        write(self.path, step)
