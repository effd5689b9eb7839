"""ElasticShards and the data position TrainState keeps: real loaders (torch's and torchdata's,
with worker processes), in one process; tests/train/test_data_elastic.py has real ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import hpc_elastic.train as elastic
from hpc_elastic.errors import DataError
from hpc_elastic.train import _torchdata
from hpc_elastic.train.resplit import Position, WorkerReport, combine, handed_out

REPO = Path(__file__).resolve().parents[2]
LENGTHS = [7, 13, 5, 9, 11, 6, 8, 10, 12, 4]
BATCH = 12


def read(shard: str, start: int, stop: int) -> list[int]:
    """Sample ``k`` of shard ``i`` is ``1000 * i + k``."""
    return [1000 * int(shard) + k for k in range(start, stop)]


NAMES = [str(i) for i in range(len(LENGTHS))]


def shards(world: int, rank: int, micro: int, **options: Any) -> elastic.ElasticShards:
    plan = elastic.plan(BATCH, world, micro)
    return elastic.ElasticShards(NAMES, LENGTHS, read, plan=plan, lanes=12, rank=rank, **options)


def segment(position: Position, world: int, steps: int, workers: int) -> tuple[list[int], Position]:
    """``steps`` optimizer steps of every rank's StatefulDataLoader from ``position``; the
    samples trained and the position the workers' reports combine to."""
    trained: list[int] = []
    ends = []
    for rank in range(world):
        dataset = shards(world, rank, micro=2)
        dataset.resume(position)
        micro = dataset.plan.micro_batch_size
        loader = elastic.stateful_loader(dataset, batch_size=micro, num_workers=workers)
        batches = iter(loader)
        for _ in range(steps * dataset.plan.accumulation_steps):
            trained.extend(next(batches).tolist())
        iterators, extra = _torchdata.iterator_states(loader.state_dict())
        reports = [WorkerReport(**state) for state in iterators]
        ends.append(dataset.stream(position).position_after(handed_out(reports, micro, extra)))
        del batches, loader
    return trained, combine(ends)


def test_stateful_loaders_with_two_workers_resplit_over_4_2_3_ranks_reading_each_sample_once() -> (
    None
):
    first, position = segment(Position(0, 0), world=4, steps=2, workers=2)
    assert position == Position(0, 2)
    second, position = segment(position, world=2, steps=2, workers=2)
    third, position = segment(position, world=3, steps=3, workers=2)
    assert position == Position(1, 0)
    trained = first + second + third
    assert len(trained) == len(set(trained)) == sum(LENGTHS) // BATCH * BATCH


def test_a_reader_restored_in_the_middle_of_a_micro_batch_hands_out_the_rest() -> None:
    dataset = shards(1, 0, micro=4)
    whole = list(iter(dataset))
    reader = iter(dataset)
    for _ in range(6):
        next(reader)
    saved = reader.state_dict()
    again = iter(dataset)
    again.load_state_dict(saved)
    assert list(again) == whole[6:]


def test_samples_carry_their_ids_and_each_epoch_moves_on_by_itself() -> None:
    dataset = shards(1, 0, micro=12, with_ids=True)
    loader = DataLoader(dataset, batch_size=12, num_workers=2, persistent_workers=True)
    epochs = [[pair for batch in loader for pair in zip(*batch, strict=True)] for _ in range(2)]
    for pairs in epochs:
        ids = [int(i) for i, _ in pairs]
        assert len(ids) == len(set(ids)) == sum(LENGTHS) // BATCH * BATCH
        firsts = np.cumsum([0, *LENGTHS[:-1]])
        for sample_id, sample in pairs:
            shard, offset = divmod(int(sample), 1000)
            assert sample_id == firsts[shard] + offset


def test_token_files_are_cut_into_sequences(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    tokens[:500].tofile(tmp_path / "a.bin")
    np.save(tmp_path / "b.npy", tokens[500:])
    paths = elastic.shard_paths(tmp_path)
    plan = elastic.plan(4, 1, 4)
    dataset = elastic.ElasticShards.tokens(paths, 10, plan=plan, lanes=2, rank=0)
    assert dataset.layout.lengths == (50, 50)
    sequences = [sample for batch in DataLoader(dataset, batch_size=4) for sample in batch]
    assert len(sequences) == 100
    assert sorted(int(s[0]) for s in sequences) == list(range(0, 1000, 10))
    assert all(torch.equal(s, torch.arange(int(s[0]), int(s[0]) + 10)) for s in sequences)


def test_a_reader_that_gives_too_few_samples_is_one_sentence() -> None:
    plan = elastic.plan(4, 1, 4)
    dataset = elastic.ElasticShards(
        ["a"], [8], lambda shard, start, stop: [0], plan=plan, lanes=2, rank=0
    )
    with pytest.raises(DataError, match=r"read\('a', 0, 2\) gave 1 samples, not 2"):
        next(iter(dataset))


def test_a_plan_for_another_world_size_is_refused() -> None:
    with pytest.raises(DataError, match="The plan is for 2 ranks but this job has 1"):
        elastic.ElasticShards(NAMES, LENGTHS, read, plan=elastic.plan(BATCH, 2, 6), lanes=12)


def test_a_loader_whose_batch_is_not_the_plans_micro_batch_is_refused() -> None:
    loader = DataLoader(shards(1, 0, micro=4), batch_size=6)
    with pytest.raises(DataError, match="batch_size=6 is not the plan's micro-batch of 4"):
        elastic.TrainState(torch.nn.Linear(1, 1), loader=loader)


def test_a_loader_whose_position_nothing_keeps_is_refused() -> None:
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=2)
    with pytest.raises(DataError, match="cannot keep the position of a DataLoader"):
        elastic.TrainState(torch.nn.Linear(1, 1), loader=loader)


