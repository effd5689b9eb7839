"""The progress heartbeat: one small file per rank that the agent watches to detect hangs.

The file holds the last training step as text and its mtime says when the loop last moved.
While a checkpoint is written on the training thread it holds "STEP checkpoint": the loop cannot
beat then, and the agent times the rank by its checkpoint deadline instead of the (much shorter)
learned step deadline. Torch-free, so the agent reads it with the same code the worker writes.

Beside it, the **collective marker** (``<heartbeat>.collective``) says whether the rank waits
in a collective: "in all_reduce #12 since T" while it does, "out ..." after. A hung job's
agents read it to tell the rank that stopped from the ranks that wait for it
(docs/unattended.md, "Who hung"). The training helpers mark their own collectives, and
``hpc_elastic.train.collectives`` marks a user's. ``hpc_elastic.train.heartbeat`` re-exports
this module for training scripts that import it from there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic import contract

log = logging.getLogger(__name__)

HEARTBEAT_FILE_ENV = contract.HEARTBEAT_FILE_ENV
MIN_INTERVAL = 0.5
"""Seconds between two writes, so polling the heartbeat every step stays cheap."""


FINISHED = "finished"
"""What a rank writes once its training loop is over: the agent stops timing it from then on,
so a final save, a last barrier or a slow shutdown is not taken for a hang."""


CHECKPOINT = "checkpoint"
"""The mark after the step while the rank writes a checkpoint (see the module docstring)."""


def write(path: Path | str, step: int) -> None:
    """Replace the file atomically, so the agent never reads a half-written step."""
    _replace(Path(path), f"{step}\n")


def finish(path: Path | str) -> None:
    """Say that this rank's training loop is over (see ``FINISHED``)."""
    _replace(Path(path), f"{FINISHED}\n")


def mark_checkpoint(path: Path | str, step: int) -> None:
    """Say that this rank is writing a checkpoint after ``step`` (see ``CHECKPOINT``)."""
    _replace(Path(path), f"{step} {CHECKPOINT}\n")


def checkpointing(path: Path | str) -> bool:
    """Whether the rank said it is writing a checkpoint; False also before its first beat."""
    try:
        return Path(path).read_text().split()[1:] == [CHECKPOINT]
    except FileNotFoundError:
        return False


def finished(path: Path | str) -> bool:
    """Whether the rank said its loop is over; False also when it has not beaten yet."""
    try:
        return Path(path).read_text().strip() == FINISHED
    except FileNotFoundError:
        return False


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def read(path: Path | str) -> tuple[float, int | None]:
    """When the loop last moved (mtime) and its step; the step is None if the text is not one.

    A checkpoint mark keeps the step it follows, so the step does not seem to go backwards.
    """
    mtime, step, _ = read_marked(path)
    return mtime, step


def read_marked(path: Path | str) -> tuple[float, int | None, bool]:
    """``read``, and whether the text is a checkpoint mark, from the same read: the agent
    learns how long a save takes from when the mark appears and goes (agent/watchdog.py), and
    a second read could see the step written back after the first saw the mark."""
    path = Path(path)
    mtime = path.stat().st_mtime
    words = path.read_text().split()
    step = int(words[0]) if words and words[0].isdigit() else None
    return mtime, step, words[1:] == [CHECKPOINT]


