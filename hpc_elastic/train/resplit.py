"""Which samples of an epoch of ordered shards each rank reads, at any world size.

Pure rules on numbers, no torch and no files: ``hpc_elastic.train.shards`` acts on them.

**The epoch's layout.** An epoch lays the shards end to end (in their given order, or in a
seeded shuffle of that order) and keeps the first ``S * B`` samples, ``S = N // B`` steps of
the global batch ``B``. It cuts them into ``L`` *lanes* of ``S * q`` samples each (``q = B / L``
samples per lane per step): lane ``j`` is the contiguous run ``[j*S*q, (j+1)*S*q)`` of the
layout, so it reads one shard, or the end of one and the start of the next, front to back.
The last ``N - S*B`` samples of the layout (fewer than one global batch; another tail each
epoch when the shards are shuffled) are left out, like ``ElasticSampler``'s tail.

**A step.** Step ``k`` takes samples ``[k*q, (k+1)*q)`` of every lane. The world size only says
who reads a lane: rank ``r`` of ``W`` reads lanes ``r*L/W`` to ``(r+1)*L/W - 1``, lane after lane
(``W`` must divide ``L``). So a step takes the same ``B`` samples at every world size, and the
job's position is ``(epoch, step)`` whatever the world: after a change of world size the
unfinished range of every lane, ``[k*q, S*q)``, goes to its reader in the new world.

**Micro-batches and loader workers.** A rank trains its ``B / W`` samples of a step in ``A``
micro-batches of ``m`` (``BatchPlan``): micro-batch ``a`` of the step is the slice
``[a*m, (a+1)*m)`` of the rank's samples, lane after lane. A rank's *stream* is its
micro-batches from a starting position to the end of the epoch, numbered ``t = 0, 1, ...``;
loader worker ``w`` of ``n`` reads micro-batches ``w, w+n, w+2n, ...``, which is the order in
which a ``DataLoader`` takes batches from its workers (round robin). Each worker reports how
many samples it handed out (``WorkerReport``); ``combine`` turns every rank's reports back into
the job's position, and refuses reports that are not a whole number of steps.
"""

from __future__ import annotations

import bisect
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_elastic.errors import DataError


@dataclass(frozen=True)
class Piece:
    """Samples ``[start, stop)`` of shard number ``shard`` (its index in the given order)."""

    shard: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, order=True)
class Position:
    """Steps ``0 .. step-1`` of ``epoch`` are trained; the same at every world size."""

    epoch: int
    step: int


@dataclass(frozen=True)
class Layout:
    """The fixed shape of a job's reading: the shards' lengths, the global batch, the lanes."""

    lengths: tuple[int, ...]
    global_batch_size: int
    lanes: int
    seed: int = 0
    shuffle: bool = False

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 0:
            raise DataError(
                f"Shard lengths {list(self.lengths)[:8]!r} must be one count of samples (0 or "
                f"more) per shard, for at least one shard; count each shard's samples."
            )
        if self.lanes < 1 or self.global_batch_size % self.lanes:
            raise DataError(
                f"lanes={self.lanes} does not divide the global batch {self.global_batch_size}; "
                f"choose lanes that divide it and that every world size divides (e.g. 12 for "
                f"1 to 4 ranks)."
            )
        if self.steps < 1:
            raise DataError(
                f"The shards hold {sum(self.lengths)} samples, fewer than one global batch of "
                f"{self.global_batch_size}; add shards or choose a smaller batch."
            )

    @property
    def quota(self) -> int:
        """Samples each lane gives to one step: ``q = B / L``."""
        return self.global_batch_size // self.lanes

    @property
    def steps(self) -> int:
        """Optimizer steps per epoch: ``S = N // B``."""
        return sum(self.lengths) // self.global_batch_size

    @property
    def lane_length(self) -> int:
        return self.steps * self.quota

    def order(self, epoch: int) -> tuple[int, ...]:
        """The shards' order in ``epoch``: as given, or a shuffle seeded by ``seed + epoch``."""
        return _order(len(self.lengths), self.seed + epoch if self.shuffle else None)

    def lane(self, epoch: int, lane: int, start: int = 0, stop: int | None = None) -> list[Piece]:
        """Samples ``[start, stop)`` of ``lane`` in ``epoch``, as pieces of shards in read order."""
        stop = self.lane_length if stop is None else stop
        base = lane * self.lane_length
        return _cut(self.lengths, self.order(epoch), base + start, base + stop)

    def normalised(self, position: Position) -> Position:
        """A position after the last step of an epoch is the start of the next one."""
        if position.step >= self.steps:
            return Position(position.epoch + 1, 0)
        return position

    def advanced(self, position: Position) -> Position:
        """The position one optimizer step later."""
        return self.normalised(Position(position.epoch, position.step + 1))

    def step_pieces(self, position: Position, lanes: range) -> list[Piece]:
        """What ``lanes`` give to the step at ``position``, lane after lane."""
        first, quota = position.step * self.quota, self.quota
        return [p for j in lanes for p in self.lane(position.epoch, j, first, first + quota)]

    def read_counts(self, position: Position) -> list[int]:
        """How many samples of each shard (in the given order) the job has read in
        ``position.epoch``: what the lanes gave to its first ``position.step`` steps."""
        counts = [0] * len(self.lengths)
        for lane in range(self.lanes):
            for piece in self.lane(position.epoch, lane, 0, position.step * self.quota):
                counts[piece.shard] += piece.size
        return counts


