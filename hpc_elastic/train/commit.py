"""The commit protocol of a checkpoint location: how a checkpoint becomes committed, which
writer may commit, and which checkpoints are kept.

``Checkpointer`` (checkpoint.py) decides what a save writes and what a load reads; this
module decides how the location changes, so that a crash cannot corrupt it and a requeue
cannot confuse it:

- staging: a writer writes a step under a hidden name (``Commits.prepare_staging``), and
  removes the half-written leftovers of its own round and older ones first;
- fencing: every load, staging and commit claims the location for the writer's round with an
  empty marker file ``.round-<job>-<N>``, and refuses a writer whose round is older than the
  newest mark of its job (``fenced``), under the directory's lock (``_locked``);
- the commit: the manifest (file sizes, sealed with the job's keys) is written and fsynced,
  then the staging directory is renamed into place (``Commits.commit``), so a committed name
  always holds a complete checkpoint;
- verify: a committed name is trusted only when its manifest's seal, step and every file's
  size and CRC-32 hold (``verify``); readers take the newest that does
  (``Commits.newest_intact``) and fall back past corrupt ones;
- cleanup: retention removes what ``retained`` does not keep, unless a reader holds it open
  (``remove_unless_read``, ``reading``).

In object storage (``ObjectCommits``) there is no rename and no lock: the manifest, written
last, is the commit, and a prefix without one is uncommitted and removed by the next save.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import logging
import os
import re
import shutil
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hpc_elastic.errors import CheckpointError, CheckpointFencedError
from hpc_elastic.protocol import lease
from hpc_elastic.train import _integrity, local_tier, storage

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".lock"
LOCK_TIMEOUT = 60.0
"""Seconds to wait for another writer's commit; it holds the lock for a few renames only."""
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)
"""What ``flock`` fails with where the filesystem has no locks (EBADF: NFS refuses an
exclusive lock on a descriptor opened read-only); the caller then goes ahead unlocked."""
_COMMITTED = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")
_HIDDEN_ROUND = re.compile(r"^\.step-\d{8,}\.[a-z]+\d*-r(\d+)-j([0-9a-f]{8})-p\d+$")
_ROUND_MARK = re.compile(r"^\.round-([0-9a-f]{8})-(\d{8,})$")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Commits:
    """The commit protocol of one checkpoint directory on a filesystem.

    ``Checkpointer`` builds one for each use (``Checkpointer._commits``); it holds no state of
    its own but the location and the writer's settings: everything else is on disk.
    """

    directory: Path
    fencing_round: Callable[[], int | None]
    """The round this writer's commits carry and are fenced by (None: no fencing), asked at
    every use: ``InPlace`` may move the process into another round under the running loop
    (``Checkpointer.fencing_round``)."""
    job: str = ""
    """Rounds are only compared with rounds of the same job (``Checkpointer.job``)."""
    keep: int = 1
    keep_every: int = 0
    private_root: Path | None = None
    """The node-local tier's root, whose tree must be ours (``Checkpointer.private_root``)."""

    @property
    def where(self) -> str:
        """The location as users wrote it, for messages."""
        return str(self.directory)

    # --- reading: what is committed, and what can be trusted ----------------------------

    def committed(self) -> list[Path]:
        """Committed checkpoints, newest (highest step, then latest re-save) first."""
        if self.private_root is not None and not local_tier.private_tree(
            self.private_root, self.directory, create=False
        ):
            return []
        try:
            names = [entry.name for entry in self.directory.iterdir()]
        except FileNotFoundError:
            return []
        paths = [self.directory / name for name in names if _parse_committed(name)]
        return sorted(paths, key=step_and_version, reverse=True)

    def newest_intact(self) -> Path | str | None:
        """Rank 0's choice: a path, None for a fresh start, or why nothing can be trusted."""
        candidates = self.committed()
        newest_problem = ""
        for candidate in candidates:
            problem = self._verify(candidate)
            if problem is None:
                return candidate
            newest_problem = newest_problem or f"{candidate.name}: {problem}"
            log.warning(
                "Checkpoint '%s' is unusable (%s); falling back to the previous one.",
                candidate,
                problem,
            )
        if candidates:
            another_job = ""
            if _integrity.keys():
                another_job = (
                    f", or, if a job of yours sealed them with its own secret, set "
                    f"{_integrity.SECRET_FILE_ENV} to that job's secret file"
                )
            return (
                f"No intact checkpoint in '{self.where}' ({len(candidates)} unusable; the newest, "
                f"{newest_problem}); move them aside to start from scratch{another_job}."
            )
        return None

    def newest_or_raise(self) -> str | None:
        """The newest intact checkpoint's path as text, None for a fresh start, or an error."""
        chosen = self.newest_intact()
        if isinstance(chosen, str):
            raise CheckpointError(chosen)
        return None if chosen is None else str(chosen)

    def claim_for_load(self) -> None:
        """Claim the location for this writer's round before a load: from then on, every
        writer of an older round is refused."""
        if self.fencing_round() is not None:
            self._make_directory()
            with self._exclusive():
                self._claim_round("load a checkpoint")

    # --- writing: staging, committing, cleaning up ---------------------------------------

    def prepare_staging(self, step: int) -> Path:
        """A fresh hidden directory to write ``step`` into; removes half-written leftovers.

        Only leftovers of this writer's round or older ones go: a newer round's staging belongs
        to a writer that is alive and current. Claiming the round here (under the directory's
        lock) is what fences any older writer still running.
        """
        self._make_directory()
        with self._exclusive():
            self._claim_round(f"commit step {step}")
        for leftover in self.directory.glob(".step-*"):
            if may_remove(self._leftover_round(leftover.name), self.fencing_round()):
                log.debug("removing leftover %s", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        staging = self.directory / self._hidden(step, "tmp")
        staging.mkdir(mode=0o700 if self.private_root is not None else 0o777)
        log.debug("staging step %d in %s", step, staging)
        return staging

    def abandon(self, staging: Path) -> None:
        """Remove the staging directory of a write that failed: a full disk must not stay
        full of it."""
        shutil.rmtree(staging, ignore_errors=True)

    def commit(
        self, staging: Path, step: int, world_size: int, files: dict[str, dict[str, Any]]
    ) -> Path:
        """Seal ``staging`` with its manifest and rename it into place; then drop the oldest.

        A stale lease exits here without committing; a stale round is refused (and its own
        staging removed) under the directory's lock, so no newer writer can slip in between.
        """
        manifest: dict[str, Any] = {"format": FORMAT_VERSION, "step": step}
        manifest.update(world_size=world_size, round=self.fencing_round(), files=files)
        manifest = _integrity.seal_manifest(manifest, _integrity.keys())
        lease.check(force=True)
        with self._exclusive():
            try:
                self._claim_round(f"commit step {step}")
            except CheckpointFencedError:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            write_synced(staging / MANIFEST_FILE, json.dumps(manifest).encode(), self.file_mode)
            _fsync_directory(staging)
            final = self._install(staging, step)
        log.debug("committed step %d as %s (round %s)", step, final, self.fencing_round())
        for old in self._beyond_keep():
            self._remove_old(old)
        return final

    def _install(self, staging: Path, step: int) -> Path:
        """Rename ``staging`` into place so that a committed copy of the step always exists.

        A step saved again is first committed under a higher version (``step-N.1``), which
        readers prefer; only then is the old copy moved aside and the new one renamed to the
        plain name. A crash between any two renames leaves the old or the new copy committed.
        """
        final = self.directory / checkpoint_name(step)
        previous = self._versions(step)
        if not previous:
            os.rename(staging, final)
            _fsync_directory(self.directory)
            return final
        version = max(step_and_version(path)[1] for path in previous) + 1
        newer = self.directory / f"{checkpoint_name(step)}.{version}"
        os.rename(staging, newer)
        _fsync_directory(self.directory)
        replaced = []
        for index, old in enumerate(previous):
            aside = self.directory / self._hidden(step, f"old{index}")
            os.rename(old, aside)
            replaced.append(aside)
        os.rename(newer, final)
        _fsync_directory(self.directory)
        for aside in replaced:
            shutil.rmtree(aside, ignore_errors=True)
        return final

    def _versions(self, step: int) -> list[Path]:
        return [path for path in self.committed() if step_and_version(path)[0] == step]

    def _beyond_keep(self) -> list[Path]:
        """Every copy of every step that ``retained`` does not keep."""
        committed = self.committed()
        kept = retained(
            [step_and_version(path)[0] for path in committed], self.keep, self.keep_every
        )
        return [path for path in committed if step_and_version(path)[0] not in kept]

    # --- fencing: the round marks ---------------------------------------------------------

    def _claim_round(self, doing: str) -> None:
        """Refuse a round older than the newest that used the directory; else record ours.

        A round claims the directory when it loads, stages and commits, so an older round's
        writer is refused from the moment a newer round started. The marks are empty files
        ``.round-<job>-<N>``: creating one is atomic on every filesystem. Older marks of this
        job, and every mark of another (finished) job, are dropped.
        """
        round_ = self.fencing_round()
        if round_ is None:
            return
        tag = _job_tag(self.job)
        marks = self._marks()
        newest = self.refuse_if_stale(doing, marks)
        if newest != round_:
            self._add_mark(_round_mark(tag, round_))
            log.debug("round %d of job %r claims %s", round_, self.job, self.where)
        for job, number in marks:
            if job != tag or number < round_:
                self._drop_mark(_round_mark(job, number))

    def refuse_if_stale(self, doing: str, marks: list[tuple[str, int]] | None = None) -> int | None:
        """Raise ``CheckpointFencedError`` if a newer round of this job used the directory;
        else return the newest round that did (None when none did)."""
        round_ = self.fencing_round()
        if round_ is None:
            return None
        tag = _job_tag(self.job)
        if marks is None:
            marks = self._marks()
        newest = max((number for job, number in marks if job == tag), default=None)
        if fenced(round_, newest):
            raise CheckpointFencedError(
                f"Round {round_} may not {doing} in '{self.where}': round {newest} "
                f"of the same job has used it since, so this worker belongs to a replaced "
                f"round; stop it and let the agent restart it."
            )
        return newest

    def _leftover_round(self, name: str) -> int | None:
        """The round of a staging or set-aside name; None for no round or another job's."""
        match = _HIDDEN_ROUND.match(name)
        if match is None or match.group(2) != _job_tag(self.job):
            return None
        return int(match.group(1))

    # --- what differs in object storage (``ObjectCommits``) -------------------------------

    def _marks(self) -> list[tuple[str, int]]:
        return _round_marks(self.directory)

    def _add_mark(self, name: str) -> None:
        (self.directory / name).touch()
        _fsync_directory(self.directory)

    def _drop_mark(self, name: str) -> None:
        (self.directory / name).unlink(missing_ok=True)

    def _verify(self, checkpoint: Path) -> str | None:
        return verify(checkpoint)

    def _remove_old(self, checkpoint: Path) -> None:
        remove_unless_read(checkpoint)

    # --- the directory itself ---------------------------------------------------------------

    def _make_directory(self) -> None:
        """``directory`` and the directories above it that are missing, before writing."""
        if self.private_root is None:
            self.directory.mkdir(parents=True, exist_ok=True)
        else:
            local_tier.private_tree(self.private_root, self.directory, create=True)

    @property
    def file_mode(self) -> int:
        """The mode files are created with (the umask narrows it): the local tier's are 0600."""
        return 0o600 if self.private_root is not None else 0o666

    def _exclusive(self) -> AbstractContextManager[None]:
        """The directory's commit lock, needed only where rounds are fenced (under the agent)."""
        return _locked(self.directory) if self.fencing_round() is not None else nullcontext()

    def _hidden(self, step: int, kind: str) -> str:
        """A hidden name no other writer uses: its round (when known) and this process."""
        owner = f"p{os.getpid()}"
        round_ = self.fencing_round()
        if round_ is not None:
            owner = f"r{round_}-j{_job_tag(self.job)}-{owner}"
        return f".{checkpoint_name(step)}.{kind}-{owner}"


@dataclass(frozen=True, kw_only=True)
class ObjectCommits(Commits):
    """The commit protocol in object storage (``s3://bucket/prefix``): the manifest, written
    last, is the commit (``ObjectCheckpointer`` says what that can and cannot give)."""

    store: storage.ObjectStore

    @property
    def where(self) -> str:
        return self.store.url

    def committed(self) -> list[Path]:
        """Checkpoints whose manifest exists, newest first."""
        store = self.store
        names = [name for name in store.names() if _parse_committed(name)]
        paths = [
            self.directory / name for name in names if store.exists(store.key(name, MANIFEST_FILE))
        ]
        return sorted(paths, key=step_and_version, reverse=True)

    def claim_for_load(self) -> None:
        if self.fencing_round() is not None:
            self._claim_round("load a checkpoint")

    def prepare_staging(self, step: int) -> Path:
        raise CheckpointError(
            f"Sharded checkpoints cannot go to object storage yet ('{self.where}'); give "
            f"save_sharded a shared filesystem directory."
        )

    def upload(self, step: int, world_size: int, serialise: Callable[[], bytes]) -> Path:
        """Upload the state (``serialise``'s bytes), then the manifest (the commit), then drop
        what it replaces."""
        store = self.store
        doing = f"commit step {step}"
        self._claim_round(doing)
        previous = self._versions(step)
        version = max((step_and_version(path)[1] for path in previous), default=-1) + 1
        name = checkpoint_name(step) if not previous else f"{checkpoint_name(step)}.{version}"
        self._remove_uncommitted()
        data = serialise()
        store.put(store.key(name, STATE_FILE), data)
        manifest: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
        }
        manifest.update(
            round=self.fencing_round(), files={STATE_FILE: {"size": len(data), "zip_crc32": True}}
        )
        manifest = _integrity.seal_manifest(manifest, _integrity.keys())
        lease.check(force=True)
        self.refuse_if_stale(doing)
        store.put(store.key(name, MANIFEST_FILE), json.dumps(manifest).encode())
        round_ = self.fencing_round()
        log.debug("committed step %d as %s/%s (round %s)", step, self.where, name, round_)
        for old in previous:
            store.remove(store.key(old.name))
        for old in self._beyond_keep():
            self._remove_old(old)
        return self.directory / name

    def _remove_uncommitted(self) -> None:
        """Prefixes a killed writer left without a manifest: nobody trusts them; drop them."""
        committed = {path.name for path in self.committed()}
        for name in self.store.names():
            if _parse_committed(name) and name not in committed:
                log.debug("removing uncommitted %s/%s", self.where, name)
                self.store.remove(self.store.key(name))

    def _verify(self, checkpoint: Path) -> str | None:
        """As ``verify``: the manifest's format, seal and step, every object's size, the
        zip's CRC-32s."""
        store = self.store
        return verify_files(
            lambda: store.get(store.key(checkpoint.name, MANIFEST_FILE)),
            lambda name: store.size(store.key(checkpoint.name, name)),
            lambda name: io.BytesIO(store.get(store.key(checkpoint.name, name))),
            step=step_and_version(checkpoint)[0],
        )

    def _remove_old(self, checkpoint: Path) -> None:
        log.debug("removing %s/%s (beyond the retention policy)", self.where, checkpoint.name)
        self.store.remove(self.store.key(checkpoint.name))

    def _marks(self) -> list[tuple[str, int]]:
        return [
            (match.group(1), int(match.group(2)))
            for name in self.store.names()
            if (match := _ROUND_MARK.match(name))
        ]

    def _add_mark(self, name: str) -> None:
        self.store.put(self.store.key(name), b"")

    def _drop_mark(self, name: str) -> None:
        self.store.remove(self.store.key(name))


