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
- ``--snapshot-root DIR`` names the project instead (git's rules if DIR is a work tree's top).
- Never the log directory (earlier jobs' directories, checkpoints and secrets), and never a
  submodule's files (git lists a submodule as one entry; it is left out, see docs/submit.md).
- Never what holds credentials, in git or not (``SECRET_DIRS``, ``SECRET_FILES``): keys,
  cloud credentials, ``.netrc``, other jobs' directories (which hold their ``secret``), the
  user's hpc-elastic state. A job needs none of them in its copy, and each copy is one more
  place a secret lies, in every job directory for as long as it is kept.
- Never a home directory: a script lying directly in ``$HOME`` outside git would make the copy
  the whole home; that is refused, naming ``--snapshot-root`` and ``--no-snapshot``.
- The script itself, always, even where git ignores it.

Links never take the copy out of the project: a link is copied as a link, never followed. One
that points inside the project is rewritten relative, so it points inside the copy; one that
points outside keeps pointing at the same absolute place (a ``data -> /datasets/x`` link still
works, and nothing outside is read or copied). Files keep their mode bits (``copy2``).

A size cap (``--snapshot-max-mb``) stops a project that holds data or checkpoints from filling
the log directory: the error names the biggest files; a cap on the file count
(``--snapshot-max-files``) stops a tree of many small files, naming where most of them are.
``survey`` reads and decides (it is what ``--dry-run`` runs); ``take`` copies what it decided,
into a fresh directory.
"""

from __future__ import annotations

import contextlib
import fnmatch
import heapq
import logging
import os
import pwd
import shutil
import stat
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from hpc_elastic import contract, git
from hpc_elastic.contract import DEFAULT_USER_SECRET_FILE, INDEX_ENV, USER_SECRET_FILE_ENV
from hpc_elastic.errors import SnapshotError, one_line
from hpc_elastic.jobdir import JOB_FILE, SCRIPT_FILE, SECRET_FILE, CodeSnapshot, index_file

_log = logging.getLogger(__name__)

MB = 1_000_000
SKIPPED_DIRS = frozenset(
    {".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
)
"""Outside git, directories no job imports from: caches and virtual environments (a venv
alone can pass the cap). In a work tree ``.gitignore`` decides instead."""
BIGGEST_NAMED = 3
"""How many of the biggest files (or fullest directories) the caps' errors name."""

SECRET_DIRS: tuple[tuple[str, ...], ...] = (
    (".ssh",),
    (".aws",),
    (".gnupg",),
    (".config", "gcloud"),
    (".azure",),
    (".kube",),
    (".docker",),
    (".password-store",),
    (".hpc-elastic",),
    (".local", "state", "hpc-elastic"),
)
"""Directories (their last path components) that hold keys and credentials: SSH, cloud CLIs,
GnuPG, Kubernetes and Docker logins, pass, and hpc-elastic's own user secret and state."""
SECRET_FILES: tuple[str, ...] = (
    ".netrc",
    "_netrc",
    ".pgpass",
    ".git-credentials",
    ".pypirc",
    ".vault-token",
    "credentials",
    "credentials.json",
    "client_secret*.json",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "*.jks",
    "*.keystore",
    "*.ppk",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
)
"""File names (``fnmatch`` patterns) of keys and credentials: login files, TLS and SSH keys."""


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
    left_out: tuple[str, ...] = ()
    """What the copy leaves out as secrets (``SECRET_DIRS``, ``SECRET_FILES``, job
    directories), relative to ``source``; a directory ends in ``/``."""

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


def survey(
    script: Path,
    log_dir: Path,
    max_mb: int,
    *,
    max_files: int = contract.DEFAULT_SNAPSHOT_MAX_FILES,
    root: Path | None = None,
) -> Manifest:
    """Decide what the snapshot of ``script``'s project (or of ``root``) holds; reads, never
    writes.

    Raises ``SnapshotError`` for a home directory, or when the copy would hold more than
    ``max_mb`` megabytes or ``max_files`` files.
    """
    script = _real_parent(script.absolute())
    private = _private_dirs(log_dir)
    top = _work_tree(script, root)
    answer = git.survey(top) if top is not None else None
    walking = answer is None
    left_out: list[str] = []
    candidates: Iterator[str]
    if top is not None and answer is not None:
        project = Path(os.path.realpath(top))
        _refuse_a_home(project, script, root)
        names, commit, dirty = answer
        candidates = iter(_kept(names, project, left_out))
        _log.debug("snapshot of git work tree %s at %s (dirty: %s)", project, commit, dirty)
    else:
        project = _plain_root(script, root)
        _refuse_a_home(project, script, root)
        commit, dirty = None, None
        candidates = _walk(project, private, left_out)
        _log.debug("snapshot of directory %s (not a git work tree)", project)
    limit = max_mb * MB
    entries: list[Entry] = []
    total = 0
    for name in _with_script(candidates, script.relative_to(project)):
        entry = _entry(project, name, private)
        if entry is None:
            continue
        entries.append(entry)
        total += entry.size
        if walking and (total > limit or len(entries) > max_files):
            break  # a plain directory may be huge: stop walking, it is too big anyway
    if total > limit:
        raise _too_big(project, entries, total, max_mb, complete=not walking)
    if len(entries) > max_files:
        raise _too_many(project, entries, max_files, complete=not walking)
    if left_out:
        _log.debug("snapshot of %s leaves out as secrets: %s", project, ", ".join(left_out))
    return Manifest(
        project, tuple(entries), answer is not None, commit, dirty, tuple(sorted(left_out))
    )


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


def _work_tree(script: Path, root: Path | None) -> Path | None:
    """The git work tree whose rules apply: the script's, or ``root`` when it is the top of
    one (a ``--snapshot-root`` inside a work tree is copied as a plain directory)."""
    if root is None:
        return git.toplevel(script.parent)
    real = Path(os.path.realpath(root))
    top = git.toplevel(real) if real.is_dir() else None
    return top if top is not None and Path(os.path.realpath(top)) == real else None


def _plain_root(script: Path, root: Path | None) -> Path:
    """The directory copied outside git: ``root`` (which must hold the script), else the
    script's own directory."""
    if root is None:
        return script.parent
    real = Path(os.path.realpath(root))
    if not real.is_dir():
        raise SnapshotError(
            f"--snapshot-root '{one_line(str(root))}' is not a directory; give the directory "
            "that holds the script and what it imports, or submit with --no-snapshot."
        )
    if not script.is_relative_to(real):
        raise SnapshotError(
            f"--snapshot-root '{one_line(str(root))}' does not hold the script '{script}'; give "
            "a directory above the script, or submit with --no-snapshot."
        )
    return real


def homes() -> frozenset[Path]:
    """The user's home directories, links resolved: ``$HOME`` and the password database's."""
    found: set[Path] = set()
    with contextlib.suppress(RuntimeError):  # no $HOME and no password entry either
        found.add(Path.home())
    with contextlib.suppress(KeyError):
        found.add(Path(pwd.getpwuid(os.getuid()).pw_dir))
    return frozenset(Path(os.path.realpath(home)) for home in found)


def _refuse_a_home(project: Path, script: Path, root: Path | None) -> None:
    """A home directory (or a directory above one) is never copied: it holds the user's keys,
    credentials and every other job, and would be copied into each job directory."""
    home = next((home for home in sorted(homes()) if home.is_relative_to(project)), None)
    if home is None:
        return
    given = "--snapshot-root names" if root is not None else f"the script '{script}' lies in"
    raise SnapshotError(
        f"The code snapshot would copy the whole home directory '{home}' ({given} "
        f"'{project}'), keys, credentials and other jobs included; move the script into a "
        "project directory, give --snapshot-root DIR for the directory holding the script and "
        "what it imports, or submit with --no-snapshot."
    )


def _private_dirs(log_dir: Path) -> tuple[Path, ...]:
    """Absolute places never copied: the log directory (earlier jobs' checkpoints, logs and
    secrets), hpc-elastic's own directories of the user's state and secret, and the index and
    user secret files wherever the environment puts them (those files only: a variable that
    names one in the project must not hide the rest of it)."""
    without_index = {name: value for name, value in os.environ.items() if name != INDEX_ENV}
    places = [
        log_dir.absolute(),
        index_file(without_index).parent,
        index_file(),
        DEFAULT_USER_SECRET_FILE.expanduser().parent,
    ]
    if os.environ.get(USER_SECRET_FILE_ENV):
        places.append(Path(os.environ[USER_SECRET_FILE_ENV]).expanduser())
    return tuple(dict.fromkeys(Path(os.path.realpath(place)) for place in places))


def secret_dir(relative: PurePosixPath) -> bool:
    """Whether the directory ``relative`` is one that holds credentials (``SECRET_DIRS``)."""
    return any(relative.parts[-len(tail) :] == tail for tail in SECRET_DIRS)


def secret_name(relative: PurePosixPath) -> bool:
    """Whether a file at ``relative`` is, or lies in, what holds credentials."""
    if any(fnmatch.fnmatchcase(relative.name, pattern) for pattern in SECRET_FILES):
        return True
    return any(
        secret_dir(PurePosixPath(*relative.parts[:depth]))
        for depth in range(1, len(relative.parts))
    )


def is_job_dir(names: Collection[str]) -> bool:
    """Whether a directory holding files named ``names`` is an hpc-elastic job directory: its
    ``job.json`` beside its ``secret`` or its ``sbatch.sh`` (another log directory's job)."""
    return JOB_FILE in names and (SECRET_FILE in names or SCRIPT_FILE in names)


def _kept(names: list[str], root: Path, left_out: list[str]) -> list[str]:
    """git's list minus what holds credentials, and minus other jobs' directories (a log
    directory that git does not ignore: ``--log-dir`` was changed since it was made)."""
    jobs = _job_dirs(names, root)
    kept = []
    for name in names:
        relative = PurePosixPath(name)
        job = next((job for job in jobs if relative.is_relative_to(job)), None)
        if job is not None:
            left_out.append(f"{job}/")
        elif secret_name(relative):
            left_out.append(name)
        else:
            kept.append(name)
    left_out[:] = list(dict.fromkeys(left_out))
    return kept


def _job_dirs(names: list[str], root: Path) -> set[PurePosixPath]:
    """The job directories among git's names: each listed ``job.json`` whose directory holds
    what a job directory holds (``is_job_dir``), the project's top excepted."""
    found = set()
    for name in names:
        path = PurePosixPath(name)
        if path.name != JOB_FILE or path.parent == PurePosixPath("."):
            continue
        try:
            inside = os.listdir(root / path.parent)
        except OSError:
            continue
        if is_job_dir(inside):
            found.add(path.parent)
    return found


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


def _walk(root: Path, private: tuple[Path, ...], left_out: list[str]) -> Iterator[str]:
    """Every file and link under ``root``, relative, not descending into links, skipped dirs,
    ``private`` directories (the log directory: thousands of checkpoint files are not worth a
    stat), directories that hold credentials or are other jobs' (noted in ``left_out``)."""
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(directory)
        relative = here.relative_to(root)
        if here != root and is_job_dir(filenames):
            left_out.append(f"{relative.as_posix()}/")
            dirnames[:] = []
            continue
        for name in sorted(dirnames):
            if (here / name).is_symlink():
                yield (relative / name).as_posix()
        kept = []
        for name in sorted(dirnames):
            if name in SKIPPED_DIRS or (here / name).is_symlink() or here / name in private:
                continue
            if secret_dir(PurePosixPath(relative.as_posix(), name)):
                left_out.append(f"{(relative / name).as_posix()}/")
                continue
            kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            if name.endswith(".pyc"):
                continue
            if secret_name(PurePosixPath(name)):
                left_out.append((relative / name).as_posix())
                continue
            yield (relative / name).as_posix()


def _entry(root: Path, name: str, private: tuple[Path, ...]) -> Entry | None:
    """The copy's entry for ``name``, or None for what stays out (log dir, gone, not a file)."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        _log.debug("snapshot skips %r: not a path inside the project", name)
        return None
    path = root / relative
    if any(path == place or path.is_relative_to(place) for place in private):
        return None  # earlier jobs' directories, the user's secret and state
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


def _too_many(root: Path, entries: list[Entry], max_files: int, *, complete: bool) -> SnapshotError:
    by_top = Counter(
        f"{PurePosixPath(entry.path).parts[0]}/" if "/" in entry.path else "." for entry in entries
    )
    named = ", ".join(f"'{top}' ({count})" for top, count in by_top.most_common(BIGGEST_NAMED))
    amount = f"{len(entries)} files" if complete else f"more than {max_files} files"
    return SnapshotError(
        f"The code snapshot of '{root}' would hold {amount}, over the {max_files}-file cap; "
        f"most are in {named}: add them to .gitignore (or move them out of the script's "
        "directory), raise --snapshot-max-files, give --snapshot-root DIR, or submit with "
        "--no-snapshot."
    )


def _mb(size: int) -> str:
    return f"{size / MB:.1f} MB"
