"""The re-split rules of sharded data (``hpc_elastic.train.resplit``): over any sequence of world
sizes, micro-batch sizes, loader workers and lost progress, every sample of an epoch is trained
exactly once, at the same step as at any other world size."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_elastic.errors import DataError
from hpc_elastic.train.resplit import (
    Layout,
    Piece,
    Position,
    Stream,
    WorkerReport,
    combine,
    handed_out,
)


@dataclass(frozen=True)
class Segment:
    """Some steps at one world size; ``lost``: killed before its next checkpoint, so its
    steps are trained again by the next segment."""

    world: int
    steps: int
    micro_batch_size: int
    workers: int
    lost: bool


def samples(pieces: list[Piece]) -> list[tuple[int, int]]:
    return [(p.shard, offset) for p in pieces for offset in range(p.start, p.stop)]


def loader_order(stream: Stream, workers: int, count: int) -> tuple[list[Piece], list[int]]:
    """What a DataLoader hands out in ``count`` batches: each worker reads its own batches,
    the loader takes one from each in turn. Returns the samples and each worker's count."""
    per_worker = [
        [stream.micro_batch(t) for t in stream.worker_batches(w, workers)] for w in range(workers)
    ]
    handed: list[Piece] = []
    taken = [0] * workers
    for batch in range(count):
        worker = batch % workers
        handed.extend(per_worker[worker][taken[worker]])
        taken[worker] += 1
    return handed, [n * stream.micro_batch_size for n in taken]


def train(layout: Layout, segments: list[Segment]) -> tuple[dict[tuple[int, int], int], Position]:
    """Every sample trained, with the step of the epoch that trained it; the final position."""
    position = Position(0, 0)
    trained: dict[tuple[int, int], int] = {}
    counts: Counter[tuple[int, int]] = Counter()
    for segment in segments:
        ends = []
        for rank in range(segment.world):
            stream = Stream(layout, position, rank, segment.world, segment.micro_batch_size)
            count = segment.steps * stream.accumulation_steps
            handed, sizes = loader_order(stream, segment.workers, count)
            step_samples = samples(handed)
            per_step = len(step_samples) // max(segment.steps, 1)
            if not segment.lost:
                for index, sample in enumerate(step_samples):
                    trained[sample] = position.step + index // per_step
                    counts[sample] += 1
            reports = [
                WorkerReport(position.epoch, position.step, w, segment.workers, sizes[w])
                for w in range(segment.workers)
            ]
            ends.append(stream.position_after(handed_out(reports, segment.micro_batch_size)))
        if not segment.lost:
            position = combine(ends)
    assert max(counts.values(), default=1) == 1, "a sample was trained twice"
    return trained, position


def layout_position(layout: Layout, shard: int, offset: int) -> int:
    """Where a sample lies in the epoch's layout: the shards end to end in the epoch's order
    (written here from the documented rule, not with the module's helpers)."""
    before = 0
    for other in layout.order(0):
        if other == shard:
            return before + offset
        before += layout.lengths[other]
    raise AssertionError(shard)


@st.composite
def plans(draw: st.DrawFn) -> tuple[Layout, list[Segment]]:
    lanes = draw(st.sampled_from([1, 2, 3, 4, 6, 12]))
    batch = lanes * draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(0, 30), min_size=1, max_size=20))
    if sum(lengths) < batch:
        lengths.append(batch)
    layout = Layout(tuple(lengths), batch, lanes, seed=3, shuffle=draw(st.booleans()))
    segments: list[Segment] = []
    done = 0
    while done < layout.steps:
        world = draw(st.sampled_from([w for w in (1, 2, 3, 4, 6, 12) if lanes % w == 0]))
        share = batch // world
        micro = draw(st.sampled_from([m for m in range(1, share + 1) if share % m == 0]))
        steps = draw(st.integers(0, layout.steps - done))
        lost = draw(st.booleans()) and len(segments) < 6
        workers = draw(st.integers(1, 3))
        segments.append(Segment(world, steps, micro, workers, lost))
        done += 0 if lost else steps
        if len(segments) > 8 and not lost:
            segments.append(Segment(1, layout.steps - done, batch, 1, False))
            done = layout.steps
    return layout, segments


@settings(max_examples=150, deadline=None)
@given(plans())
def test_any_sequence_of_world_sizes_trains_every_sample_once_at_its_own_step(
    plan: tuple[Layout, list[Segment]],
) -> None:
    layout, segments = plan
    trained, end = train(layout, segments)
    assert end == Position(1, 0)
    every = {(shard, offset) for shard, n in enumerate(layout.lengths) for offset in range(n)}
    lane_length = layout.steps * layout.quota
    kept = {s for s in every if layout_position(layout, *s) < layout.lanes * lane_length}
    assert set(trained) == kept
    assert len(every - kept) == sum(layout.lengths) - layout.steps * layout.global_batch_size
    for sample, step in trained.items():
        assert step == (layout_position(layout, *sample) % lane_length) // layout.quota


