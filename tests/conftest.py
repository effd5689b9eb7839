"""Fixtures for the real local Slurm + ZooKeeper cluster that integration tests run against.

One cluster serves the whole pytest session: the one named by ``HPC_ELASTIC_TEST_CLUSTER``
(a state dir from ``scripts/dev-cluster up``, left running afterwards), or else a private one
on free ports under /tmp, brought down at the end. Without Slurm, integration tests skip,
except under CI=true, where they fail: CI must never pass by testing nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import MARKER, Cluster, ClusterError
from kazoo.client import KazooClient


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    reused = os.environ.get(MARKER)
    private_dir: Path | None = None
    try:
        if reused:
            running = Cluster.from_state_dir(Path(reused))
        else:
            private_dir = Path(tempfile.mkdtemp(prefix="hpc-elastic-cluster-"))
            running = Cluster.start(private_dir)
    except ClusterError as error:
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)
        if _in_ci():
            pytest.fail(f"the test cluster is required in CI: {error}", pytrace=False)
        pytest.skip(f"no test cluster: {error}")
    yield running
    if private_dir is not None:
        running.stop()
        shutil.rmtree(private_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _nothing_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each integration test: an empty queue, no stray stepd, agent or worker, and a
    whole cluster again (ZooKeeper and all four nodes up) for the next test."""
    if request.node.get_closest_marker("integration") is None:
        yield
        return
    running: Cluster = request.getfixturevalue("cluster")
    yield
    problems = []
    queue_empty = running.wait_queue_empty(30)
    left = [] if running.wait_no_strays(15) else running.strays()
    if not queue_empty or left:
        problems.append(f"left jobs {running.squeue()} and processes {left} behind")
        running.clean_up()
    try:
        running.dev_cluster("up")
    except ClusterError as error:
        problems.append(f"left the cluster broken: {error}")
    if problems:
        pytest.fail(f"test {' and '.join(problems)}", pytrace=False)


@pytest.fixture
def zk_root(cluster: Cluster) -> Iterator[str]:
    """A fresh ZooKeeper path per test, deleted with everything under it afterwards."""
    root = f"/test-{uuid.uuid4().hex}"
    yield root
    client = KazooClient(hosts=cluster.zk_hosts, timeout=5)
    client.start(timeout=10)
    try:
        client.delete(root, recursive=True)
    finally:
        client.stop()
        client.close()
