"""Code snapshots: a job runs the code as it was when it was submitted, not as it is now.

A job may wait in the queue for hours and be requeued for days; meanwhile its author edits the
script. Without a snapshot, each requeued slot would run whatever is on disk at that moment,
and one job could train with two versions of the code. So ``submit`` copies the script's
project into the job directory (``JobDir.code``) and the rendered script points there.

What the copy holds (``survey``):

- In a git work tree: every file git lists, tracked **and** untracked-but-not-ignored (the
  contents on disk, uncommitted edits included). Untracked files are in because a module
  written this morning and not yet ``git add``-ed is still imported by the script: leaving it
  out would fail the job on a node, hours later. ``.gitignore`` is how a file stays out.
- Elsewhere: the script's directory, minus ``SKIPPED_DIRS`` (caches and virtual envs).
- Never the log directory (earlier jobs' directories, checkpoints and secrets), and never a
  submodule's files (git lists a submodule as one entry; it is left out, see docs/submit.md).
- The script itself, always, even where git ignores it.

Links never take the copy out of the project: a link is copied as a link, never followed. One
that points inside the project is rewritten relative, so it points inside the copy; one that
points outside keeps pointing at the same absolute place (a ``data -> /datasets/x`` link still
works, and nothing outside is read or copied). Files keep their mode bits (``copy2``).

A size cap (``--snapshot-max-mb``) stops a project that holds data or checkpoints from filling
the log directory: the error names the biggest files. ``survey`` reads and decides (it is what
``--dry-run`` runs); ``take`` copies what it decided, into a fresh directory.
"""

from __future__ import annotations

import heapq
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from hpc_elastic import git
from hpc_elastic.errors import SnapshotError
from hpc_elastic.jobdir import CodeSnapshot

_log = logging.getLogger(__name__)

MB = 1_000_000
SKIPPED_DIRS = frozenset(
    {".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
)
"""Outside git, directories no job imports from: caches and virtual environments (a venv
alone can pass the cap). In a work tree ``.gitignore`` decides instead."""
BIGGEST_NAMED = 3
"""How many of the biggest files the cap's error names."""


@dataclass(frozen=True)
class Entry:
    """One path of the copy, relative to the project root."""

    path: str
    size: int
    """Bytes of a regular file; 0 for a link."""
    link: str | None = None
    """For a link: what the copy's link points to (relative inside, absolute outside)."""


@dataclass(frozen=True)
class Manifest:
    """What a snapshot will hold and where it came from; made by ``survey``, copied by ``take``."""

    source: Path
    """The project root, links resolved: the git work tree's top, or the script's directory."""
    entries: tuple[Entry, ...]
    git: bool
    commit: str | None = None
    dirty: bool | None = None
    """Whether the copy differs from ``commit`` (edited or new files); None outside git."""

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.entries)

    def inside(self, path: Path, copy: Path) -> Path | None:
        """Where ``path`` (in the project) is in the ``copy``; None for a path outside it."""
        real = _real_parent(path)
        if not real.is_relative_to(self.source):
            return None
        return copy / real.relative_to(self.source)

    def record(self, copy: Path) -> CodeSnapshot:
        """What ``job.json`` keeps of this snapshot, for ``status`` and the API."""
        return CodeSnapshot(
            dir=copy,
            source=self.source,
            git=self.git,
            commit=self.commit,
            dirty=self.dirty,
            files=len(self.entries),
            bytes=self.size,
        )


def survey(script: Path, log_dir: Path, max_mb: int) -> Manifest:
    """Decide what the snapshot of ``script``'s project holds; reads, never writes.

    Raises ``SnapshotError`` when it would hold more than ``max_mb`` megabytes.
    """
    script = _real_parent(script.absolute())
    excluded = Path(os.path.realpath(log_dir.absolute()))
    top = git.toplevel(script.parent)
    answer = git.survey(top) if top is not None else None
    walking = answer is None
    candidates: Iterator[str]
    if top is not None and answer is not None:
        root = Path(os.path.realpath(top))
        names, commit, dirty = answer
        candidates = iter(names)
        _log.debug("snapshot of git work tree %s at %s (dirty: %s)", root, commit, dirty)
    else:
        root = script.parent
        commit, dirty = None, None
        candidates = _walk(root, excluded)
        _log.debug("snapshot of directory %s (not a git work tree)", root)
    limit = max_mb * MB
    entries: list[Entry] = []
    total = 0
    for name in _with_script(candidates, script.relative_to(root)):
        entry = _entry(root, name, excluded)
        if entry is None:
            continue
        entries.append(entry)
        total += entry.size
        if total > limit and walking:
            break  # a plain directory may be a whole home: stop walking, it is too big anyway
    if total > limit:
        raise _too_big(root, entries, total, max_mb, complete=not walking)
    return Manifest(root, tuple(entries), answer is not None, commit, dirty)


