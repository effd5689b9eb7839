"""The node-local tier for sharded checkpoints: every shard on its own node and on the next one.

A sharded state dict differs on every rank, so each rank keeps its own shard: the local part
of every DTensor (``to_local()``) and the plain values, saved with ``torch.save`` into
``<local>/sharded/shard-<R>/step-N/`` with the same manifest-last commit as every other
checkpoint. The same bytes go to the ring neighbour (``local_tier.ring_neighbour``: the same
local rank on the next node), which commits them in its own ``shard-<R>`` directory, so one
lost node loses no shard.

Why not DCP for this tier: DCP spreads replicated values over the ranks' files and writes its
global ``.metadata`` on rank 0 only, so no one rank's directory could be read on its own. A
shard saved as it lies in memory loads back only into the same layout, so a local copy
counts only at the world size it was written at; any other restart reads the shared tier,
which DCP reshards.
"""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpc_elastic import events
from hpc_elastic.errors import CheckpointError
from hpc_elastic.train import _dist, local_tier
from hpc_elastic.train.checkpoint import Checkpointer, emit_loaded, everyone
from hpc_elastic.train.commit import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    STATE_FILE,
    checkpoint_name,
    reading,
    step_and_version,
    verify,
)

SHARDED_DIR = "sharded"
_SHARD = re.compile(r"^shard-(\d+)$")

log = logging.getLogger(__name__)


