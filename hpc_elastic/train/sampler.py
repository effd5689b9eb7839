"""A sampler whose position is global, so a job resumes mid-epoch at any world size.

Each epoch has one order over the whole dataset, a permutation seeded by ``(seed, epoch)``.
Training walks it one global batch at a time: step ``k`` of an epoch consumes the samples
``order[k*B : (k+1)*B]`` and rank ``r`` of ``W`` takes the ``r``-th slice of ``B / W`` of them.
The only state is ``(epoch, position)``, the count of samples already trained on in this
epoch, which means the same thing at every world size: 4 -> 3 -> 4 ranks repeat and skip
nothing. The tail of an epoch shorter than one global batch is dropped (the permutation
differs every epoch, so a different tail each time).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from hpc_elastic.errors import UsageError
from hpc_elastic.train import _dist

log = logging.getLogger(__name__)


class ElasticSampler(Sampler[int]):
    """Yields this rank's sample indices from the committed position to the end of the epoch.

    Give it to a ``DataLoader`` with ``batch_size`` equal to the micro-batch size. Indices are
    drawn in the main process, so ``num_workers`` does not matter. Call ``advance()`` once per
    optimizer step: the position counts samples *trained on*, not samples the loader prefetched.
    """

    def __init__(
        self,
        dataset: Sized | int,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.size = dataset if isinstance(dataset, int) else len(dataset)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = _dist.rank() if rank is None else rank
        self.world_size = _dist.world_size() if world_size is None else world_size
        self.epoch = 0
        self.position = 0
        if global_batch_size < 1 or global_batch_size % self.world_size:
            raise UsageError(
                f"Global batch size {global_batch_size} does not split evenly over "
                f"{self.world_size} ranks; choose a multiple of every world size the job may "
                f"have (e.g. 12 for 1 to 4 ranks)."
            )
        if global_batch_size > self.size:
            raise UsageError(
                f"Global batch size {global_batch_size} is larger than the dataset "
                f"({self.size} samples); choose a smaller batch."
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.size // self.global_batch_size

    def __len__(self) -> int:
        remaining_steps = (self.size - self.position) // self.global_batch_size
        return remaining_steps * (self.global_batch_size // self.world_size)

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        share = self.global_batch_size // self.world_size
        start = self.position
        while start + self.global_batch_size <= self.size:
            mine = start + self.rank * share
            yield from order[mine : mine + share]
            start += self.global_batch_size

    def order(self, epoch: int) -> list[int]:
        """The epoch's global order, identical on every rank and at every world size."""
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        ordered: list[int] = torch.randperm(self.size, generator=generator).tolist()
        return ordered

    def set_epoch(self, epoch: int) -> None:
        """Enter ``epoch``: a new epoch starts at its beginning, the current one keeps its place.

        The usual loop calls ``sampler.set_epoch(epoch)`` at the top of every epoch, also the
        first one after a resume; resetting the position there would train the samples before
        the checkpoint twice. ``DistributedSampler`` has no position, so the two agree otherwise.
        """
        if epoch != self.epoch:
            log.debug("sampler enters epoch %d (from epoch %d)", epoch, self.epoch)
            self.epoch = epoch
            self.position = 0

    def advance(self) -> None:
        """Record one optimizer step; rolls over to the next epoch when no full batch is left."""
        self.position += self.global_batch_size
        if self.position + self.global_batch_size > self.size:
            self.set_epoch(self.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise UsageError(
                f"The checkpoint's sampler seed {state['seed']} differs from --seed {self.seed}; "
                f"resume with the same seed or start a new checkpoint directory."
            )
        self.epoch = state["epoch"]
        self.position = state["position"]
        if self.position + self.global_batch_size > self.size:
            self.set_epoch(self.epoch + 1)