def first_samples(state: elastic.TrainState, loader: Any, micro_batches: int) -> list[int]:
    batches = iter(loader)
    return [i for _ in range(micro_batches) for i in next(batches).tolist()]


def test_a_save_in_the_middle_of_an_accumulation_step_resumes_at_the_steps_first_sample(
    tmp_path: Path,
) -> None:
    """Three micro-batches per step: the loader has handed out the first of step 3 when the
    save comes, but the checkpoint must hold the position where step 3 begins."""

    def build() -> tuple[elastic.TrainState, Any]:
        dataset = elastic.ElasticShards(
            NAMES, LENGTHS, read, plan=elastic.plan(BATCH, 1, 4), lanes=12
        )
        loader = elastic.stateful_loader(dataset, batch_size=4, num_workers=2)
        return elastic.TrainState(torch.nn.Linear(1, 1), loader=loader), loader

    state, loader = build()
    batches = iter(loader)
    for _ in range(2):  # steps 1 and 2
        for _ in range(3):
            next(batches)
        state.finish_step()
    step_3 = next(batches).tolist()  # the first micro-batch of step 3, then a save
    checkpoints = elastic.Checkpointer(tmp_path)
    checkpoints.save(state)
    step_3 += [i for _ in range(2) for i in next(batches).tolist()]
    del batches

    resumed, loader = build()
    checkpoints.load(resumed)
    assert resumed.step == 2
    assert first_samples(resumed, loader, 3) == step_3


def test_a_stateful_loader_over_an_elastic_sampler_resumes_from_the_sampler(
    tmp_path: Path,
) -> None:
    dataset = TensorDataset(torch.arange(48))

    def build() -> tuple[elastic.TrainState, Any]:
        sampler = elastic.ElasticSampler(dataset, 12, seed=3)
        loader = elastic.stateful_loader(dataset, batch_size=6, sampler=sampler, num_workers=1)
        return elastic.TrainState(torch.nn.Linear(1, 1), loader=loader), loader

    state, loader = build()
    assert state.sampler is loader.sampler
    batches = iter(loader)
    order = [int(i) for _ in range(8) for i in next(batches)[0]]
    state.finish_step()
    elastic.Checkpointer(tmp_path).save(state)
    del batches
    resumed, loader = build()
    elastic.Checkpointer(tmp_path).load(resumed)
    assert resumed.sampler is not None
    assert resumed.sampler.position == 12
    assert [int(i) for i in next(iter(loader))[0]] == order[12:18]


def test_another_stateful_loader_resumes_exactly_at_the_same_world_size_only(
    tmp_path: Path,
) -> None:
    dataset = TensorDataset(torch.arange(40))

    def build() -> tuple[elastic.TrainState, Any]:
        generator = torch.Generator().manual_seed(5)
        loader = elastic.stateful_loader(dataset, batch_size=4, shuffle=True, generator=generator)
        return elastic.TrainState(torch.nn.Linear(1, 1), loader=loader), loader

    state, loader = build()
    batches = iter(loader)
    order = [int(i) for _ in range(5) for i in next(batches)[0]]
    state.finish_step()  # five batches in one step
    path = elastic.Checkpointer(tmp_path).save(state)
    order += [int(i) for i in next(batches)[0]]
    del batches
    resumed, loader = build()
    elastic.Checkpointer(tmp_path).load(resumed)
    assert [int(i) for i in next(iter(loader))[0]] == order[20:24]
    assert path is not None
    saved = torch.load(path / "state.pt", weights_only=True)["data"]
    other, _ = build()
    with pytest.raises(DataError, match="of 2 ranks with 0 loader workers each, this run has 1"):
        other.data.load_state_dict({**saved, "world": 2, "loaders": saved["loaders"] * 2})


def test_the_library_imports_and_reads_shards_without_torchdata() -> None:
    script = """
import sys
class NoTorchdata:
    def find_spec(self, name, path=None, target=None):
        if name == "torchdata" or name.startswith("torchdata."):
            raise ImportError("No module named 'torchdata'")
sys.meta_path.insert(0, NoTorchdata())
import torch
from torch.utils.data import DataLoader
import hpc_elastic.train as elastic
from hpc_elastic.errors import DataError
plan = elastic.plan(4, 1, 4)
shards = elastic.ElasticShards(["a"], [8], lambda s, a, b: list(range(a, b)), plan=plan, lanes=2)
loader = DataLoader(shards, batch_size=4)
state = elastic.TrainState(torch.nn.Linear(1, 1), loader=loader)
print(sorted(i for batch in loader for i in batch.tolist()))
try:
    elastic.stateful_loader(shards, batch_size=4)
except DataError as error:
    print(error)
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == str(list(range(8)))
    assert "torchdata is not installed" in lines[1]
    assert "pip install 'hpc-elastic[data]'" in lines[1]
