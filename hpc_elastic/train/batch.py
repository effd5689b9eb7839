"""Constant global batch: keep the optimizer's batch fixed while Slurm changes the world size.

The global batch ``B`` is split evenly over ``W`` ranks, and each rank's share ``B / W`` is
trained in ``A`` micro-batches of ``B / (W * A)`` samples, accumulating gradients in between.
``A`` is the fewest micro-batches whose size fits under the memory limit, so the arithmetic
of one optimizer step is the same mean over ``B`` samples at any world size.
Restriction: ``B`` must be divisible by every world size the job may run at.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TypeVar

from hpc_elastic.errors import UsageError

T = TypeVar("T")


@dataclass(frozen=True)
class BatchPlan:
    """How one rank trains its share of a global batch."""

    global_batch_size: int
    world_size: int
    micro_batch_size: int
    """Samples per forward/backward; the DataLoader's ``batch_size``."""
    accumulation_steps: int
    """Micro-batches per optimizer step; divide each micro-batch loss by this."""


def plan(global_batch_size: int, world_size: int, max_micro_batch_size: int) -> BatchPlan:
    """The fewest accumulation steps whose micro-batch is at most ``max_micro_batch_size``."""
    if global_batch_size < 1 or max_micro_batch_size < 1:
        raise UsageError(
            f"Batch sizes must be positive, got a global batch of {global_batch_size} "
            f"and a micro-batch of {max_micro_batch_size}."
        )
    if global_batch_size % world_size:
        raise UsageError(
            f"Global batch size {global_batch_size} does not split evenly over {world_size} "
            f"ranks; choose a multiple of every world size the job may have (e.g. 12 for 1 to 4)."
        )
    share = global_batch_size // world_size
    accumulation = next(
        steps
        for steps in range(1, share + 1)
        if share % steps == 0 and share // steps <= max_micro_batch_size
    )
    return BatchPlan(global_batch_size, world_size, share // accumulation, accumulation)


def group(micro_batches: Iterable[T], accumulation_steps: int) -> Iterator[list[T]]:
    """The micro-batches of one optimizer step at a time; an incomplete last group is dropped."""
    iterator = iter(micro_batches)
    while len(step := list(islice(iterator, accumulation_steps))) == accumulation_steps:
        yield step
