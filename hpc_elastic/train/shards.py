"""``ElasticShards``: a dataset of ordered shard files that resumes exactly at any world size.

Token files (``.bin``/``.npy``), webdataset tars, any data kept as shards read front to back.
The rules of who reads what are pure and live in ``hpc_elastic.train.resplit``: an epoch cuts
the shards, end to end, into a fixed number of lanes; every step takes the same few samples of
every lane; a rank reads its own lanes, and after a change of world size the unfinished part of
every lane goes to its new reader. So the job's position is ``(epoch, step)`` at every world
size, and a step trains on the same samples at world 3 as at world 4.

It is an ``IterableDataset``: give it to a ``DataLoader`` or torchdata's ``StatefulDataLoader``
with ``batch_size`` set to the plan's micro-batch size, and any ``num_workers``. Each loader
worker reads its own micro-batches (``ShardReader``) and reports how far it got through the
loader's state (``state_dict``); ``TrainState(loader=...)`` puts that state in checkpoints.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from hpc_elastic.errors import DataError
from hpc_elastic.train import _dist
from hpc_elastic.train.batch import BatchPlan
from hpc_elastic.train.resplit import Layout, Piece, Position, Stream

log = logging.getLogger(__name__)

Reader = Callable[[str, int, int], Iterable[Any]]
"""``read(shard, start, stop)``: samples ``start`` to ``stop - 1`` of that shard, in order."""


class ElasticShards(IterableDataset[Any]):
    """Samples of ordered shards, split over the ranks by lanes; resumes at any world size.

    ``shards`` are names (usually paths) handed to ``read``; ``lengths`` their numbers of
    samples. ``plan`` is this world's ``elastic.plan(...)``: its global batch must be divisible
    by ``lanes``, and ``lanes`` by every world size the job may have (12 for 1 to 4 ranks).
    ``shuffle`` shuffles the order of the shards, seeded per epoch, never the order inside one.
    ``with_ids`` yields ``(id, sample)``: ``id`` numbers the samples of all shards end to end
    in the given order, for ``state.log_samples``.

    ``read`` runs in the loader's workers: with the ``spawn`` start method it must pickle (a
    module-level function or object, as ``TokenFiles``).
    """

    def __init__(
        self,
        shards: Sequence[str | os.PathLike[str]],
        lengths: Sequence[int],
        read: Reader,
        *,
        plan: BatchPlan,
        lanes: int,
        seed: int = 0,
        shuffle: bool = False,
        with_ids: bool = False,
        rank: int | None = None,
    ) -> None:
        self.names = tuple(str(shard) for shard in shards)
        if len(self.names) != len(lengths):
            raise DataError(
                f"{len(self.names)} shards but {len(lengths)} lengths; give one length (its "
                f"number of samples) per shard."
            )
        counts = tuple(int(n) for n in lengths)
        self.layout = Layout(counts, plan.global_batch_size, lanes, seed, shuffle)
        self.plan = plan
        self.read = read
        self.with_ids = with_ids
        self.rank = _dist.rank() if rank is None else rank
        if rank is None and _dist.world_size() != plan.world_size:
            raise DataError(
                f"The plan is for {plan.world_size} ranks but this job has "
                f"{_dist.world_size()}; make it with elastic.plan(batch, world_size, ...)."
            )
        self.position = Position(0, 0)
        self._first_ids = _first_ids(self.layout.lengths)
        self.stream(self.position)  # a world or micro-batch that cannot work fails here

    @classmethod
    def tokens(
        cls,
        paths: Sequence[str | os.PathLike[str]],
        sequence_length: int,
        *,
        dtype: str = "uint16",
        header_bytes: int = 0,
        plan: BatchPlan,
        lanes: int,
        seed: int = 0,
        shuffle: bool = False,
        with_ids: bool = False,
        rank: int | None = None,
    ) -> ElasticShards:
        """Token files (``.npy``, or raw ``.bin`` of ``dtype`` after ``header_bytes``) cut into
        samples of ``sequence_length`` tokens (int64 tensors); a file's last partial sample is
        left out."""
        files = TokenFiles(sequence_length, dtype, header_bytes)
        lengths = [files.length(str(path)) for path in paths]
        return cls(
            paths,
            lengths,
            files,
            plan=plan,
            lanes=lanes,
            seed=seed,
            shuffle=shuffle,
            with_ids=with_ids,
            rank=rank,
        )

    def stream(self, start: Position) -> Stream:
        """This rank's micro-batches from ``start`` to the end of that epoch."""
        plan = self.plan
        return Stream(self.layout, start, self.rank, plan.world_size, plan.micro_batch_size)

    def __iter__(self) -> ShardReader:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return ShardReader(self, self.position, worker, workers)

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.layout.steps

    def set_epoch(self, epoch: int) -> None:
        """Enter ``epoch``: a new epoch starts at its beginning, the current one keeps its
        place (as ``ElasticSampler.set_epoch``). Loader workers that outlive an iterator
        (``persistent_workers``) go on to the next epoch by themselves and never see this."""
        if epoch != self.position.epoch:
            log.debug("shards enter epoch %d (from %s)", epoch, self.position)
            self.position = Position(epoch, 0)

    def advance(self) -> None:
        """Record one optimizer step (``TrainState.finish_step`` calls it)."""
        self.position = self.layout.advanced(self.position)

    def resume(self, position: Position) -> None:
        """Continue at ``position`` (a checkpoint's), at whatever world size this is."""
        log.debug("shards resume at %s on rank %d of %d", position, self.rank, self.world_size)
        self.position = self.layout.normalised(position)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def progress(self) -> dict[str, tuple[int, int]]:
        """Per shard: how many of its samples the job has trained on in this epoch, of how many."""
        counts = self.layout.read_counts(self.position)
        return {
            name: (count, length)
            for name, count, length in zip(self.names, counts, self.layout.lengths, strict=True)
        }

    def sample_id(self, shard: int, offset: int) -> int:
        return self._first_ids[shard] + offset

    def ended(self, epoch: int) -> None:
        """A reader of ``epoch`` ran out: this copy of the dataset (a persistent worker's,
        which never sees ``advance``) goes on with the next epoch. Never backwards: in the
        main process ``advance`` may have got there first."""
        self.position = max(self.position, Position(epoch + 1, 0))


