"""Whom a file or directory on a shared filesystem lets in: one set of rules for everything we
read and then act on (the config file, templates, job records, job directories, log
directories, the node-local checkpoint tier; the secret file keeps its stricter rule of its
own in ``rendezvous/secret.py``).

Anyone who can write near our files is an attacker here: a file another user owns, or may
rewrite, could make us run their code or load their weights, and a directory in which another
user may rename entries lets them swap our directory for theirs. The rules compare owners with
the running user and read mode bits themselves, never asking ``access(2)``, which answers
"yes" to root for everything: root must refuse another user's file too.

The rules are pure (owner, mode, uid in; a reason or None out); the few functions that stat
take the path and return the reason, and each caller raises its own error from ``errors.py``
with the path and the fix.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

_log = logging.getLogger(__name__)

ROOT_UID = 0
"""Root may do anything to any file anyway, so a directory root owns is no added risk."""


def unsafe_file_reason(owner: int, mode: int, uid: int) -> str | None:
    """Why a file with this owner and mode must not be trusted by ``uid``, or None.

    Anyone else's file, or one that group or others may rewrite, could say what we run.
    """
    if owner != uid:
        return f"it is owned by user id {owner}, not by you"
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group or others may write it (mode {stat.S_IMODE(mode):04o})"
    return None


def private_dir_reason(owner: int, mode: int, uid: int) -> str | None:
    """Why a directory that must be ``uid``'s alone (a job directory, mode 0700) is not, or
    None. ``mode`` comes from ``lstat``: a link is refused, not followed."""
    if stat.S_ISLNK(mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(mode):
        return "it is not a directory"
    if owner != uid:
        return f"it is owned by user id {owner}, not by you"
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"group or others may enter it (mode {stat.S_IMODE(mode):04o}, not 0700)"
    return None


def unsafe_parent_reason(owner: int, mode: int, uid: int) -> str | None:
    """Why a directory lets someone other than ``uid`` and root rename what lies in it, or None.

    Its owner may always rename its entries; so may anyone allowed to write it, unless the
    sticky bit (as on ``/tmp``) keeps them to their own entries.
    """
    if owner not in (uid, ROOT_UID):
        return f"it is owned by user id {owner}, not by you or root"
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        return (
            f"group or others may write it (mode {stat.S_IMODE(mode):04o}) and it has no sticky bit"
        )
    return None


def private_dir_problem(path: Path, uid: int | None = None) -> str | None:
    """``private_dir_reason`` for ``path`` as it is now (not following a link)."""
    try:
        info = os.lstat(path)
    except OSError as error:
        return f"it cannot be examined ({error.strerror})"
    return private_dir_reason(info.st_uid, info.st_mode, os.geteuid() if uid is None else uid)


@dataclass(frozen=True)
class UnsafeParent:
    """A directory in which another user may rename entries (``unsafe_parent``)."""

    directory: Path
    reason: str
    ours: bool
    """Owned by us (or root): a ``chmod`` can make it safe; otherwise only another place can."""


def unsafe_parent(path: Path, uid: int | None = None) -> UnsafeParent | None:
    """The first directory, from ``path`` up to ``/``, in which another user may rename
    entries; None when there is none. Both the path as written and the path its links lead
    to are walked, since either chain can be swapped; missing ones are skipped."""
    uid = os.geteuid() if uid is None else uid
    written = Path(os.path.abspath(path))
    for directory in dict.fromkeys(
        [*_self_and_parents(written), *_self_and_parents(Path(os.path.realpath(written)))]
    ):
        try:
            info = os.stat(directory)
        except FileNotFoundError:
            continue
        reason = unsafe_parent_reason(info.st_uid, info.st_mode, uid)
        if reason is not None:
            _log.debug("%s is not a safe place for %s: %s", directory, path, reason)
            return UnsafeParent(directory, reason, info.st_uid in (uid, ROOT_UID))
    return None


def _self_and_parents(path: Path) -> list[Path]:
    return [path, *path.parents]