class Heartbeat:
    """Writes the step at most every ``MIN_INTERVAL`` seconds; a no-op without a file to write."""

    def __init__(self, path: Path | str | None = None, min_interval: float = MIN_INTERVAL) -> None:
        target = path if path is not None else os.environ.get(HEARTBEAT_FILE_ENV)
        self.path = Path(target) if target else None
        self.min_interval = min_interval
        self._last_write = float("-inf")
        self._step: int | None = None
        self._finished = False

    def beat(self, step: int) -> None:
        """Record ``step``; a no-op once the loop said it is over (``finished`` is final)."""
        self._step = step
        now = time.monotonic()
        if self._silent() or now - self._last_write < self.min_interval:
            return
        self._last_write = now
        assert self.path is not None
        write(self.path, step)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Mark the file while a checkpoint is written, then write the step back.

        Nothing is marked before the first beat (the agent still times start-up then) or after
        ``finish`` (the agent no longer times the rank). Writing the step back at the end
        moves the mtime: the rank has just made progress, and a hang after the save is then
        timed by the step deadline again, not the checkpoint one.
        """
        path, step = self.path, self._step
        if self._silent() or path is None or step is None:
            yield
            return
        mark_checkpoint(path, step)
        log.debug("heartbeat: checkpoint after step %d", step)
        try:
            yield
        finally:
            if not self._finished:
                write(path, step)
                self._last_write = time.monotonic()
                log.debug("heartbeat: checkpoint after step %d done", step)

    def finish(self) -> None:
        """The training loop is over: from now on the agent does not time this rank."""
        if self._silent():
            return
        self._finished = True
        assert self.path is not None
        finish(self.path)
        log.debug("heartbeat: finished")

    def _silent(self) -> bool:
        """No file to write, or the loop already said it is over."""
        return self.path is None or self._finished


COLLECTIVE_SUFFIX = ".collective"
MARKER_BYTES = 160
"""Every marker record is padded to this length and written with one ``pwrite`` at offset 0
into a file opened once: no rename and no new inode per collective, two syscalls per marked
collective. A reader that races a write may see a mix of two records: it then fails to parse,
and the agent falls back on the rank's stack."""


def collective_path(heartbeat: Path | str) -> Path:
    """The collective marker of the rank whose heartbeat is ``heartbeat``."""
    return Path(f"{heartbeat}{COLLECTIVE_SUFFIX}")


@dataclass(frozen=True)
class Collective:
    """One marker record: the rank's latest marked collective, and whether it is inside."""

    inside: bool
    op: str
    seq: int
    """How many collectives this process has marked, this one included."""
    since: float
    """When it entered (inside) or left it (wall clock)."""
    pid: int
    """The writer: a record left by an earlier worker of the same rank is not this one's."""


def read_collective(path: Path | str) -> Collective | None:
    """The marker's record, or None: no marker (the rank never marked a collective), or one
    caught half-written."""
    try:
        with open(path, "rb") as file:
            words = file.read(MARKER_BYTES).decode(errors="replace").split()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if len(words) != 5 or words[0] not in ("in", "out"):
        return None
    where, op, seq, since, pid = words
    try:
        return Collective(where == "in", op, int(seq.lstrip("#")), float(since), int(pid))
    except ValueError:
        return None


class CollectiveMarker:
    """Writes the collective marker of this rank; a no-op without a heartbeat file to sit by.

    Nested and concurrent collectives (a background commit's gather beside the loop's
    all_reduce) count once: the marker says "in" from the first entry to the last exit.
    """

    def __init__(self, heartbeat: Path | str | None = None) -> None:
        self._heartbeat = heartbeat
        self._resolved = False
        self.path: Path | None = None
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._depth = 0
        self._seq = 0

    def enter(self, op: str) -> None:
        with self._lock:
            self._depth += 1
            self._seq += 1
            self._write("in", op)

    def leave(self, op: str) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._write("out", op)

    @contextmanager
    def marked(self, op: str) -> Iterator[None]:
        """Mark the ``with`` block as waiting in collective ``op``."""
        self.enter(op)
        try:
            yield
        finally:
            self.leave(op)

    def _write(self, where: str, op: str) -> None:
        if not self._resolved:
            # At the first collective, not at import: a prewarmed standby imports modules
            # before the agent hands it its rank's environment (agent/standby.py).
            self._resolved = True
            target = self._heartbeat or os.environ.get(HEARTBEAT_FILE_ENV)
            self.path = collective_path(target) if target else None
        if self.path is None:
            return
        name = "".join(c if c.isalnum() or c in "_.:-" else "_" for c in op)[:40] or "collective"
        record = f"{where} {name} #{self._seq} {time.time():.6f} {os.getpid()}"
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(self._fd, record.ljust(MARKER_BYTES - 1).encode() + b"\n", 0)
        except OSError as error:  # the run directory went away: the agent is gone too
            log.debug("heartbeat: cannot mark collective %s: %s", op, error)
            self.path = None
