"""Checkpoints of sharded state (FSDP, tensor parallel) through ``torch.distributed.checkpoint``.

Every rank writes its own shards into one staging directory; rank 0 commits it with the same
manifest-and-rename as replicated checkpoints, so both kinds share one directory layout, one
keep-K policy, one fallback and the same fencing by round and lease. DCP records the global
layout of every tensor, so a checkpoint written at one world size loads at another.

An asynchronous checkpointer (``Checkpointer(asynchronous=True)``) hands the writing to DCP's
``async_save``: the shards are staged into host memory on the training thread, every rank
writes its own in a worker thread, and rank 0's worker commits once DCP's last step (rank 0
writing the global metadata after every rank reported its writes) is done. Those workers talk
over a gloo process group of their own, so their collectives never interleave with the
training loop's on the default group.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from hpc_elastic import events
from hpc_elastic.protocol import lease
from hpc_elastic.train import _dist, _integrity, background, preemption, sharded_local
from hpc_elastic.train.checkpoint import (
    Checkpointer,
    emit_loaded,
    on_rank0,
    skips_while_busy,
    snapshot,
)
from hpc_elastic.train.commit import checkpoint_name, reading, step_and_version

log = logging.getLogger(__name__)
_writers_group: dist.ProcessGroup | None = None


def save_sharded(
    state_dict: dict[str, Any],
    step: int,
    directory: Path | str | None = None,
    keep: int | None = None,
    *,
    checkpointer: Checkpointer | None = None,
) -> Path | None:
    """Collective: write ``state_dict`` (DTensors and all) as checkpoint ``step``.

    Rank 0's steps (preparing the staging directory, committing it) go through the same
    agreement as ``Checkpointer.save``: whatever fails there, every rank raises at once.
    Pass ``checkpointer`` for its settings (asynchronous, keep_every, when_busy); it
    replaces ``directory`` and ``keep``. Returns what ``Checkpointer.save`` returns.
    """
    if checkpointer is None:
        checkpointer = Checkpointer.at(directory, keep)
    lease.check()
    if checkpointer.asynchronous:
        return _save_in_background(checkpointer, state_dict, step)
    background.drain_if_used()
    if checkpointer.local_directory is not None:
        persist = checkpointer._persisting()
        with preemption.saving():
            local = sharded_local.save(checkpointer, state_dict, step, _writers())
        if not persist:
            return local
    with preemption.saving():
        staging = _prepare(checkpointer, step)
        dcp_save(state_dict, storage_writer=FileSystemWriter(staging, sync_files=True))
        _dist.barrier()
        committed = on_rank0(
            lambda: str(_commit(checkpointer, staging, step)),
            f"commit sharded checkpoint step {step} in '{checkpointer.where}'",
        )
    if _dist.rank() == 0:
        events.emit(events.Kind.CHECKPOINT, step=step, path=committed)
    return Path(str(committed))


def _save_in_background(
    checkpointer: Checkpointer, state_dict: dict[str, Any], step: int
) -> Path | None:
    """Stage the shards on this thread; write them and commit behind the loop.

    With a local tier every rank also snapshots its own shard; its worker commits it locally
    and passes it to the ring neighbour once DCP's writing (when the shared tier is due this
    time) is done: both use the writers' group, which two threads must not share at once.
    """
    if skips_while_busy(checkpointer.when_busy, step):
        return None
    background.mark_used()
    background.drain()
    local = checkpointer.local_directory is not None
    persist = checkpointer._persisting() if local else True
    view = snapshot(sharded_local.local_view(state_dict)) if local else None
    group = _writers()
    written: Future[Any] | None = None
    staging: Path | None = None
    if persist:
        staging = _prepare(checkpointer, step)
        written = dcp_async_save(  # type: ignore[assignment]
            state_dict,
            storage_writer=FileSystemWriter(staging, sync_files=True),
            process_group=group,
        )

    def finish() -> str:
        if written is not None:
            written.result()  # every rank's shards and rank 0's metadata are on disk
        result = ""
        if view is not None:
            data = sharded_local.serialise(view, step)
            with preemption.saving():
                result = str(sharded_local.commit(checkpointer, data, step, group))
        if staging is None or _dist.rank() != 0:
            return result or str(staging)
        with preemption.saving():
            committed = _commit(checkpointer, staging, step)
        events.emit(events.Kind.CHECKPOINT, step=step, path=str(committed), mode="async")
        return str(committed)

    background.submit(finish, f"write sharded checkpoint step {step} to '{checkpointer.where}'")
    if not persist:
        mine = sharded_local.shard_directory(checkpointer, _dist.rank())
        return mine.directory / checkpoint_name(step)
    return checkpointer.directory / checkpoint_name(step)


def _writers() -> dist.ProcessGroup | None:
    """The background writers' own gloo group, created (collectively) by the first async save."""
    global _writers_group  # noqa: PLW0603
    if not _dist.active():
        return None
    if _writers_group is None:
        _writers_group = dist.new_group(backend="gloo")
        atexit.register(_forget_writers)
        log.debug("created the background checkpoint writers' gloo group")
    return _writers_group


