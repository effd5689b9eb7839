"""The key that seals a user's checkpoints: one per user, so that every job of the user
resumes from the checkpoints of the user's earlier jobs, and unknown to every other user, so
that none of them can make a checkpoint that a job of ours loads.

It is derived from the user's own secret (``$HPC_ELASTIC_USER_SECRET_FILE``, else
``~/.hpc-elastic/user-secret``: the file that also guards the bad nodes remembered across
jobs) as an HMAC-SHA256 of a fixed purpose string (``PURPOSE``) under that secret. The secret
cannot be recovered from the key, and the key is good for nothing else: the bad-node list in
ZooKeeper is guarded by the secret itself, never by a key derived from it.

``submit`` and ``hpc-elastic run`` derive it on the machine the user submits from (where the
home directory surely is, whether or not the compute nodes mount it) and write it into the job
directory as ``checkpoint-key`` (0600), beside the job's secret. The workers read it there
(``hpc_elastic.train._integrity.keys``); the user's secret never reaches them.

The user's secret is made (0600, in a 0700 directory) when it is missing, and refused, in one
sentence, when it is a link, another user's file, or readable by others (the checks of
``rendezvous/secret.read_secret_file``). Where none can be had at all (a home directory that
cannot be written, or none), the job gets no key: one warning says so, and its workers seal
with the job's own secret instead, as before there were user keys.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from hpc_elastic import contract
from hpc_elastic.errors import RendezvousError
from hpc_elastic.jobdir import write_private
from hpc_elastic.rendezvous.secret import user_secret

PURPOSE = b"hpc-elastic checkpoint seal v1"
"""What the key is for, as the HMAC's message: a new use of the user's secret gets its own
string, so no key derived for one use can stand in for another."""

_log = logging.getLogger(__name__)


def user_secret_file(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the user's secret lives: ``$HPC_ELASTIC_USER_SECRET_FILE`` or the default."""
    return Path(environ.get(contract.USER_SECRET_FILE_ENV) or contract.DEFAULT_USER_SECRET_FILE)


def derive(secret: str) -> str:
    """The checkpoint key of the user whose secret is ``secret`` (64 hex digits)."""
    return hmac.new(secret.encode(), PURPOSE, hashlib.sha256).hexdigest()


def write_key(key_file: Path, environ: Mapping[str, str] = os.environ) -> bool:
    """Write the user's checkpoint key to ``key_file`` (a new file, 0600); False, after one
    warning, when no user secret can be had, and then nothing is written.

    A user secret that exists but is not to be trusted (a link, another user's, readable by
    others) raises its ``UsageError``: the user must see to it, since it guards the bad-node
    list too, and quietly sealing with another key would only hide it.
    """
    configured = user_secret_file(environ)
    try:
        where = configured.expanduser()
        where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        secret = user_secret(where)
    except (OSError, RuntimeError, RendezvousError) as error:  # RuntimeError: no home at all
        _log.warning("%s", no_user_secret(configured, key_file.parent, error))
        return False
    write_private(key_file, derive(secret) + "\n", exclusive=True)
    _log.debug("wrote the user's checkpoint key (from %s) to %s", where, key_file)
    return True


def no_user_secret(path: Path, job_dir: Path, error: Exception) -> str:
    """The one warning of a job that gets no user key, and what it means for resuming."""
    why = getattr(error.__cause__ or error, "strerror", None) or str(error)
    return (
        f"No user secret at '{path}' ({why}), so the job in '{job_dir}' seals its checkpoints "
        f"with its own secret: a later job resumes from them only with "
        f"{contract.SECRET_FILE_ENV}={job_dir / contract.SECRET_FILE}. Make '{path}' possible "
        f"to create, or set {contract.USER_SECRET_FILE_ENV} to a file of yours, and every job "
        f"of yours shares one key."
    )