def local_view(value: Any) -> Any:
    """``value`` with every DTensor replaced by this rank's part of it (no copy)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {key: local_view(item) for key, item in value.items()}
    if isinstance(value, list):
        return [local_view(item) for item in value]
    if isinstance(value, tuple):
        return tuple(local_view(item) for item in value)
    return value


def serialise(view: Any, step: int) -> bytes:
    """One rank's shard as ``torch.save`` bytes, labelled with its rank and world size."""
    payload = {
        "format": FORMAT_VERSION,
        "world_size": _dist.world_size(),
        "shard": _dist.rank(),
        "step": step,
        "state": view,
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def shard_directory(checkpointer: Checkpointer, shard: int) -> Checkpointer:
    """The local tier's checkpointer for one shard's copies on this node (one writer each)."""
    assert checkpointer.local_directory is not None
    directory = checkpointer.local_directory / SHARDED_DIR / f"shard-{shard}"
    return Checkpointer(
        directory,
        keep=local_tier.LOCAL_KEEP,
        round=None,
        local_directory=None,
        private_root=checkpointer.local_directory,
    )


def commit(
    checkpointer: Checkpointer, data: bytes, step: int, group: dist.ProcessGroup | None
) -> Path:
    """Every rank: pass its shard to the ring neighbour, then commit its own and the one it
    received. The exchange comes first so that a rank whose disk fails still answers its
    neighbours, and every rank learns of the failure in the agreement that follows."""
    rank, world = _dist.rank(), _dist.world_size()
    to = local_tier.ring_neighbour(rank, world, checkpointer.ranks_per_node)
    source = local_tier.ring_predecessor(rank, world, checkpointer.ranks_per_node)
    received = _dist.exchange_bytes(data, to, source, group)
    own = shard_directory(checkpointer, rank).write_serialised(data, step, world)
    if received is not None and source is not None:
        shard_directory(checkpointer, source).write_serialised(received, step, world)
        log.debug("kept rank %d's peer copy of step %d", source, step)
    events.emit(events.Kind.CHECKPOINT, step=step, tier="local", rank=rank)
    return own


def save(
    checkpointer: Checkpointer,
    state_dict: dict[str, Any],
    step: int,
    group: dist.ProcessGroup | None,
) -> Path:
    """Collective, synchronous: this rank's shard to its local tier and its neighbour's."""
    data = serialise(local_view(state_dict), step)
    written: list[Path] = []
    everyone(
        lambda: written.append(commit(checkpointer, data, step, group)),
        f"write sharded checkpoint step {step} to the local tier '{checkpointer.local_directory}'",
    )
    return written[0]


def holdings(checkpointer: Checkpointer) -> dict[int, dict[int, Path]]:
    """The intact shard copies on this node at this world size: ``{shard: {step: path}}``."""
    assert checkpointer.local_directory is not None
    root = checkpointer.local_directory / SHARDED_DIR
    found: dict[int, dict[int, Path]] = {}
    if not local_tier.private_tree(checkpointer.local_directory, root, create=False):
        return found
    entries = sorted(root.iterdir())
    for entry in entries:
        match = _SHARD.match(entry.name)
        if match is None:
            continue
        shard = int(match.group(1))
        for path in shard_directory(checkpointer, shard).committed():
            step = step_and_version(path)[0]
            if step in found.get(shard, {}) or not _usable(path):
                continue
            found.setdefault(shard, {})[step] = path
    return found


def _usable(path: Path) -> bool:
    """Intact, and written at this world size (a shard only fits the layout it came from)."""
    problem = verify(path)
    if problem is None:
        world = json.loads((path / MANIFEST_FILE).read_bytes()).get("world_size")
        if world == _dist.world_size():
            return True
        problem = f"written by a world of {world}, not {_dist.world_size()}"
    log.debug("local copy %s is not usable: %s", path, problem)
    return False


def load(
    checkpointer: Checkpointer,
    state_dict: dict[str, Any],
    shared: str | None,
    group: dist.ProcessGroup | None,
) -> Path | None:
    """Collective: fill ``state_dict`` from the local tier, a peer's copy for a shard whose
    node is gone; None when the shared tier must be read instead (nothing newer here)."""
    rank = _dist.rank()
    found: list[dict[int, dict[int, Path]]] = []
    everyone(  # a local tier refused on one rank stops every rank, not just that one
        lambda: found.append(holdings(checkpointer)),
        f"read the local tier '{checkpointer.local_directory}'",
    )
    mine = found[0]
    held = _dist.gather_to_all({shard: sorted(steps) for shard, steps in mine.items()})
    shared_step = step_and_version(Path(shared))[0] if shared is not None else None
    step, sources = local_tier.choose_shard_sources(held, shared_step)
    if step is None or not sources:
        return None
    received = _transfer(mine, sources, step, group)
    tier = "local" if sources[rank] == rank else "peer"
    if tier == "local":
        path = mine[rank][step]
    else:
        path = shard_directory(checkpointer, rank).directory / checkpoint_name(step)
    problem: str | None = None
    try:
        if received is None:
            with reading(path):
                payload = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        else:
            payload = torch.load(io.BytesIO(received), map_location="cpu", weights_only=True)
        _check(payload, rank, step)
        fill(state_dict, payload["state"], "state_dict")
    except Exception as error:
        log.debug("rank %d could not load its shard", rank, exc_info=True)
        problem = f"rank {rank}: {error}"
    problems = [found for found in _dist.gather_to_all(problem) if found is not None]
    if problems:
        raise CheckpointError(
            f"Could not load sharded step {step} from the local tier ({problems[0]}); delete "
            f"'{checkpointer.local_directory}' on that node to restart from the shared tier."
        )
    emit_loaded(step, tier, rank)
    log.debug("rank %d resumed its shard from the %s tier at step %d", rank, tier, step)
    return path


def _transfer(
    mine: dict[int, dict[int, Path]],
    sources: dict[int, int],
    step: int,
    group: dist.ProcessGroup | None,
) -> bytes | None:
    """Send the shards this rank holds for others; return this rank's shard if it was sent.

    Every rank walks the same list in the same order, and each transfer involves two ranks,
    so the earliest unfinished transfer always has both of its ranks at it: no deadlock.
    A holder whose read fails sends nothing (empty bytes), which the receiver reports.
    """
    rank = _dist.rank()
    received: bytes | None = None
    for shard, holder in sorted(sources.items()):
        if holder == shard:
            continue
        if rank == holder:
            try:
                with reading(mine[shard][step]):
                    data = (mine[shard][step] / STATE_FILE).read_bytes()
            except OSError as error:
                log.warning("Cannot send rank %d its peer copy (%s).", shard, error)
                data = b""
            log.debug("sending rank %d its peer copy of step %d", shard, step)
            _dist.exchange_bytes(data, shard, None, group)
        elif rank == shard:
            received = _dist.exchange_bytes(None, None, holder, group)
            if not received:
                raise CheckpointError(
                    f"Rank {holder} could not read rank {shard}'s peer copy of step {step}; "
                    f"see its log."
                )
    return received


def _check(payload: dict[str, Any], rank: int, step: int) -> None:
    label = (payload.get("format"), payload.get("shard"), payload.get("step"))
    if label != (FORMAT_VERSION, rank, step):
        raise CheckpointError(f"the copy is labelled {label}, not {(FORMAT_VERSION, rank, step)}")


def fill(target: Any, saved: Any, where: str) -> None:
    """Copy ``saved`` into ``target`` in place, as DCP's load does: tensors (a DTensor's
    local part) are copied into, other values replaced. Raises on a layout that differs."""
    if isinstance(target, dict | list):
        for key in _keys(target, saved, where):
            if isinstance(target[key], dict | list | torch.Tensor):
                fill(target[key], saved[key], f"{where}[{key!r}]")
            else:
                target[key] = saved[key]
        return
    local = target.to_local() if isinstance(target, DTensor) else target
    if not isinstance(saved, torch.Tensor) or saved.shape != local.shape:
        raise CheckpointError(f"{where} has another shape in the copy")
    with torch.no_grad():
        local.copy_(saved)


def _keys(target: dict[Any, Any] | list[Any], saved: Any, where: str) -> list[Any]:
    """The keys (or indices) of ``target``, once ``saved`` is known to have them all."""
    if type(saved) is not type(target) and not (
        isinstance(target, dict) and isinstance(saved, dict)
    ):
        raise CheckpointError(f"{where} is a {type(target).__name__} here but not in the copy")
    if isinstance(target, list):
        if len(saved) != len(target):
            raise CheckpointError(f"{where} has another length in the copy")
        return list(range(len(target)))
    missing = [key for key in target if key not in saved]
    if missing:
        raise CheckpointError(f"{where}[{missing[0]!r}] is missing from the copy")
    return list(target)
