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


OPEN_ACL_FLAG = "--zk-open-acl"
"""The CLI flag by which a user asks for a job without a secret, knowingly."""


def require_secret(secret: str | None, run_id: str, *, open_acl: bool) -> None:
    """Refuse a ZooKeeper job without a secret unless the user asked for an open ACL.

    Without a secret the job's znodes are world-writable: any user of the ensemble could read
    the master address, forge the state, join as a fake member or end the job. A missing
    ``--zk-auth-file`` is far likelier an accident than a choice, so it must be said aloud.
    """
    if secret is None and not open_acl:
        raise UsageError(
            f"Job '{run_id}' has no ZooKeeper secret, so every user of the ensemble could read, "
            "forge, join or end it; give --zk-auth-file FILE (hpc-elastic submit creates one) "
            f"or pass {OPEN_ACL_FLAG} to run it unprotected on purpose."
        )


def user_secret(path: Path) -> str:
    """The user's own secret (for ZooKeeper nodes that outlive a job, like the bad-node list),
    created with mode 0600 on first use and read back afterwards."""
    if not path.exists():
        try:
            return create_secret_file(path)
        except UsageError:
            pass  # Another agent of ours created it in the meantime: read theirs.
    return read_secret_file(path)