@dataclass(frozen=True)
class Stream:
    """One rank's micro-batches from ``start`` to the end of the epoch at world ``world``."""

    layout: Layout
    start: Position
    rank: int
    world: int
    micro_batch_size: int

    def __post_init__(self) -> None:
        layout, world = self.layout, self.world
        if world < 1 or layout.lanes % world:
            raise DataError(
                f"{layout.lanes} lanes do not split evenly over {world} ranks; choose lanes "
                f"that every world size the job may have divides (e.g. 12 for 1 to 4 ranks)."
            )
        share = layout.global_batch_size // world
        if self.micro_batch_size < 1 or share % self.micro_batch_size:
            raise DataError(
                f"A micro-batch of {self.micro_batch_size} does not divide this rank's "
                f"{share} samples per step; take the micro-batch size from "
                f"elastic.plan({layout.global_batch_size}, {world}, ...)."
            )
        if not 0 <= self.rank < world:
            raise DataError(f"Rank {self.rank} is not one of {world} ranks; pass the real rank.")

    @property
    def accumulation_steps(self) -> int:
        return self.layout.global_batch_size // self.world // self.micro_batch_size

    @property
    def lanes(self) -> range:
        """The lanes this rank reads."""
        per_rank = self.layout.lanes // self.world
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def micro_batches(self) -> int:
        """Micro-batches from ``start`` to the end of the epoch."""
        return (self.layout.steps - self.start.step) * self.accumulation_steps

    def micro_batch(self, index: int) -> list[Piece]:
        """The samples of micro-batch ``index`` of this stream, in order."""
        steps, part = divmod(index, self.accumulation_steps)
        position = Position(self.start.epoch, self.start.step + steps)
        pieces = self.layout.step_pieces(position, self.lanes)
        begin = part * self.micro_batch_size
        return _slice(pieces, begin, begin + self.micro_batch_size)

    def worker_batches(self, worker: int, workers: int) -> range:
        """The micro-batches loader worker ``worker`` of ``workers`` reads, in order."""
        return range(worker, self.micro_batches, workers)

    def position_after(self, micro_batches: int) -> Position:
        """The job's position once this stream handed out ``micro_batches`` micro-batches."""
        steps, part = divmod(micro_batches, self.accumulation_steps)
        if part or micro_batches > self.micro_batches:
            raise DataError(
                f"Rank {self.rank}'s loader handed out {micro_batches} micro-batches since "
                f"epoch {self.start.epoch} step {self.start.step}, not a whole number of steps "
                f"of {self.accumulation_steps} (at most {self.micro_batches}); draw exactly "
                f"the micro-batches of each step (elastic.group) before state.finish_step()."
            )
        return self.layout.normalised(Position(self.start.epoch, self.start.step + steps))


