"""A node-local checkpoint tier: fast saves that survive a lost node, the shared tier written less.

With ``local_directory`` set (``$HPC_ELASTIC_LOCAL_CHECKPOINT_DIR``: node-local disk, /tmp or
NVMe), every rank writes each checkpoint to its own ``<local>/rank-<R>/`` with the same
atomic commit as the shared tier, and the shared (or object-storage) tier is written only at
every ``persist_every``-th save.

Replicated (DDP) state is the same on every rank, and the payload carries every rank's RNG
state, so each rank's local copy is complete. That makes the peer copy a matter of loading:
a rank whose local copy is missing or older (its node was replaced) receives the newest copy
over the process group from the lowest rank that holds it. One lost node therefore loses no
state while any other node survives, and the shared tier is read only when no rank holds a
local copy at least as new as the shared tier's newest.

Sharded state (FSDP, tensor parallel) differs on every rank, so no rank can stand in for
another: rank R writes its own shard locally and sends a copy to its ring neighbour on the
next node (``ring_neighbour``), which commits it on its own disk. A restart loads each shard
from the rank that owns it when that rank still has it, else from the neighbour's copy, else
from the shared tier (``choose_shard_sources``; see ``hpc_elastic.train.sharded_local``).

Under ``--grace-action local`` (the agents found that a whole save no longer fits the time
Slurm leaves a stopping slot) the save a stopping loop makes is committed to the local tier
only, its payload marked ``SHARED_OWED``: the shared copy it would have had is owed. The next
start that restores it from a local or peer copy writes it to the shared tier first
(``owes_shared``); a start that finds no local copy falls back to the shared tier's newest.

Node-local disks are shared by every user of the node, so the tier is the user's alone: its
root must be the user's own directory that no one else may write (one another user made
first is refused, ``private_tree``), every directory in it is 0700 and every file 0600,
whatever the umask, and every manifest is sealed with the user's checkpoint key like the
shared tier's (``hpc_elastic.train._integrity``), so a copy no job of the user wrote never loads.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import stat
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from hpc_elastic import contract, trust
from hpc_elastic.errors import CheckpointError
from hpc_elastic.train import _dist

LOCAL_DIR_ENV = contract.LOCAL_CHECKPOINT_DIR_ENV
PERSIST_EVERY_ENV = contract.PERSIST_EVERY_ENV
LOCAL_KEEP = 2
PRIVATE_DIR_MODE = 0o700

log = logging.getLogger(__name__)


SHARED_OWED = "shared_owed"
"""The payload key (True) of a local-tier checkpoint whose shared copy was deferred: a stop's
save under ``--grace-action local``."""


def persists(save_number: int, persist_every: int) -> bool:
    """The rule for the shared tier: every ``persist_every``-th save (the first is number 1)."""
    return save_number % max(persist_every, 1) == 0


DEADLINE_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2})
"""The stop signals Slurm sends ahead of a deadline: the job's ``--signal``, at a preemption
(with ``preempt_send_user_signal``) and before the time limit; the agent also stops a slot
with it for a drain and ``--grace-action lead``. SIGTERM (``scancel``, ``hpc-elastic cancel``)
and SIGINT (Ctrl-C) end a job that may never start again to write a deferred shared copy."""


def local_first_requested(
    signum: signal.Signals | None, environ: Mapping[str, str] = os.environ
) -> bool:
    """Whether this rank asks its stop's save to go to the local tier first: it was stopped
    by a deadline's signal (``DEADLINE_SIGNALS``; ``signum`` None: no signal reached it) and
    an agent of the job created ``slots/local-first`` in the job directory
    (``--grace-action local``). False outside a job. Local; ``Checkpointer`` agrees on it over
    every rank."""
    job_dir = environ.get(contract.JOB_DIR_ENV)
    if signum not in DEADLINE_SIGNALS or not job_dir:
        return False
    return (Path(job_dir) / contract.SLOTS_DIR / contract.LOCAL_FIRST_FILE).exists()


def owes_shared(owed: bool, step: int, shared_step: int | None) -> bool:
    """Whether a restart from the local tier (or a peer) at ``step`` must first write that
    checkpoint to the shared tier: its save deferred the shared copy (``owed``) and the
    shared tier holds nothing as new (a later start may already have written it)."""
    return owed and (shared_step is None or step > shared_step)


def choose_source(
    local_steps: list[int | None], shared_step: int | None
) -> tuple[str, int | None, list[int]]:
    """Where a restart loads from: ``("local", step, holders)`` when some rank's local copy
    is at least as new as the shared tier's newest, else ``("shared", shared_step, [])``."""
    newest = max((step for step in local_steps if step is not None), default=None)
    if newest is not None and (shared_step is None or newest >= shared_step):
        holders = [rank for rank, step in enumerate(local_steps) if step == newest]
        return "local", newest, holders
    return "shared", shared_step, []


