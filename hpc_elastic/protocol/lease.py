"""Worker self-fencing: stop at once when the agent stops renewing its lease.

A node whose agent is frozen (or cut off) past its ZooKeeper session no longer belongs to the
job: the other nodes may already have formed a round without it. Its workers cannot learn that
from ZooKeeper, so the agent renews a lease instead, by touching a file every poll while it
holds a live round, and the workers check the file's age. When the lease is older than its
timeout the worker exits with ``FENCED_EXIT_CODE`` without saving anything: a save from a
round that may be superseded is exactly what split brain corrupts.

The agent passes the file in ``HPC_ELASTIC_LEASE_FILE`` and the timeout (seconds) in
``HPC_ELASTIC_LEASE_TIMEOUT``; without both (plain torchrun) there is no lease and no check.
The agent creates the file before it starts the workers, so a missing file means a stale lease.
Torch-free: the agent renews with ``renew`` from this same module. ``hpc_elastic.train.lease``
re-exports it for training scripts that import it there.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

from hpc_elastic import contract, events
from hpc_elastic.contract import FENCED_EXIT_CODE
from hpc_elastic.errors import UsageError

LEASE_FILE_ENV = contract.LEASE_FILE_ENV
LEASE_TIMEOUT_ENV = contract.LEASE_TIMEOUT_ENV
MIN_INTERVAL = 0.5
"""Seconds between two looks at the file, so checking at every step costs at most one stat."""

log = logging.getLogger(__name__)


def renew(path: Path | str) -> None:
    """The agent's side: create the lease file or move its mtime to now."""
    Path(path).touch()


def expired(mtime: float | None, now: float, timeout: float) -> bool:
    """The rule: a lease is stale when its file is gone or was not renewed for ``timeout`` s."""
    return mtime is None or now - mtime > timeout


class Lease:
    """One worker's view of the agent's lease, looked at no more often than ``min_interval``."""

    def __init__(
        self,
        path: Path | str,
        timeout: float,
        min_interval: float = MIN_INTERVAL,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.min_interval = min_interval
        self._wall_clock = wall_clock
        self._monotonic = monotonic
        self._looked_at = float("-inf")
        self._expired = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Lease | None:
        """The lease the agent named, or None when there is none (plain torchrun)."""
        path, timeout = environ.get(LEASE_FILE_ENV), environ.get(LEASE_TIMEOUT_ENV)
        if not path or not timeout:
            return None
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0:
            raise UsageError(
                f"{LEASE_TIMEOUT_ENV}={timeout!r} is not a positive number of seconds; "
                f"set it to the agent's lease timeout or unset {LEASE_FILE_ENV}."
            )
        return cls(path, seconds)

    def expired(self, force: bool = False) -> bool:
        """Whether the lease is stale; ``force`` looks now, else at most every ``min_interval``.

        Once stale it stays stale: an agent that wakes up and renews does not make this
        worker's round current again.
        """
        now = self._monotonic()
        if self._expired or (not force and now - self._looked_at < self.min_interval):
            return self._expired
        self._looked_at = now
        try:
            mtime: float | None = self.path.stat().st_mtime
        except FileNotFoundError:
            mtime = None
        self._expired = expired(mtime, self._wall_clock(), self.timeout)
        if self._expired:
            log.debug("lease %s is stale (mtime %s, timeout %ss)", self.path, mtime, self.timeout)
        return self._expired


_lease: Lease | None = None
_looked_up = False


def current() -> Lease | None:
    """This process's lease, read from the environment once."""
    global _lease, _looked_up  # noqa: PLW0603
    if not _looked_up:
        _lease = Lease.from_environment()
        _looked_up = True
    return _lease


def check(force: bool = False) -> None:
    """Exit with ``FENCED_EXIT_CODE`` if the lease is stale; a no-op without a lease."""
    lease = current()
    if lease is not None and lease.expired(force):
        exit_fenced(lease)


def exit_fenced(lease: Lease) -> NoReturn:
    """Leave now, saving nothing and skipping destructors (they may wait on dead peers)."""
    message = (
        f"The agent's lease '{lease.path}' was not renewed for {lease.timeout:g} s; this "
        f"worker stops without saving (exit code {FENCED_EXIT_CODE}) because a newer round "
        f"may be training."
    )
    log.error("%s", message)
    print(message, file=sys.stderr)
    events.emit(events.Kind.FENCED, lease=str(lease.path), timeout=lease.timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FENCED_EXIT_CODE)
