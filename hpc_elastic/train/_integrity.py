"""Seal what a checkpoint is at save time with the user's checkpoint key; check the seal before
anything reads it. The one sealing module: every checkpoint manifest (shared tier, node-local
tier, peer copies, object storage) and a sharded checkpoint's ``.metadata``.

**Keys** (``keys``). The workers seal with the user's checkpoint key, which ``submit`` and
``hpc-elastic run`` derive from the user's own secret and write into the job directory
(``$HPC_ELASTIC_JOB_DIR/checkpoint-key``, see ``hpc_elastic.checkpoint_key``): the same for every
job of the user, so a new job resumes from the checkpoints of an earlier one, and unknown to
every other user. A job directory without one (no user secret could be had, or an agent
started by hand) seals with the job's secret instead: ``HPC_ELASTIC_SECRET_FILE``, else
``$HPC_ELASTIC_JOB_DIR/secret``. A reader accepts a seal made with any key it holds, the
user's and the job's: each is known to the user alone, so accepting either lets nobody else
in, and the job's secret is what a job without a user key sealed with (name another job's
with ``HPC_ELASTIC_SECRET_FILE`` to load its checkpoints).

**Manifests.** Every manifest carries ``seal``: an HMAC-SHA256, keyed by the sealing key,
over the rest of the manifest (step, world size, round, and each file's size; for a sharded
checkpoint, the digest of ``.metadata`` below). A reader that holds a key refuses a manifest
without a seal or with one that matches none of its keys, so a whole checkpoint planted where
the job looks (a node-local directory another user made first, a shared or object-storage
tier others may write) is never loaded: nobody else can make a manifest that verifies. A
reader without any key (plain torchrun, outside the agent) has nothing to check a seal with
and accepts any manifest, as before seals existed. What a seal does not cover is said in
docs/security.md: the files' bytes beyond their sizes.

**Sharded ``.metadata``.** torch's distributed checkpoint loader unpickles ``.metadata`` (and,
as a fallback, any ``__<rank>.metadata``), so a file planted in the checkpoint directory would
run code in every rank. Rank 0 records a digest of ``.metadata`` in the manifest when it
commits; every rank checks it, and that nothing unlisted lies beside it, before calling the
loader. The digest is an HMAC-SHA256 keyed by the sealing key when the workers hold one;
without a key it is a plain SHA-256, which still refuses a ``.metadata`` swapped under a
manifest we wrote. A reader that holds a key accepts only the keyed kind, so a forger
cannot downgrade to it. Non-tensor values in the data files load with ``weights_only=True``
(``sharded.SafeLoadPlanner``).

Each use keys the HMAC with its own context string, so one seal can never stand in for
another use of the key.

This module imports no torch (``SafeLoadPlanner`` lives in ``sharded``, with DCP), so the
replicated checkpoints' import stays as light as it was.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_elastic import contract
from hpc_elastic.errors import CheckpointError, HpcElasticError
from hpc_elastic.rendezvous.secret import read_secret_file

SECRET_FILE_ENV = contract.SECRET_FILE_ENV
JOB_DIR_ENV = contract.JOB_DIR_ENV
METADATA_FILE = ".metadata"
MANIFEST_FILE = "manifest.json"
KEYED = "hmac_sha256"
PLAIN = "sha256"
MANIFEST_SEAL = "seal"
_CONTEXT = b"hpc-elastic sharded checkpoint metadata v1\0"
"""Prefixed to what is keyed, so this HMAC can never be replayed as another use of the key."""
_MANIFEST_CONTEXT = b"hpc-elastic checkpoint manifest v1\0"
"""The same for a manifest's seal."""

_log = logging.getLogger(__name__)


def job_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The job's secret as the workers see it, or None when they were given none."""
    configured = environ.get(SECRET_FILE_ENV)
    if configured:
        return read_secret_file(Path(configured)).encode()
    job_dir = environ.get(JOB_DIR_ENV)
    if job_dir and (Path(job_dir) / contract.SECRET_FILE).is_file():
        return read_secret_file(Path(job_dir) / contract.SECRET_FILE).encode()
    return None


