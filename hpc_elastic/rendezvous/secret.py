"""The per-job secret that guards a job's znodes: created by ``submit``, read by the agents.

It travels in a file only its owner can read, never on a command line (which ``ps`` shows
to every user of the node).
"""

from __future__ import annotations

import errno
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
    """The secret in ``path``, refusing a link, a file of another user, and a file that other
    users could have read.

    The file is opened without following a link and checked on the open descriptor: a job
    directory swapped for another user's could hold a link to the real secret (to get the
    agent to join with it) or a secret of theirs; the job directory's own check
    (``jobdir.job_dir_problem``) keeps the directories above it ours. ``O_NONBLOCK``: a FIFO in
    its place fails the regular-file check instead of blocking the open.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UsageError(
                f"ZooKeeper secret file '{path}' is a symbolic link, which is never followed; "
                "give the job's own secret file (hpc-elastic submit writes it in the job "
                "directory)."
            ) from error
        raise RendezvousError(
            f"Cannot read the ZooKeeper secret file '{path}' ({error.strerror}); "
            "check --zk-auth-file."
        ) from error
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        problem = _untrusted_secret(info, path)
        text = "" if problem is not None else handle.read().decode(errors="replace").strip()
    if problem is not None:
        raise UsageError(f"ZooKeeper secret file '{path}' {problem}")
    if not text:
        raise UsageError(
            f"ZooKeeper secret file '{path}' is empty; let 'hpc-elastic submit' create it."
        )
    return text


def _untrusted_secret(info: os.stat_result, path: Path) -> str | None:
    """The rest of the sentence refusing a secret file with this status, or None."""
    mode = info.st_mode
    if not stat.S_ISREG(mode):
        return "is not a regular file; give the job's own secret file."
    if info.st_uid != os.geteuid():
        return (
            f"is owned by user id {info.st_uid}, not by you, so someone else chose it; "
            "give the secret file that hpc-elastic submit wrote for you."
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (
            f"has mode {stat.S_IMODE(mode):04o}, so other users can read it; run "
            f"'chmod 600 {path}'."
        )
    return None


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