def take(manifest: Manifest, copy: Path) -> None:
    """Copy the manifest's files into ``copy`` (which must not exist yet), links last.

    Links come last so no file is ever written through one: the listed files never lie under
    a link (git lists a link, not its contents; the walk does not follow links). Directories
    get their source's mode last, so a read-only one is still filled first.
    """
    copy.mkdir(mode=0o700)
    made: dict[Path, Path] = {}
    for entry in manifest.entries:
        if entry.link is None:
            _copy_file(manifest.source, entry.path, copy, made)
    for entry in manifest.entries:
        if entry.link is not None:
            _make_parents(manifest.source, entry.path, copy, made)
            os.symlink(entry.link, copy / entry.path)
    for directory in sorted(made, key=lambda path: len(path.parts), reverse=True):
        shutil.copymode(made[directory], directory)
    _log.debug(
        "snapshot of %s: %d files, %d bytes in %s",
        manifest.source,
        len(manifest.entries),
        manifest.size,
        copy,
    )


# --- the rules, one function each ------------------------------------------------------------


def _real_parent(path: Path) -> Path:
    """``path`` with its directory's links resolved but not its own name: a script that is a
    link is still found at the place the user named."""
    return Path(os.path.realpath(path.parent)) / path.name


def _with_script(names: Iterator[str], script: Path) -> Iterator[str]:
    """``names``, then the script's own name if they did not hold it (an ignored script)."""
    wanted = script.as_posix()
    seen = False
    for name in names:
        seen = seen or name == wanted
        yield name
    if not seen:
        yield wanted


def _walk(root: Path, excluded: Path) -> Iterator[str]:
    """Every file and link under ``root``, relative, not descending into links, skipped dirs
    or ``excluded`` (the log directory: thousands of checkpoint files are not worth a stat)."""
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(directory)
        for name in sorted(dirnames):
            if (here / name).is_symlink():
                yield (here / name).relative_to(root).as_posix()
        dirnames[:] = sorted(
            name
            for name in dirnames
            if name not in SKIPPED_DIRS
            and not (here / name).is_symlink()
            and here / name != excluded
        )
        for name in sorted(filenames):
            if not name.endswith(".pyc"):
                yield (here / name).relative_to(root).as_posix()


def _entry(root: Path, name: str, excluded: Path) -> Entry | None:
    """The copy's entry for ``name``, or None for what stays out (log dir, gone, not a file)."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        _log.debug("snapshot skips %r: not a path inside the project", name)
        return None
    path = root / relative
    if path == excluded or path.is_relative_to(excluded):
        return None  # earlier jobs' directories: checkpoints, logs and secrets
    try:
        info = path.lstat()
    except OSError:
        return None  # a tracked file deleted from the disk
    if stat.S_ISLNK(info.st_mode):
        return Entry(name, 0, _link_target(root, path))
    if stat.S_ISREG(info.st_mode):
        return Entry(name, info.st_size)
    _log.debug("snapshot skips %s: neither a file nor a link (a submodule?)", path)
    return None


def _link_target(root: Path, link: Path) -> str:
    """Relative to the link when the link ends inside the project, so the copy's link stays
    inside the copy; else the absolute place it reaches now. Never read through."""
    target = Path(os.path.realpath(link))
    if target == root or target.is_relative_to(root):
        return os.path.relpath(target, start=link.parent)
    return str(target)


def _copy_file(source: Path, name: str, copy: Path, made: dict[Path, Path]) -> None:
    origin = source / name
    try:
        if not stat.S_ISREG(origin.lstat().st_mode):
            _log.debug("snapshot skips %s: it is no longer a plain file", origin)
            return
        _make_parents(source, name, copy, made)
        shutil.copy2(origin, copy / name, follow_symlinks=False)
    except OSError as error:
        raise SnapshotError(
            f"'{origin}' cannot be copied into the job's code snapshot ({error.strerror}); "
            "make it readable, add it to .gitignore, or submit with --no-snapshot."
        ) from error


def _make_parents(source: Path, name: str, copy: Path, made: dict[Path, Path]) -> None:
    """The directories above ``name`` in the copy; ``made`` maps each to its source."""
    parts = PurePosixPath(name).parts[:-1]
    for depth in range(1, len(parts) + 1):
        directory = copy.joinpath(*parts[:depth])
        if directory not in made:
            directory.mkdir(exist_ok=True)
            made[directory] = source.joinpath(*parts[:depth])


def _too_big(
    root: Path, entries: list[Entry], total: int, max_mb: int, *, complete: bool
) -> SnapshotError:
    biggest = heapq.nlargest(BIGGEST_NAMED, entries, key=lambda entry: entry.size)
    named = ", ".join(f"{entry.path} ({_mb(entry.size)})" for entry in biggest)
    amount = _mb(total) if complete else f"more than {_mb(total)}"
    return SnapshotError(
        f"The code snapshot of '{root}' would hold {amount}, over the {max_mb} MB cap; its "
        f"biggest files are {named}: add them to .gitignore (or move them out of the script's "
        "directory), raise --snapshot-max-mb, or submit with --no-snapshot."
    )


def _mb(size: int) -> str:
    return f"{size / MB:.1f} MB"