def private_tree(root: Path, directory: Path, *, create: bool) -> bool:
    """Check the node-local tier from ``root`` down to ``directory``, which lies under it,
    and with ``create`` make what is missing; False when something is missing and nothing
    was to be made (nothing to read yet). Raises ``CheckpointError`` for what is not ours.

    Node-local disks are shared by every user of the node, and the root is often a fixed path
    (``/tmp/ckpt``) that another user can make first, with a forged newest step in it. So the
    root must be our own directory that no one else may write (it may be a link to one: what
    is checked is where it leads); we make it 0700. Below it every directory must be ours and
    no link; we make them 0700, and narrow one of ours that is wider (an older hpc-elastic
    made them 0755).
    """
    uid = os.geteuid()
    try:
        info = os.stat(root)
    except FileNotFoundError:
        if not create:
            return False
        root.parent.mkdir(parents=True, exist_ok=True)
        with suppress(FileExistsError):  # another rank of this node, at the same moment
            root.mkdir(mode=PRIVATE_DIR_MODE)
        info = os.stat(root)
    reason = trust.unsafe_file_reason(info.st_uid, info.st_mode, uid)
    if reason is None and not stat.S_ISDIR(info.st_mode):
        reason = "it is not a directory"
    if reason is not None:
        raise untrusted_local_directory(root, reason)
    current = root
    for part in directory.relative_to(root).parts:
        current = current / part
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            if not create:
                return False
            with suppress(FileExistsError):
                current.mkdir(mode=PRIVATE_DIR_MODE)
            info = os.lstat(current)
        reason = trust.private_dir_reason(info.st_uid, info.st_mode, uid)
        if reason is not None and stat.S_ISDIR(info.st_mode) and info.st_uid == uid:
            log.debug("narrowing %s (mode %04o) to 0700", current, stat.S_IMODE(info.st_mode))
            current.chmod(PRIVATE_DIR_MODE)
            reason = None
        if reason is not None:
            raise untrusted_local_directory(current, reason)
    return True


def untrusted_local_directory(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(
        f"Local checkpoint directory '{path}' is not trusted because {reason}; another user "
        f"may have made it, so nothing in it is loaded or written: remove it, or give "
        f"--local-checkpoint-dir ({LOCAL_DIR_ENV}) a directory of yours that only you can write."
    )


def rank_directory(root: Path) -> Path:
    return root / f"rank-{_dist.rank()}"


def load_bytes(data: bytes) -> dict[str, Any]:
    payload: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return payload


def ring_neighbour(rank: int, world_size: int, ranks_per_node: int) -> int | None:
    """The rank that keeps ``rank``'s peer copy: the same local rank on the next node, so the
    copy lives on another node's disk. None on a single node (a copy there guards nothing)."""
    step = max(ranks_per_node, 1)
    if world_size <= step:
        return None
    return (rank + step) % world_size


def ring_predecessor(rank: int, world_size: int, ranks_per_node: int) -> int | None:
    """The rank whose peer copy ``rank`` keeps (the inverse of ``ring_neighbour``)."""
    step = max(ranks_per_node, 1)
    if world_size <= step:
        return None
    return (rank - step) % world_size


def choose_shard_sources(
    holdings: list[dict[int, list[int]]], shared_step: int | None
) -> tuple[int | None, dict[int, int]]:
    """Where each shard of a sharded restart comes from: ``(step, {shard: holder rank})``.

    ``holdings[r]`` lists, per shard, the steps of the intact copies on rank r's disk (its
    own and the peer copies it keeps), already restricted to copies of this world size.
    The step is the newest that every shard has a copy of, provided it is at least as new as
    the shared tier's newest; a shard is read from its own rank when that rank holds it,
    else from the lowest rank that does. ``(shared_step, {})``: read the shared tier.
    """
    world_size = len(holdings)
    candidates = sorted(
        {step for held in holdings for steps in held.values() for step in steps}, reverse=True
    )
    for step in candidates:
        if shared_step is not None and step < shared_step:
            break
        sources: dict[int, int] = {}
        for shard in range(world_size):
            holders = [rank for rank, held in enumerate(holdings) if step in held.get(shard, [])]
            if not holders:
                break
            sources[shard] = shard if shard in holders else holders[0]
        else:
            return step, sources
    return shared_step, {}
