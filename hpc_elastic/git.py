"""The one place hpc-elastic runs git: a few read-only questions about a work tree.

A subprocess boundary, not a library: git is on every machine that has a work tree, and its
command line answers in a stable, machine-readable form (``-z``). Every call is read-only and
takes no lock (``GIT_OPTIONAL_LOCKS=0``: ``git status`` would otherwise refresh the index and
could collide with the user's own git in another terminal). A missing git, a directory that is
not a work tree, or one git refuses (another user's, ``safe.directory``) all read as "not a
work tree": the caller then treats the directory as plain files.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

_log = logging.getLogger(__name__)

GIT_TIMEOUT_SECONDS = 60.0
"""A huge work tree on a slow shared file system may take a while to list, never this long."""


class _NoAnswer(Exception):
    """git is missing, failed or took too long; the callers turn it into None or False."""


def _git(directory: Path, *args: str) -> bytes:
    environment = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            env=environment,
            timeout=GIT_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        _log.debug("git %s in %s did not run: %s", args[0], directory, error)
        raise _NoAnswer from error
    if done.returncode != 0:
        _log.debug("git %s in %s: %s", args[0], directory, done.stderr.decode(errors="replace"))
        raise _NoAnswer
    return done.stdout


def toplevel(directory: Path) -> Path | None:
    """The root of the work tree holding ``directory``, or None when there is none."""
    try:
        out = _git(directory, "rev-parse", "--show-toplevel")
    except _NoAnswer:
        return None
    text = out.decode(errors="surrogateescape").strip()
    return Path(text) if text else None


def listed_files(root: Path) -> list[str]:
    """The files git knows or would know: tracked, plus untracked ones not ignored; relative
    to ``root``, each once. A tracked file deleted from the disk is still listed (the caller
    skips what is gone)."""
    out = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    names = [name.decode(errors="surrogateescape") for name in out.split(b"\0") if name]
    return list(dict.fromkeys(names))


def head_commit(root: Path) -> str | None:
    """The commit checked out, or None for a repository without commits yet."""
    try:
        return _git(root, "rev-parse", "--verify", "--quiet", "HEAD").decode().strip() or None
    except _NoAnswer:
        return None


def is_dirty(root: Path) -> bool:
    """Whether the work tree differs from its commit: a change to a tracked file, or a new file
    that is not ignored (the snapshot holds both, so neither is in the commit)."""
    return bool(_git(root, "status", "--porcelain", "-z", "--untracked-files=normal"))


def survey(root: Path) -> tuple[list[str], str | None, bool] | None:
    """(files, commit, dirty) of the work tree at ``root``, or None if git cannot answer."""
    try:
        return listed_files(root), head_commit(root), is_dirty(root)
    except _NoAnswer:
        return None
