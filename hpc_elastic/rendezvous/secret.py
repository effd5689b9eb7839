"""The per-job secret that guards a job's znodes: created by ``submit``, read by the agents.

It travels in a file only its owner can read, never on a command line (which ``ps`` shows
to every user of the node).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from hpc_elastic.errors import RendezvousError, UsageError


def create_secret_file(path: Path) -> str:
    """Write a fresh secret to ``path`` with mode 0600 and return it."""
    secret = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as error:
        raise UsageError(
            f"Secret file '{path}' already exists; remove it or pick another job directory."
        ) from error
    with os.fdopen(fd, "w") as handle:
        handle.write(secret + "\n")
    return secret


def read_secret_file(path: Path) -> str:
    """The secret in ``path``, refusing a file that other users could have read."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as error:
        raise RendezvousError(
            f"Cannot read the ZooKeeper secret file '{path}' ({error.strerror}); "
            "check --zk-auth-file."
        ) from error
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(
            f"ZooKeeper secret file '{path}' has mode {stat.S_IMODE(mode):04o}, so other users "
            f"can read it; run 'chmod 600 {path}'."
        )
    if not text:
        raise UsageError(
            f"ZooKeeper secret file '{path}' is empty; let 'hpc-elastic submit' create it."
        )
    return text