# --- the rules ------------------------------------------------------------------------------


def retained(steps: list[int], keep: int, keep_every: int) -> set[int]:
    """The retention rule: the newest ``keep`` steps, plus every positive multiple of
    ``keep_every`` (0: none). ``keep`` is at least 1, so the newest step is always kept."""
    newest_first = sorted(set(steps), reverse=True)
    kept = set(newest_first[: max(keep, 1)])
    if keep_every > 0:
        kept.update(step for step in newest_first if step > 0 and step % keep_every == 0)
    return kept


def fenced(round_: int, newest: int | None) -> bool:
    """The fencing rule: a writer is stale once a newer round has begun writing."""
    return newest is not None and round_ < newest


def may_remove(leftover_round: int | None, round_: int | None) -> bool:
    """Whose leftovers a writer removes: its own round's and older ones, never a newer round's.

    A writer without a round (plain torchrun) only removes leftovers without one.
    """
    if round_ is None:
        return leftover_round is None
    return leftover_round is None or leftover_round <= round_


# --- retention against readers ----------------------------------------------------------------


def remove_unless_read(checkpoint: Path) -> bool:
    """Delete ``checkpoint`` unless a reader holds it open (``reading``); True if deleted.

    The lock is taken without waiting: retention must never stall a save for an evaluator
    that reads slowly, and the checkpoint it skips is deleted by a later save. The checkpoint
    is first renamed to a hidden name, so a crash in the middle of deleting its files leaves
    a leftover that the next save removes, never a committed name with half its files.
    """
    try:
        descriptor = os.open(checkpoint, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.debug("keeping %s for now: a reader has it open", checkpoint)
            return False
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                raise
        log.debug("removing %s (beyond the retention policy)", checkpoint)
        aside = checkpoint.with_name(f".{checkpoint.name}.del-p{os.getpid()}")
        os.rename(checkpoint, aside)
        _fsync_directory(checkpoint.parent)
        shutil.rmtree(aside, ignore_errors=True)
        return True
    finally:
        os.close(descriptor)


@contextmanager
def reading(checkpoint: Path) -> Iterator[Path]:
    """Hold ``checkpoint`` open for reading: retention skips it until the block ends.

    A shared ``flock`` on the checkpoint's directory; any number of readers may hold it. Use
    it around your own reads (an evaluation job reading the training's checkpoints); ``load``
    already does. Where the filesystem has no locks, reading goes ahead unprotected.
    """
    descriptor = os.open(checkpoint, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH)
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                raise
            log.warning("Cannot lock '%s' (%s); reading it unprotected.", checkpoint, error)
        yield checkpoint
    finally:
        os.close(descriptor)


# --- verifying ---------------------------------------------------------------------------------


def verify(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be trusted, or None when its manifest's seal holds and every
    file is whole and intact.

    Sizes catch truncation; for ``torch.save`` files the CRC-32 that torch already stores for
    every record in the zip catches corruption, so saving pays for no checksum of its own.
    """
    return verify_files(
        (checkpoint / MANIFEST_FILE).read_bytes,
        lambda name: (checkpoint / name).stat().st_size,
        lambda name: checkpoint / name,
        step=step_and_version(checkpoint)[0] if _parse_committed(checkpoint.name) else None,
    )


def verify_files(
    manifest: Callable[[], bytes],
    size_of: Callable[[str], int],
    zip_of: Callable[[str], Path | IO[bytes]],
    step: int | None = None,
) -> str | None:
    """The rule behind ``verify``, wherever the files live (a directory, an object store):
    the manifest's format, its seal (with the keys the job holds, ``_integrity.manifest_problem``)
    and its step (``step``: the one its name says), then every file's size and, for zips,
    every record's CRC-32."""
    try:
        found = json.loads(manifest())
        if found.get("format") != FORMAT_VERSION:
            return f"format {found.get('format')!r} is not {FORMAT_VERSION}"
        if (unsealed := _integrity.manifest_problem(found, _integrity.keys())) is not None:
            return unsealed
        if step is not None and found.get("step") != step:
            return f"its manifest is of step {found.get('step')!r:.40}, not {step}"
        for name, expected in found["files"].items():
            size = size_of(name)
            if size != expected["size"]:
                return f"{name} truncated: {size} of {expected['size']} bytes"
            if expected.get("zip_crc32"):
                with zipfile.ZipFile(zip_of(name)) as archive:
                    if (bad := archive.testzip()) is not None:
                        return f"{name} record '{bad}' fails its CRC-32"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile) as error:
        return f"unreadable: {error}"
    return None


# --- names ---------------------------------------------------------------------------------


def checkpoint_name(step: int) -> str:
    """The committed name of ``step``: ``step-00000020``."""
    return f"step-{step:08d}"


def _parse_committed(name: str) -> tuple[int, int] | None:
    """``(step, version)`` of a committed name: ``step-N`` is version 0, ``step-N.V`` is V."""
    match = _COMMITTED.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def step_and_version(path: Path) -> tuple[int, int]:
    """The sort key of a committed checkpoint (callers pass committed names only)."""
    parsed = _parse_committed(path.name)
    if parsed is None:
        raise ValueError(f"'{path}' is not a committed checkpoint name")
    return parsed


def _job_tag(job: str) -> str:
    """A short, filename-safe stand-in for the job's id."""
    return f"{zlib.crc32(job.encode()):08x}"


def _round_mark(tag: str, round_: int) -> str:
    return f".round-{tag}-{round_:08d}"


def _round_marks(directory: Path) -> list[tuple[str, int]]:
    return [
        (match.group(1), int(match.group(2)))
        for entry in directory.iterdir()
        if (match := _ROUND_MARK.match(entry.name))
    ]


# --- the filesystem's guarantees -------------------------------------------------------------


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold the directory's commit lock: checking the round and renaming are one step then.

    ``flock`` works on local filesystems and NFS; where it is not supported the commit goes
    ahead unlocked (a warning says so). The wait is bounded: a writer that holds the lock
    longer than ``LOCK_TIMEOUT`` is stopped or frozen, and this one gives up with an error.
    """
    descriptor = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"Another writer held '{directory / LOCK_FILE}' for over "
                        f"{LOCK_TIMEOUT:g} s; find the stopped process that holds it and end it."
                    ) from None
                time.sleep(0.01)
            except OSError as error:
                if error.errno not in _NO_LOCKS:
                    raise
                log.warning("Cannot lock '%s' (%s); committing without it.", directory, error)
                break
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def write_synced(path: Path, data: bytes, mode: int = 0o666) -> None:
    """``data`` in ``path``, fsynced; a new file gets ``mode`` (less the umask)."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
