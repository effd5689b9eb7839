"""CI can never pass by testing nothing: under CI=true an integration test whose cluster is
missing fails, and the one command CI runs sets CI=true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARD_ENV

REPO = Path(__file__).resolve().parents[2]
AN_INTEGRATION_TEST = (
    "tests/integration/test_slurm_cluster.py::test_unknown_partition_is_one_sentence"
)


def run_without_cluster(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    # Neither this run's CI nor its share (scripts/test-all): the one test must be selected.
    env = {key: value for key, value in os.environ.items() if key not in ("CI", SHARD_ENV)}
    env.update({"HPC_ELASTIC_TEST_CLUSTER": str(tmp_path / "no-cluster"), "PYTHONPATH": str(REPO)})
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", AN_INTEGRATION_TEST],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_under_ci_a_missing_cluster_fails_the_integration_test(tmp_path: Path) -> None:
    result = run_without_cluster(tmp_path, "true")
    assert result.returncode != 0, result.stdout
    assert "the test cluster is required in CI" in result.stdout, result.stdout
    assert "skipped" not in result.stdout, result.stdout


def test_outside_ci_a_missing_cluster_skips_with_the_reason(tmp_path: Path) -> None:
    result = run_without_cluster(tmp_path, None)
    assert result.returncode == 0, result.stdout
    assert "1 skipped" in result.stdout, result.stdout


@pytest.mark.parametrize("script", ["scripts/test-all"])
def test_the_ci_script_runs_the_suite_with_ci_set(script: str) -> None:
    lines = (REPO / script).read_text().splitlines()
    exported = [index for index, line in enumerate(lines) if line.strip() == "export CI=true"]
    pytest_runs = [index for index, line in enumerate(lines) if "pytest" in line and "bin/" in line]
    assert exported, f"{script} does not export CI=true"
    assert pytest_runs, f"{script} runs no pytest"
    assert exported[0] < pytest_runs[0], f"{script} exports CI=true only after running pytest"
