"""ElasticSampler: one global order per epoch, and no sample repeated or skipped across resizes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from hpc_elastic.errors import UsageError
from hpc_elastic.train import ElasticSampler

GLOBAL_BATCH = 12


def train_segment(state: dict[str, int], size: int, world: int, steps: int) -> list[int]:
    """``steps`` optimizer steps at ``world`` ranks from ``state``; returns every index trained."""
    samplers = [
        ElasticSampler(size, GLOBAL_BATCH, seed=7, rank=r, world_size=world) for r in range(world)
    ]
    for sampler in samplers:
        sampler.load_state_dict(state)
    share = GLOBAL_BATCH // world
    streams = [iter(sampler) for sampler in samplers]
    seen: list[int] = []
    for _ in range(steps):
        for stream in streams:
            seen.extend(next(stream) for _ in range(share))
        for sampler in samplers:
            sampler.advance()
    state.update(samplers[0].state_dict())
    return seen


def test_four_three_four_ranks_cover_the_epoch_exactly_once() -> None:
    size = 120
    state = {"seed": 7, "epoch": 0, "position": 0}
    seen = train_segment(state, size, 4, 3) + train_segment(state, size, 3, 4)
    seen += train_segment(state, size, 4, 3)
    assert sorted(seen) == list(range(size))
    assert state == {"seed": 7, "epoch": 1, "position": 0}


@settings(max_examples=50, deadline=None)
@given(
    size=st.integers(GLOBAL_BATCH, 200),
    plan=st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6, 12]), st.integers(1, 5)), max_size=8),
)
def test_any_resize_sequence_repeats_and_skips_nothing(
    size: int, plan: list[tuple[int, int]]
) -> None:
    steps_per_epoch = size // GLOBAL_BATCH
    state = {"seed": 7, "epoch": 0, "position": 0}
    seen: list[int] = []
    done = 0
    for world, wanted in [*plan, (2, steps_per_epoch)]:
        steps = min(wanted, steps_per_epoch - done)
        seen += train_segment(state, size, world, steps)
        done += steps
    assert done == steps_per_epoch
    order = ElasticSampler(size, GLOBAL_BATCH, seed=7, rank=0, world_size=1).order(0)
    assert sorted(seen) == sorted(order[: steps_per_epoch * GLOBAL_BATCH])
    assert max(Counter(seen).values()) == 1


def test_order_is_seeded_per_epoch() -> None:
    sampler = ElasticSampler(50, 10, seed=1, rank=0, world_size=1)
    assert sampler.order(0) == ElasticSampler(50, 10, seed=1).order(0)
    assert sampler.order(0) != sampler.order(1)
    assert sorted(sampler.order(1)) == list(range(50))


def test_set_epoch_restarts_the_epoch() -> None:
    sampler = ElasticSampler(50, 10, rank=1, world_size=2)
    sampler.advance()
    assert len(sampler) == 4 * 5
    sampler.set_epoch(2)
    assert (sampler.epoch, sampler.position, len(sampler)) == (2, 0, 5 * 5)


class Indices(Dataset[int]):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> int:
        return index


def test_works_with_dataloader_workers() -> None:
    seen: list[int] = []
    for rank in range(2):
        sampler = ElasticSampler(Indices(), 24, seed=5, rank=rank, world_size=2)
        loader = DataLoader(Indices(), batch_size=4, sampler=sampler, num_workers=2)
        batches: list[torch.Tensor] = list(loader)
        seen.extend(index for batch in batches for index in batch.tolist())
    assert sorted(seen) == list(range(96))


@pytest.mark.parametrize(("size", "batch", "world"), [(100, 10, 3), (5, 10, 1), (100, 0, 1)])
def test_bad_batch_sizes_are_usage_errors(size: int, batch: int, world: int) -> None:
    with pytest.raises(UsageError):
        ElasticSampler(size, batch, rank=0, world_size=world)


def test_resuming_with_another_seed_is_refused() -> None:
    sampler = ElasticSampler(50, 10, seed=1)
    with pytest.raises(UsageError, match="seed"):
        sampler.load_state_dict({"seed": 2, "epoch": 0, "position": 0})


def usual_loop(
    samplers: list[ElasticSampler], epochs: int, stop_after_steps: int | None = None
) -> list[tuple[int, int]]:
    """The usual training loop over every rank's sampler, ``set_epoch`` at the top of each
    epoch (also the first one after a resume); returns ``(epoch, index)`` of every sample
    trained, stopping (as a crash would) after ``stop_after_steps`` optimizer steps."""
    trained: list[tuple[int, int]] = []
    share = GLOBAL_BATCH // samplers[0].world_size
    steps = 0
    for epoch in range(samplers[0].epoch, epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        streams = [iter(sampler) for sampler in samplers]
        for _ in range(samplers[0].steps_per_epoch - samplers[0].position // GLOBAL_BATCH):
            for stream in streams:
                trained.extend((epoch, next(stream)) for _ in range(share))
            for sampler in samplers:
                sampler.advance()
            steps += 1
            if steps == stop_after_steps:
                return trained
    return trained


def test_set_epoch_of_the_resumed_epoch_repeats_and_skips_nothing() -> None:
    size, epochs, world = 60, 3, 2

    def ranks() -> list[ElasticSampler]:
        return [
            ElasticSampler(size, GLOBAL_BATCH, seed=7, rank=r, world_size=world)
            for r in range(world)
        ]

    first = ranks()
    trained = usual_loop(first, epochs, stop_after_steps=7)  # 5 steps per epoch: stops in epoch 1
    saved = first[0].state_dict()
    assert saved == {"seed": 7, "epoch": 1, "position": 2 * GLOBAL_BATCH}
    resumed = ranks()
    for sampler in resumed:
        sampler.load_state_dict(saved)
    trained += usual_loop(resumed, epochs)

    order = ElasticSampler(size, GLOBAL_BATCH, seed=7, rank=0, world_size=1)
    for epoch in range(epochs):
        expected = order.order(epoch)[: order.steps_per_epoch * GLOBAL_BATCH]
        seen = [index for seen_epoch, index in trained if seen_epoch == epoch]
        assert sorted(seen) == sorted(expected), f"epoch {epoch} repeated or skipped samples"


def test_set_epoch_to_a_new_epoch_starts_it_from_the_beginning() -> None:
    sampler = ElasticSampler(50, 10, rank=0, world_size=1)
    sampler.advance()
    sampler.set_epoch(0)
    assert (sampler.epoch, sampler.position) == (0, 10)
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.position) == (1, 0)