class ShardReader(Iterator[Any]):
    """One loader worker's samples of one stream; its ``state_dict`` is what the worker
    reports to the loader (torchdata's ``StatefulDataLoader`` keeps it, batch by batch)."""

    def __init__(self, shards: ElasticShards, start: Position, worker: int, workers: int) -> None:
        self.shards = shards
        self.worker = worker
        self.workers = workers
        self._begin(start, 0)

    def _begin(self, start: Position, samples: int) -> None:
        self.stream = self.shards.stream(start)
        self.batches = self.stream.worker_batches(self.worker, self.workers)
        self.samples = samples
        done, part = divmod(samples, self.stream.micro_batch_size)
        self._next = done
        self._pending: deque[Any] = deque()
        if part:  # restored in the middle of a micro-batch: read it again, skip what was handed
            self._fill()
            for _ in range(part):
                self._pending.popleft()

    def __iter__(self) -> ShardReader:
        return self

    def __next__(self) -> Any:
        if not self._pending:
            self._fill()
        self.samples += 1
        return self._pending.popleft()

    def _fill(self) -> None:
        if self._next >= len(self.batches):
            self.shards.ended(self.stream.start.epoch)
            raise StopIteration
        for piece in self.stream.micro_batch(self.batches[self._next]):
            self._pending.extend(self._read(piece))
        self._next += 1

    def _read(self, piece: Piece) -> list[Any]:
        name = self.shards.names[piece.shard]
        found = list(self.shards.read(name, piece.start, piece.stop))
        if len(found) != piece.size:
            raise DataError(
                f"read({name!r}, {piece.start}, {piece.stop}) gave {len(found)} samples, not "
                f"{piece.size}; make it return exactly the samples start to stop - 1, and the "
                f"shard's length its real number of samples."
            )
        if not self.shards.with_ids:
            return found
        first = self.shards.sample_id(piece.shard, piece.start)
        return [(first + offset, sample) for offset, sample in enumerate(found)]

    def state_dict(self) -> dict[str, int]:
        start = self.stream.start
        return {
            "epoch": start.epoch,
            "step": start.step,
            "worker": self.worker,
            "workers": self.workers,
            "samples": self.samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["worker"], state["workers"]) != (self.worker, self.workers):
            raise DataError(
                f"A loader worker's saved state is of worker {state['worker']} of "
                f"{state['workers']}, not {self.worker} of {self.workers}; restore a loader "
                f"with the same num_workers."
            )
        self._begin(Position(state["epoch"], state["step"]), state["samples"])


@dataclass(frozen=True)
class TokenFiles:
    """Reads samples of ``sequence_length`` tokens from token files, memory-mapped: ``.npy``
    (any shape, flattened) or raw ``.bin`` of ``dtype`` after ``header_bytes``."""

    sequence_length: int
    dtype: str = "uint16"
    header_bytes: int = 0

    def __post_init__(self) -> None:
        if self.sequence_length < 1:
            raise DataError(
                f"sequence_length={self.sequence_length} must be 1 or more tokens per sample."
            )

    def length(self, path: str) -> int:
        return len(self._tokens(path)) // self.sequence_length

    def __call__(self, path: str, start: int, stop: int) -> list[torch.Tensor]:
        size = self.sequence_length
        window = np.asarray(self._tokens(path)[start * size : stop * size], dtype=np.int64)
        return list(torch.from_numpy(window).reshape(stop - start, size).unbind(0))

    def _tokens(self, path: str) -> np.ndarray[Any, Any]:
        return _mapped(path, self.dtype, self.header_bytes)


@functools.lru_cache(maxsize=256)
def _mapped(path: str, dtype: str, header_bytes: int) -> np.ndarray[Any, Any]:
    """One read-only map per file and process (a forked worker inherits the parent's)."""
    try:
        if path.endswith(".npy"):
            loaded: np.ndarray[Any, Any] = np.load(path, mmap_mode="r")
            return loaded.reshape(-1)
        return np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=header_bytes)
    except (OSError, ValueError) as error:
        raise DataError(
            f"Token file {path!r} cannot be read ({error}); check the path, its dtype "
            f"{dtype!r} and header of {header_bytes} bytes."
        ) from error


def _first_ids(lengths: Sequence[int]) -> tuple[int, ...]:
    """The id of each shard's first sample: all shards end to end, in the given order."""
    first, total = [], 0
    for length in lengths:
        first.append(total)
        total += length
    return tuple(first)


def shard_paths(directory: str | os.PathLike[str], pattern: str = "*") -> list[str]:
    """The files of ``directory`` matching ``pattern``, sorted by name: a stable shard order."""
    found = sorted(str(path) for path in Path(directory).glob(pattern) if path.is_file())
    if not found:
        raise DataError(f"No shard matches {pattern!r} in '{directory}'; check the directory.")
    return found
