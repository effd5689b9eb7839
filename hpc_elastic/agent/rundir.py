"""The agent's private run directory, and the sweep of those that killed agents left behind.

Each agent keeps its lease, heartbeats, in-place assignments and standbys' ready files in a
directory of its own under the temporary directory (``/tmp/hpc-elastic-<run>-XXXX``) and removes
it when it exits. An agent killed with SIGKILL (a node's OOM killer, ``scancel --signal=KILL``,
a crashed slurmstepd) cannot, and a node that runs many requeues of many jobs collects them.

So every agent holds an exclusive ``flock`` on a file in its directory for as long as it lives,
and sweeps at its start the directories whose lock it can take: the kernel drops a lock when the
last descriptor of its holder closes, whoever killed it, so a lock that can be taken means the
agent is gone. The lock says so across pid namespaces (containers) too, where a pid would not.

The directory is prepared under a hidden name and renamed into place once locked, so a sweep
never meets a live agent's directory before its lock is held.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "hpc-elastic-"
"""Run directories are ``<tmp>/hpc-elastic-<run id>-XXXX``."""
LOCK = "lock"

log = logging.getLogger(__name__)


class RunDir:
    """One agent's run directory; ``remove`` deletes it and releases the lock."""

    def __init__(self, run_id: str, parent: Path | None = None) -> None:
        parent = Path(parent or tempfile.gettempdir())
        sweep(parent)
        hidden = Path(tempfile.mkdtemp(prefix=f".{PREFIX}{run_id}-", dir=parent))
        self._lock = os.open(hidden / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else can hold it
        self.path = parent / hidden.name[1:]
        hidden.rename(self.path)

    def remove(self) -> None:
        """Delete the directory and drop the lock; a second call does nothing."""
        if self._lock < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock)
        self._lock = -1  # that descriptor number may name another file now


def sweep(parent: Path) -> list[Path]:
    """Remove this user's run directories under ``parent`` whose agent is gone; returns them.
    A directory without a lock file (an older version's, or not a run directory) is left."""
    swept = []
    for path in parent.glob(f"{PREFIX}*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and path.stat().st_uid == os.getuid() and _abandoned(path):
                shutil.rmtree(path, ignore_errors=True)
                swept.append(path)
    if swept:
        log.debug("removed the run directories of agents that are gone: %s", swept)
    return swept


def _abandoned(path: Path) -> bool:
    """Whether nobody holds the lock of ``path`` (its agent died); False without a lock file."""
    try:
        fd = os.open(path / LOCK, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its agent lives
    finally:
        os.close(fd)  # (also releases the lock just taken, before the directory goes)
    return True