def user_key(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The user's checkpoint key in the job directory, or None when it holds none. A link or
    a file that is not the user's alone is refused (``read_secret_file``), never skipped."""
    job_dir = environ.get(JOB_DIR_ENV)
    if not job_dir:
        return None
    path = Path(job_dir) / contract.CHECKPOINT_KEY_FILE
    if not os.path.lexists(path):
        return None
    return read_secret_file(path).encode()


def keys(environ: Mapping[str, str] = os.environ) -> tuple[bytes, ...]:
    """The keys this worker holds, the one it seals with first: the user's checkpoint key,
    then the job's secret; empty when it holds none (then nothing is sealed or checked)."""
    held = [key for key in (user_key(environ), job_secret(environ)) if key is not None]
    return tuple(dict.fromkeys(held))


def seal(data: bytes, held: tuple[bytes, ...]) -> dict[str, str]:
    """The manifest entry's digest fields for a ``.metadata`` holding ``data``."""
    if not held:
        return {PLAIN: hashlib.sha256(data).hexdigest()}
    return {KEYED: _metadata_digest(data, held[0])}


def seal_problem(expected: Mapping[str, Any], data: bytes, held: tuple[bytes, ...]) -> str | None:
    """Why ``data`` does not match the manifest entry ``expected``, or None when it does."""
    if held:
        if KEYED not in expected:
            return "it carries no keyed digest"
        found = str(expected[KEYED]).encode(errors="replace")
        if not any(
            hmac.compare_digest(_metadata_digest(data, key).encode(), found) for key in held
        ):
            return "its digest matches no key this job holds"
        return None
    if PLAIN not in expected:
        reason = "keyed, and this worker holds no key" if KEYED in expected else ""
        return f"it carries no plain digest{' (it is ' + reason + ')' if reason else ''}"
    if not hmac.compare_digest(seal(data, ())[PLAIN], str(expected[PLAIN])):
        return "its SHA-256 does not match the manifest"
    return None


def _metadata_digest(data: bytes, key: bytes) -> str:
    return hmac.new(key, _CONTEXT + data, hashlib.sha256).hexdigest()


def check(checkpoint: Path, files: Mapping[str, Any], held: tuple[bytes, ...]) -> str | None:
    """Why torch must not read ``checkpoint``, or None: ``files`` is its manifest's table."""
    unlisted = sorted(
        entry.name
        for entry in checkpoint.iterdir()
        if entry.name not in files and entry.name != MANIFEST_FILE
    )
    if unlisted:
        return f"it holds files its manifest does not list ({', '.join(unlisted)[:200]})"
    expected = files.get(METADATA_FILE)
    if not isinstance(expected, dict):
        return f"its manifest lists no {METADATA_FILE}"
    problem = seal_problem(expected, (checkpoint / METADATA_FILE).read_bytes(), held)
    return None if problem is None else f"{METADATA_FILE}: {problem}"


def verify_before_load(checkpoint: Path) -> None:
    """Raise a CheckpointError unless ``checkpoint`` is sealed as ``save_sharded`` seals it."""
    try:
        manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
        files = manifest["files"] if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            raise TypeError("no files table")
        problem = check(checkpoint, files, keys())
    except (OSError, ValueError, KeyError, TypeError, HpcElasticError) as error:
        problem = f"its seal cannot be checked ({error})"
    if problem is not None:
        _log.debug("refusing sharded checkpoint %s: %s", checkpoint, problem)
        raise CheckpointError(
            f"Sharded checkpoint '{checkpoint}' is not trusted because {problem}; move it "
            f"aside, or, if a job of yours sealed it with its own secret, set "
            f"{SECRET_FILE_ENV} to that job's secret file."
        )
    _log.debug("sharded checkpoint %s: seal verified", checkpoint)


def metadata_entry(staging: Path) -> dict[str, Any]:
    """The manifest entry for the ``.metadata`` that ``dcp_save`` just wrote into ``staging``."""
    data = (staging / METADATA_FILE).read_bytes()
    return {"size": len(data), **seal(data, keys())}


def seal_manifest(manifest: Mapping[str, Any], held: tuple[bytes, ...]) -> dict[str, Any]:
    """``manifest`` with its ``seal`` by the first of ``held``; without a key, as it is
    (nothing could check one)."""
    if not held:
        return dict(manifest)
    return {**manifest, MANIFEST_SEAL: {KEYED: _manifest_digest(manifest, held[0])}}


def manifest_problem(manifest: Mapping[str, Any], held: tuple[bytes, ...]) -> str | None:
    """Why a reader holding the keys ``held`` must not trust ``manifest``, or None. Without a
    key there is nothing to check a seal with: None."""
    if not held:
        return None
    sealed = manifest.get(MANIFEST_SEAL)
    digest = sealed.get(KEYED) if isinstance(sealed, dict) else None
    if not isinstance(digest, str):
        return "its manifest is not sealed"
    body = {key: value for key, value in manifest.items() if key != MANIFEST_SEAL}
    found = digest.encode(errors="replace")
    if not any(hmac.compare_digest(_manifest_digest(body, key).encode(), found) for key in held):
        return "its manifest's seal matches no key this job holds"
    return None


def _manifest_digest(body: Mapping[str, Any], key: bytes) -> str:
    """The HMAC of ``body`` in one canonical JSON form (sorted keys, no spaces), so the writer
    and every reader key the same bytes whatever order the JSON file holds them in. A value
    JSON cannot write (NaN from a forged file) raises ValueError: a reason, for the caller."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(key, _MANIFEST_CONTEXT + canonical.encode(), hashlib.sha256).hexdigest()
