"""The few facts about the default process group that every training helper needs.

Everything works without a process group too: a plain script is rank 0 of a world of one.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def collective_device() -> torch.device:
    """NCCL only reduces CUDA tensors; gloo and the rest reduce CPU ones."""
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if active():
        dist.barrier()


def broadcast_from_rank0(value: T) -> T:
    """Rank 0's value on every rank, so all ranks act on one decision."""
    if not active():
        return value
    box: list[object] = [value]
    dist.broadcast_object_list(box, src=0, device=collective_device())
    return box[0]  # type: ignore[return-value]


def gather_to_all(value: T) -> list[T]:
    """Every rank's value, indexed by rank."""
    if not active():
        return [value]
    values: list[object] = [None] * world_size()
    dist.all_gather_object(values, value)
    return values  # type: ignore[return-value]
