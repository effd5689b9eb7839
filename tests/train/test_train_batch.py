"""Constant global batch: the same optimizer batch at every world size, or one clear error."""

from __future__ import annotations

import pytest

from hpc_elastic.errors import UsageError
from hpc_elastic.train import BatchPlan, group, plan


@pytest.mark.parametrize(
    ("world", "micro", "accumulation"), [(1, 16, 3), (2, 12, 2), (3, 16, 1), (4, 12, 1)]
)
def test_accumulation_keeps_the_global_batch(world: int, micro: int, accumulation: int) -> None:
    result = plan(48, world, max_micro_batch_size=16)
    assert result == BatchPlan(48, world, micro, accumulation)
    assert world * result.micro_batch_size * result.accumulation_steps == 48


def test_micro_batch_shrinks_when_nothing_divides_evenly() -> None:
    assert plan(14, 2, max_micro_batch_size=4) == BatchPlan(14, 2, 1, 7)


@pytest.mark.parametrize(("batch", "world", "micro"), [(48, 5, 8), (0, 1, 8), (8, 1, 0)])
def test_impossible_plans_are_usage_errors(batch: int, world: int, micro: int) -> None:
    with pytest.raises(UsageError):
        plan(batch, world, micro)


def test_group_yields_whole_steps_only() -> None:
    assert list(group(range(7), 3)) == [[0, 1, 2], [3, 4, 5]]
