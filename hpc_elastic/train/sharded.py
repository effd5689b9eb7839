"""Checkpoints of sharded state (FSDP, tensor parallel) through ``torch.distributed.checkpoint``.

Every rank writes its own shards into one staging directory; rank 0 commits it with the same
manifest-and-rename as replicated checkpoints, so both kinds share one directory layout, one
keep-K policy and one fallback. DCP records the global layout of every tensor, so a
checkpoint written at one world size loads at another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from hpc_elastic import events
from hpc_elastic.errors import CheckpointError
from hpc_elastic.train import _dist
from hpc_elastic.train.checkpoint import Checkpointer


def save_sharded(
    state_dict: dict[str, Any], step: int, directory: Path | str | None = None, keep: int = 3
) -> Path:
    """Collective: write ``state_dict`` (DTensors and all) as checkpoint ``step``."""
    checkpointer = Checkpointer.at(directory, keep)
    staging: Path = _dist.broadcast_from_rank0(
        checkpointer.prepare_staging(step) if _dist.rank() == 0 else Path()
    )
    dcp_save(state_dict, storage_writer=FileSystemWriter(staging, sync_files=True))
    _dist.barrier()
    outcome: Path | str | None = None
    if _dist.rank() == 0:
        try:
            files = {path.name: {"size": path.stat().st_size} for path in staging.iterdir()}
            outcome = checkpointer.commit(staging, step, _dist.world_size(), files)
        except OSError as error:
            outcome = (
                f"Could not commit sharded checkpoint step {step} ({error}); "
                f"check the space and permissions of '{staging.parent}'."
            )
        else:
            events.emit("checkpoint", step=step, path=str(outcome))
    outcome = _dist.broadcast_from_rank0(outcome)
    if not isinstance(outcome, Path):
        raise CheckpointError(str(outcome))
    return outcome


def load_sharded(state_dict: dict[str, Any], directory: Path | str | None = None) -> Path | None:
    """Collective: fill ``state_dict`` in place from the newest intact checkpoint, resharding."""
    checkpointer = Checkpointer.at(directory)
    chosen = _dist.broadcast_from_rank0(checkpointer.newest_intact() if _dist.rank() == 0 else None)
    if isinstance(chosen, str):
        raise CheckpointError(chosen)
    if chosen is not None:
        dcp_load(state_dict, checkpoint_id=chosen)
    return chosen