@settings(max_examples=60, deadline=None)
@given(plans())
def test_a_step_takes_the_same_samples_at_every_world_size(
    plan: tuple[Layout, list[Segment]],
) -> None:
    layout, _ = plan
    for step in range(layout.steps):
        position = Position(0, step)
        wanted = Counter(samples(layout.step_pieces(position, range(layout.lanes))))
        for world in (w for w in (1, 2, 3, 4, 6, 12) if layout.lanes % w == 0):
            share = layout.global_batch_size // world
            got: Counter[tuple[int, int]] = Counter()
            for rank in range(world):
                stream = Stream(layout, position, rank, world, share)
                got.update(samples(stream.micro_batch(0)))
            assert got == wanted


def test_each_lane_reads_its_shards_front_to_back() -> None:
    layout = Layout((10, 10, 10, 10), global_batch_size=4, lanes=2)
    assert layout.steps == 10
    assert layout.lane(0, 0) == [Piece(0, 0, 10), Piece(1, 0, 10)]
    assert layout.lane(0, 1) == [Piece(2, 0, 10), Piece(3, 0, 10)]
    stream = Stream(layout, Position(0, 4), rank=1, world=2, micro_batch_size=1)
    assert [stream.micro_batch(t) for t in range(4)] == [
        [Piece(2, 8, 9)],
        [Piece(2, 9, 10)],
        [Piece(3, 0, 1)],
        [Piece(3, 1, 2)],
    ]


def test_read_counts_say_how_far_each_shard_is_read() -> None:
    layout = Layout((6, 6, 6), global_batch_size=6, lanes=3)
    assert layout.read_counts(Position(0, 2)) == [4, 4, 4]
    assert layout.read_counts(Position(0, 3)) == [6, 6, 6]


def test_the_shuffled_order_is_seeded_per_epoch() -> None:
    layout = Layout(tuple(range(1, 30)), global_batch_size=4, lanes=2, seed=1, shuffle=True)
    again = Layout(tuple(range(1, 30)), global_batch_size=4, lanes=2, seed=1, shuffle=True)
    assert layout.order(0) == again.order(0)
    assert layout.order(0) != layout.order(1)
    assert sorted(layout.order(1)) == list(range(29))


def test_the_last_step_of_an_epoch_moves_to_the_next_one() -> None:
    layout = Layout((8,), global_batch_size=4, lanes=1)
    assert layout.advanced(Position(0, 0)) == Position(0, 1)
    assert layout.advanced(Position(0, 1)) == Position(1, 0)


def test_a_loader_stopped_in_the_middle_of_a_step_is_refused() -> None:
    layout = Layout((24,), global_batch_size=12, lanes=6)
    stream = Stream(layout, Position(0, 0), rank=0, world=2, micro_batch_size=2)
    assert stream.accumulation_steps == 3
    assert stream.position_after(3) == Position(0, 1)
    with pytest.raises(DataError, match="not a whole number of steps"):
        stream.position_after(4)


def test_worker_reports_out_of_round_robin_order_are_refused() -> None:
    def reports(*counts: int) -> list[WorkerReport]:
        return [WorkerReport(0, 0, w, len(counts), n) for w, n in enumerate(counts)]

    assert handed_out(reports(6, 4), micro_batch_size=2) == 5
    assert handed_out(reports(4, 4), micro_batch_size=2, extra=1) == 5
    with pytest.raises(DataError, match="round-robin"):
        handed_out(reports(8, 2), micro_batch_size=2)
    with pytest.raises(DataError, match="whole micro-batches"):
        handed_out(reports(3, 2), micro_batch_size=2)
    with pytest.raises(DataError, match="different streams"):
        handed_out([WorkerReport(0, 0, 0, 2, 2), WorkerReport(0, 1, 1, 2, 2)], micro_batch_size=2)


def test_ranks_at_different_positions_are_refused() -> None:
    assert combine([Position(0, 3), Position(0, 3)]) == Position(0, 3)
    with pytest.raises(DataError, match=r"\[\(0, 3\), \(0, 4\)\]"):
        combine([Position(0, 3), Position(0, 4)])


@pytest.mark.parametrize(
    ("lengths", "batch", "lanes", "sentence"),
    [
        ((10,), 12, 5, "lanes=5 does not divide the global batch 12"),
        ((5,), 12, 4, "fewer than one global batch"),
        ((), 12, 4, "one count of samples"),
        ((5, -1), 2, 1, "one count of samples"),
    ],
)
def test_impossible_layouts_are_one_sentence(
    lengths: tuple[int, ...], batch: int, lanes: int, sentence: str
) -> None:
    with pytest.raises(DataError, match=sentence):
        Layout(lengths, batch, lanes)


@pytest.mark.parametrize(
    ("world", "micro", "sentence"),
    [(5, 2, "12 lanes do not split evenly over 5 ranks"), (4, 5, "micro-batch of 5")],
)
def test_a_world_or_micro_batch_that_does_not_fit_is_one_sentence(
    world: int, micro: int, sentence: str
) -> None:
    layout = Layout((100,), global_batch_size=24, lanes=12)
    with pytest.raises(DataError, match=sentence):
        Stream(layout, Position(0, 0), 0, world, micro)