def _forget_writers() -> None:
    """Drop the group while the interpreter is whole: destroyed during its final teardown,
    gloo's threads were seen to abort the process ('terminate called without an active
    exception') after a clean ``destroy_process_group()``."""
    global _writers_group  # noqa: PLW0603
    _writers_group = None
    gc.collect()


def _prepare(checkpointer: Checkpointer, step: int) -> Path:
    """Rank 0 prepares the staging directory every rank writes its shards into."""
    staging = on_rank0(
        lambda: str(checkpointer.prepare_staging(step)),
        f"prepare sharded checkpoint step {step} in '{checkpointer.where}'",
    )
    return Path(str(staging))


def _commit(checkpointer: Checkpointer, staging: Path, step: int) -> Path:
    files: dict[str, dict[str, Any]] = {
        path.name: {"size": path.stat().st_size} for path in staging.iterdir()
    }
    files[_integrity.METADATA_FILE] = _integrity.metadata_entry(staging)
    return checkpointer.commit(staging, step, _dist.world_size(), files)


def load_sharded(
    state_dict: dict[str, Any],
    directory: Path | str | None = None,
    *,
    checkpointer: Checkpointer | None = None,
) -> Path | None:
    """Collective: fill ``state_dict`` in place from the newest intact checkpoint, resharding.

    With a local tier (``checkpointer.local_directory``) each rank reads its own shard from
    its node, or a peer's copy of it, when that is at least as new as the shared tier's.
    """
    if checkpointer is None:
        checkpointer = Checkpointer.at(directory)
    lease.check()
    chosen = on_rank0(
        checkpointer.choose,
        f"choose a checkpoint in '{checkpointer.where}'",
    )
    if checkpointer.local_directory is not None:
        local = sharded_local.load(checkpointer, state_dict, chosen, _writers())
        if local is not None:
            return local
    if chosen is None:
        return None
    _integrity.verify_before_load(Path(chosen))  # DCP unpickles .metadata: check its seal first
    with reading(Path(chosen)):
        dcp_load(state_dict, checkpoint_id=Path(chosen), planner=SafeLoadPlanner())
    if _dist.rank() == 0:
        emit_loaded(step_and_version(Path(chosen))[0], checkpointer.tier)
    return Path(chosen)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values load with ``weights_only=True``.

    The base class would ``torch.load`` them with ``weights_only=False``; it gets the value
    re-saved after the safe load instead, which can hold only plain values by then.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        safe = torch.load(value, weights_only=True)
        resaved = io.BytesIO()
        torch.save(safe, resaved)
        resaved.seek(0)
        super().load_bytes(read_item, resaved)
