"""The fault matrix: one real elastic job per fault, with the invariants checked afterwards.

tests/faults.py holds the faults and the checks; docs/reliability.md records the results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import Cluster
from faults import FAULTS, Reference, describe, reference_run, run_fault

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run's losses and final weights, computed once for the whole matrix."""
    return reference_run(tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault(cluster: Cluster, tmp_path: Path, reference: Reference, name: str) -> None:
    result = run_fault(cluster, tmp_path, FAULTS[name], reference)
    print(describe(result))
    assert not result.violations, f"{name}: {result.outcome} ({result.detail}): {result.violations}"
