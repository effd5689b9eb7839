"""Seal what a checkpoint is at save time with the job's secret; check the seal before anything
reads it. The one sealing module: every checkpoint manifest (shared tier, node-local tier,
peer copies, object storage) and a sharded checkpoint's ``.metadata``.

**Manifests.** Every manifest carries ``seal``: an HMAC-SHA256, keyed by the job's secret,
over the rest of the manifest (step, world size, round, and each file's size; for a sharded
checkpoint, the digest of ``.metadata`` below). A reader that holds the secret refuses a
manifest without a seal or with one that does not match, so a whole checkpoint planted where
the job looks (a node-local directory another user made first, a shared or object-storage
tier others may write) is never loaded: nobody else can make a manifest that verifies. A
reader without a secret (plain torchrun, outside the agent) has nothing to check a seal with
and accepts any manifest, as before seals existed. What a seal does not cover is said in
docs/security.md: the files' bytes beyond their sizes.

**Sharded ``.metadata``.** torch's distributed checkpoint loader unpickles ``.metadata`` (and,
as a fallback, any ``__<rank>.metadata``), so a file planted in the checkpoint directory would
run code in every rank. Rank 0 records a digest of ``.metadata`` in the manifest when it
commits; every rank checks it, and that nothing unlisted lies beside it, before calling the
loader. The digest is an HMAC-SHA256 keyed by the job's secret when the workers can read one;
without a secret it is a plain SHA-256, which still refuses a ``.metadata`` swapped under a
manifest we wrote. A reader that holds a secret accepts only the keyed kind, so a forger
cannot downgrade to it. Non-tensor values in the data files load with ``weights_only=True``
(``sharded.SafeLoadPlanner``).

The secret is ``HPC_ELASTIC_SECRET_FILE``, else ``$HPC_ELASTIC_JOB_DIR/secret`` (which
``submit`` and ``hpc-elastic run`` write). Each use keys the HMAC with its own context string,
so one seal can never stand in for another use of the secret.

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
"""Prefixed to what is keyed, so this HMAC can never be replayed as another use of the secret."""
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


def seal(data: bytes, secret: bytes | None) -> dict[str, str]:
    """The manifest entry's digest fields for a ``.metadata`` holding ``data``."""
    if secret is None:
        return {PLAIN: hashlib.sha256(data).hexdigest()}
    return {KEYED: hmac.new(secret, _CONTEXT + data, hashlib.sha256).hexdigest()}


def seal_problem(expected: Mapping[str, Any], data: bytes, secret: bytes | None) -> str | None:
    """Why ``data`` does not match the manifest entry ``expected``, or None when it does."""
    if secret is not None:
        if KEYED not in expected:
            return "it carries no digest keyed by this job's secret"
        digest = seal(data, secret)[KEYED]
        if not hmac.compare_digest(digest, str(expected[KEYED])):
            return "its digest does not match this job's secret"
        return None
    if PLAIN not in expected:
        reason = "keyed by a job secret that this worker was not given" if KEYED in expected else ""
        return f"it carries no plain digest{' (it is ' + reason + ')' if reason else ''}"
    if not hmac.compare_digest(seal(data, None)[PLAIN], str(expected[PLAIN])):
        return "its SHA-256 does not match the manifest"
    return None


def check(checkpoint: Path, files: Mapping[str, Any], secret: bytes | None) -> str | None:
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
    problem = seal_problem(expected, (checkpoint / METADATA_FILE).read_bytes(), secret)
    return None if problem is None else f"{METADATA_FILE}: {problem}"


def verify_before_load(checkpoint: Path) -> None:
    """Raise a CheckpointError unless ``checkpoint`` is sealed as ``save_sharded`` seals it."""
    try:
        manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
        files = manifest["files"] if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            raise TypeError("no files table")
        problem = check(checkpoint, files, job_secret())
    except (OSError, ValueError, KeyError, TypeError, HpcElasticError) as error:
        problem = f"its seal cannot be checked ({error})"
    if problem is not None:
        _log.debug("refusing sharded checkpoint %s: %s", checkpoint, problem)
        raise CheckpointError(
            f"Sharded checkpoint '{checkpoint}' is not trusted because {problem}; move it "
            f"aside, or set {SECRET_FILE_ENV} to the secret file of the job that wrote it."
        )
    _log.debug("sharded checkpoint %s: seal verified", checkpoint)


def metadata_entry(staging: Path) -> dict[str, Any]:
    """The manifest entry for the ``.metadata`` that ``dcp_save`` just wrote into ``staging``."""
    data = (staging / METADATA_FILE).read_bytes()
    return {"size": len(data), **seal(data, job_secret())}


def seal_manifest(manifest: Mapping[str, Any], secret: bytes | None) -> dict[str, Any]:
    """``manifest`` with its ``seal``; without a secret, as it is (nothing could check one)."""
    if secret is None:
        return dict(manifest)
    return {**manifest, MANIFEST_SEAL: {KEYED: _manifest_digest(manifest, secret)}}


def manifest_problem(manifest: Mapping[str, Any], secret: bytes | None) -> str | None:
    """Why a reader holding ``secret`` must not trust ``manifest``, or None. Without a
    secret there is nothing to check a seal with: None."""
    if secret is None:
        return None
    sealed = manifest.get(MANIFEST_SEAL)
    digest = sealed.get(KEYED) if isinstance(sealed, dict) else None
    if not isinstance(digest, str):
        return "its manifest is not sealed with this job's secret"
    body = {key: value for key, value in manifest.items() if key != MANIFEST_SEAL}
    expected = _manifest_digest(body, secret).encode()
    if not hmac.compare_digest(expected, digest.encode(errors="replace")):
        return "its manifest's seal does not match this job's secret"
    return None


def _manifest_digest(body: Mapping[str, Any], secret: bytes) -> str:
    """The HMAC of ``body`` in one canonical JSON form (sorted keys, no spaces), so the writer
    and every reader key the same bytes whatever order the JSON file holds them in. A value
    JSON cannot write (NaN from a forged file) raises ValueError: a reason, for the caller."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(secret, _MANIFEST_CONTEXT + canonical.encode(), hashlib.sha256).hexdigest()
