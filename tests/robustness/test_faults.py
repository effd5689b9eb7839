"""The fault matrix: one real elastic job per fault, with the invariants checked afterwards.

tests/faults.py holds the faults and the checks; docs/reliability.md records the results. The
partition rows need a cluster whose nodes live in network namespaces: the one named by
``HPC_ELASTIC_TEST_NETNS_CLUSTER=<state dir>`` (``scripts/dev-cluster up --netns``), or else a
private one for this module, brought down afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cluster import Cluster, ClusterError, free_port, wait_until
from faults import (
    FAULTS,
    PARTITION_TRAIN_ARGS,
    Fault,
    FaultMissed,
    Reference,
    confirm,
    describe,
    gone,
    reference_run,
    run_fault,
    stopped,
    writer_violations,
    zookeeper_answers,
)

from hpc_elastic import events

NETNS_CLUSTER_ENV = "HPC_ELASTIC_TEST_NETNS_CLUSTER"

KNOWN_PRODUCT_BUGS: dict[str, str] = {}
"""Rows that fail because of a product bug being fixed; strict, so the fix must remove them."""


def _rows(netns: bool) -> list[object]:
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_PRODUCT_BUGS[name]))
        if name in KNOWN_PRODUCT_BUGS
        else name
        for name, fault in sorted(FAULTS.items())
        if fault.netns == netns
    ]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run's losses and final weights, computed once for the whole matrix."""
    return reference_run(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="session")
def partition_reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[Fault], Reference]:
    """The same at the partition rows' full size (three ranks) and global batch: one run per
    step count the rows use, each computed the first time a row needs it."""
    runs: dict[tuple[int, int], Reference] = {}

    def of(fault: Fault) -> Reference:
        key = (fault.world, fault.steps)
        if key not in runs:
            workdir = tmp_path_factory.mktemp("reference3")
            runs[key] = reference_run(workdir, fault.world, PARTITION_TRAIN_ARGS, fault.steps)
        return runs[key]

    return of


@pytest.fixture(scope="module")
def netns_cluster() -> Iterator[Cluster]:
    """A cluster whose four nodes each have a network namespace and a link that can be cut."""
    if os.environ.get(NETNS_CLUSTER_ENV):
        yield Cluster.from_state_dir(Path(os.environ[NETNS_CLUSTER_ENV]))
        return
    state_dir = Path(tempfile.mkdtemp(prefix="hpc-elastic-netns-"))
    try:
        running = Cluster.start(state_dir, netns=True)
    except ClusterError as error:
        shutil.rmtree(state_dir, ignore_errors=True)
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"the network-namespace cluster is required in CI: {error}", pytrace=False)
        pytest.skip(f"no network-namespace cluster: {error}")
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture
def healed(netns_cluster: Cluster) -> Iterator[Cluster]:
    """After each partition row: every link whole again and nothing of the job left."""
    yield netns_cluster
    for node in netns_cluster.nodes:
        netns_cluster.link_heal(node)
    netns_cluster.clean_up()


@pytest.mark.parametrize("name", _rows(netns=False))
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_fault(cluster: Cluster, tmp_path: Path, reference: Reference, name: str) -> None:
    result = run_fault(cluster, tmp_path, FAULTS[name], reference)
    print(describe(result))
    assert not result.violations, f"{name}: {result.outcome} ({result.detail}): {result.violations}"


@pytest.mark.parametrize("name", _rows(netns=True))
@pytest.mark.integration
@pytest.mark.own_cluster
@pytest.mark.timeout(600)
def test_partition(
    healed: Cluster, tmp_path: Path, partition_reference: Callable[[Fault], Reference], name: str
) -> None:
    fault = FAULTS[name]
    result = run_fault(healed, tmp_path, fault, partition_reference(fault))
    print(describe(result), *result.violations, sep="\n  violated: ")
    assert not result.violations, f"{name}: {result.outcome} ({result.detail}): {result.violations}"


def _log(*steps: int) -> list[tuple[int, str, int]]:
    return [(step, "0.5", 2) for step in steps]


def _commit(step: int, round_number: int, at: float) -> events.Event:
    return events.Event(events.Kind.CHECKPOINT, round=round_number, details={"step": step}, time=at)


def test_a_step_log_that_resumes_from_its_newest_checkpoint_has_one_writer() -> None:
    commits = [_commit(5, 1, 1.0), _commit(10, 1, 2.0), _commit(15, 2, 3.0)]
    assert writer_violations(_log(*range(1, 14), *range(11, 17), *range(16, 19)), commits) == []


def test_two_rank_zeros_logging_side_by_side_are_two_writers() -> None:
    commits = [_commit(5, 1, 1.0), _commit(10, 1, 2.0)]
    interleaved = _log(*range(1, 14), 11, 14, 12, 15)
    assert writer_violations(interleaved, commits) == [
        "the step log went from step 11 to 14: two writers"
    ]


def test_a_log_that_goes_back_to_no_checkpoint_has_two_writers() -> None:
    assert writer_violations(_log(1, 2, 3, 4, 2, 3), [_commit(5, 1, 1.0)]) != []


def test_a_commit_from_an_older_round_after_a_newer_rounds_commit_is_a_second_writer() -> None:
    commits = [_commit(10, 1, 1.0), _commit(15, 2, 2.0), _commit(20, 1, 3.0)]
    assert writer_violations(_log(*range(1, 21)), commits) == [
        "round 1 committed step 20 after round 2 had"
    ]


def test_a_fault_that_did_not_take_effect_fails_the_row_saying_what_is_missing() -> None:
    with pytest.raises(FaultMissed, match="did not take effect: worker 7 outlived SIGKILL"):
        confirm(lambda: False, "worker 7 outlived SIGKILL", timeout=0)
    confirm(lambda: True, "never said", timeout=0)


def test_a_frozen_process_reads_stopped_and_a_killed_one_gone() -> None:
    child = subprocess.Popen(["sleep", "600"])
    try:
        assert not stopped(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        assert wait_until(lambda: stopped(child.pid), 30)
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: gone(child.pid), 30), "a zombie not yet reaped counts as gone"
    finally:
        child.kill()
        child.wait()
    assert gone(child.pid)


def test_a_zookeeper_port_that_refuses_connections_does_not_answer(tmp_path: Path) -> None:
    nobody = Cluster(tmp_path, tmp_path / "slurm.conf", free_port(), env={})
    assert not zookeeper_answers(nobody)
