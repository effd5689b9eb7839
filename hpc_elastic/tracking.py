"""Experiment-tracker continuity: one tracker run per job, however often it is requeued.

Every worker gets the job's run id as ``HPC_ELASTIC_RUN_ID``. It is the same in every round,
on every node and after every requeue (the run id names the job directory), so a tracker keyed
on it continues one run instead of starting a new one at step 0 each time. For W&B this module
also sets ``WANDB_RUN_ID`` (derived from the run id) and ``WANDB_RESUME=allow``, which make
``wandb.init()`` resume that run, unless the user set them (``--env`` or their own
environment): a user's choice always wins. TensorBoard needs no variable: log to
``<dir>/<HPC_ELASTIC_RUN_ID>`` (``examples/tensorboard_run.py``).

Pure functions: no I/O, no third-party imports (the agent imports this).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from hpc_elastic.contract import RUN_ID_ENV

WANDB_RUN_ID_ENV = "WANDB_RUN_ID"
WANDB_RESUME_ENV = "WANDB_RESUME"
WANDB_ID_MAX = 64
"""W&B run ids are short and plain; ours can be longer (a 64-character job name, a time and
32 hex digits), so a long one is cut and a hash of the whole keeps it unique and stable."""

_NOT_WANDB = re.compile(r"[^A-Za-z0-9_-]")


def wandb_run_id(run_id: str) -> str:
    """A W&B run id that is the same for the same job every time: letters, digits, ``_``
    and ``-`` only, at most ``WANDB_ID_MAX`` characters."""
    plain = _NOT_WANDB.sub("-", run_id)
    if len(plain) <= WANDB_ID_MAX:
        return plain
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:32]
    return f"{plain[: WANDB_ID_MAX - len(digest) - 1]}-{digest}"


def tracker_env(run_id: str, base: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to a worker whose environment is otherwise ``base``."""
    added = {RUN_ID_ENV: run_id}
    if WANDB_RUN_ID_ENV not in base:
        added[WANDB_RUN_ID_ENV] = wandb_run_id(run_id)
    if WANDB_RESUME_ENV not in base:
        added[WANDB_RESUME_ENV] = "allow"
    return added