@dataclass(frozen=True)
class WorkerReport:
    """What one loader worker of one rank says it handed out: its stream's start, who it is,
    and how many samples it gave the loader."""

    epoch: int
    step: int
    worker: int
    workers: int
    samples: int


def handed_out(reports: Sequence[WorkerReport], micro_batch_size: int, extra: int = 0) -> int:
    """The micro-batches one rank's loader handed out, from its workers' reports (plus
    ``extra``: batches handed out since the loader last collected the workers' reports).

    Worker ``w`` of ``n`` read micro-batches ``w, w+n, ...``; handed out in that round-robin
    order, ``Y`` of them means worker ``w`` gave ``ceil((Y - w) / n)``. Reports that fit no
    ``Y`` (a worker ahead of another by more than one batch, half a micro-batch) are refused.
    """
    if not reports:
        raise DataError("No loader worker reported its position; iterate the loader first.")
    workers = reports[0].workers
    starts = {(r.epoch, r.step, r.workers) for r in reports}
    if len(starts) != 1 or sorted(r.worker for r in reports) != list(range(workers)):
        raise DataError(
            f"The loader's workers report different streams {sorted(starts)!r} or not one "
            f"report per worker; give every rank one loader over one ElasticShards."
        )
    counts = {r.worker: r.samples for r in reports}
    if any(samples % micro_batch_size for samples in counts.values()):
        raise DataError(
            f"A loader worker handed out {counts!r} samples, not whole micro-batches of "
            f"{micro_batch_size}; set the loader's batch_size to the plan's micro-batch size."
        )
    total = sum(counts.values()) // micro_batch_size
    if any(counts[w] // micro_batch_size != -(-(total - w) // workers) for w in counts):
        raise DataError(
            f"The loader's workers handed out {counts!r} samples, which is not the round-robin "
            f"order of one loader; keep in_order=True and one iterator per loader."
        )
    return total + extra


def combine(positions: Sequence[Position], where: str = "ranks") -> Position:
    """The job's position from every rank's: they must agree."""
    found = sorted(set(positions))
    if len(found) != 1:
        raise DataError(
            f"The {where} are at different data positions "
            f"{[(p.epoch, p.step) for p in found]!r}; call state.finish_step() once per "
            f"optimizer step on every rank."
        )
    return found[0]


@functools.lru_cache(maxsize=64)
def _order(count: int, seed: int | None) -> tuple[int, ...]:
    """Python's ``random.Random(seed).shuffle`` is the same in every CPython 3 release."""
    order = list(range(count))
    if seed is not None:
        random.Random(seed).shuffle(order)
    return tuple(order)


@functools.lru_cache(maxsize=4096)
def _offsets(lengths: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Where each shard (in ``order``) begins in the epoch's layout, and the end."""
    offsets = [0]
    for shard in order:
        offsets.append(offsets[-1] + lengths[shard])
    return tuple(offsets)


def _cut(lengths: tuple[int, ...], order: tuple[int, ...], begin: int, end: int) -> list[Piece]:
    """Samples ``[begin, end)`` of the layout of ``order``, as pieces of shards."""
    offsets = _offsets(lengths, order)
    pieces: list[Piece] = []
    place = bisect.bisect_right(offsets, begin) - 1  # the shard that holds sample ``begin``
    while place < len(order) and offsets[place] < end:
        low, high = max(begin, offsets[place]), min(end, offsets[place + 1])
        if low < high:
            pieces.append(Piece(order[place], low - offsets[place], high - offsets[place]))
        place += 1
    return pieces


def _slice(pieces: list[Piece], begin: int, end: int) -> list[Piece]:
    """Samples ``[begin, end)`` of the run the pieces make together."""
    found: list[Piece] = []
    offset = 0
    for piece in pieces:
        low, high = max(begin, offset), min(end, offset + piece.size)
        if low < high:
            shift = piece.start - offset
            found.append(Piece(piece.shard, low + shift, high + shift))
        offset += piece.size
    return found
