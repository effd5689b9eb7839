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
from hypothesis import settings
from kazoo.client import KazooClient

from hpc_elastic.agent import badnodes
from hpc_elastic.contract import STATE_DIR_ENV, USER_SECRET_FILE_ENV
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.rendezvous import testing
from hpc_elastic.rendezvous.secret import read_secret_file
from hpc_elastic.rendezvous.zookeeper import DIGEST_USER, USERS

# No property test has a time limit: hypothesis's default of 200 ms an example is a timed
# assertion, which a busy machine fails with the product right.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

SHARD_ENV = "HPC_ELASTIC_TEST_SHARD"
"""``K/N``: run only the K-th of N equal shares of the selected tests (scripts/test-all runs the
shared cluster's tests as two shares on two clusters at once, since they mostly wait, and the
unit tests as two shares, one per core)."""


def _shard(text: str) -> tuple[int, int]:
    """``K/N`` as (K, N), 1 <= K <= N; anything else stops the run with one sentence."""
    number, _, total = text.partition("/")
    if not (number.isdigit() and total.isdigit() and 1 <= int(number) <= int(total)):
        raise pytest.UsageError(
            f"{SHARD_ENV} {text!r} is not K/N with 1 <= K <= N; give e.g. 1/2, or unset it."
        )
    return int(number), int(total)


INTEGRATION_TIMEOUT = 1200
"""pytest-timeout's limit for an integration test that sets none (pyproject's 300 s is the unit
tests'): a backstop against a hang, never a speed check. The longer cluster tests take 150-200 s
on a quiet machine and more than 300 s on a busy one, where their own waits still held."""


@pytest.hookimpl(trylast=True)  # after -m and -k, so that the shares split what they selected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Integration tests get ``INTEGRATION_TIMEOUT`` unless they set their own. With
    ``HPC_ELASTIC_TEST_SHARD=K/N``, every N-th test from the K-th on: the tests of one file
    alternate between the shares, so a file of long tests does not land in one share."""
    for item in items:
        if item.get_closest_marker("integration") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(INTEGRATION_TIMEOUT))
    text = os.environ.get(SHARD_ENV)
    if not text:
        return
    number, total = _shard(text)
    kept = [item for index, item in enumerate(items) if index % total == number - 1]
    dropped = [item for index, item in enumerate(items) if index % total != number - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def _cluster_fixture(fixturenames: list[str]) -> str:
    """The fixture of the cluster a test runs on: its module's own, or the shared one."""
    own = [
        name for name in ("netns_cluster", "private_cluster", "qos_cluster") if name in fixturenames
    ]
    return own[0] if own else "cluster"


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


@pytest.fixture(scope="module")
def private_cluster() -> Iterator[Cluster]:
    """A cluster of one test module's own (about 20 s to start), for a long test marked
    ``own_cluster``: scripts/test-all runs it beside the shared cluster's tests, and it
    neither waits for the shared queue nor leaves anything in it."""
    state_dir = Path(tempfile.mkdtemp(prefix="hpc-elastic-private-"))
    try:
        running = Cluster.start(state_dir)
    except ClusterError as error:
        shutil.rmtree(state_dir, ignore_errors=True)
        if _in_ci():
            pytest.fail(f"a private test cluster is required in CI: {error}", pytrace=False)
        pytest.skip(f"no private test cluster: {error}")
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


QOS_CLUSTER_ENV = "HPC_ELASTIC_TEST_QOS_CLUSTER"
"""Names a running ``dev-cluster --qos`` state dir for the QoS tests to reuse."""


@pytest.fixture(scope="module")
def qos_cluster() -> Iterator[Cluster]:
    """A cluster with accounting and QoS preemption (``dev-cluster --qos``: QoS normal, high
    and a preemptible scavenger) of one test module's own, or the one named by
    ``HPC_ELASTIC_TEST_QOS_CLUSTER``. 22.05 has one PreemptType, so QoS preemption cannot live
    on the shared cluster, whose tests rely on partition preemption."""
    reused = os.environ.get(QOS_CLUSTER_ENV)
    if reused:
        yield Cluster.from_state_dir(Path(reused))
        return
    state_dir = Path(tempfile.mkdtemp(prefix="hpc-elastic-qos-"))
    try:
        running = Cluster.start(state_dir, qos=True)
    except ClusterError as error:
        shutil.rmtree(state_dir, ignore_errors=True)
        if _in_ci():
            pytest.fail(f"a QoS test cluster is required in CI: {error}", pytrace=False)
        pytest.skip(f"no QoS test cluster: {error}")
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def private_zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A standalone ZooKeeper server of one test module's own (no Slurm needed): its hosts.
    Each test works under a chroot of its own. Without ZooKeeper installed the module's tests
    skip, except under CI=true, where they fail: CI must test against a real server."""
    if not testing.ZOOKEEPER_JAR.exists():
        message = f"ZooKeeper is not installed ({testing.ZOOKEEPER_JAR} is missing)"
        if _in_ci():
            pytest.fail(f"{message}; CI must test against a real ZooKeeper", pytrace=False)
        pytest.skip(message)
    server = testing.ZooKeeperServer(tmp_path_factory.mktemp("zookeeper"))
    server.start()
    yield server.hosts
    server.stop()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project directory with a training script, as the current directory (the CLI tests
    render and submit ``train.py`` from it, with no ``$HPC_ELASTIC_ZK`` of the caller's)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPC_ELASTIC_ZK", raising=False)
    (tmp_path / "train.py").write_text("print('training')\n")
    return tmp_path


@pytest.fixture(autouse=True, scope="session")
def _private_job_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tests (and what they start) note their jobs in an index of their own, never the
    user's. Session-wide, since hypothesis refuses function-scoped fixtures."""
    os.environ["HPC_ELASTIC_INDEX"] = str(tmp_path_factory.mktemp("index") / "jobs")
    yield
    del os.environ["HPC_ELASTIC_INDEX"]


@pytest.fixture(autouse=True, scope="session")
def _private_user_secret(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The user secret that ``submit`` and ``run`` derive the checkpoint key from is one of
    the tests' own (made on first use), never the user's ``~/.hpc-elastic/user-secret``."""
    os.environ[USER_SECRET_FILE_ENV] = str(tmp_path_factory.mktemp("user") / "user-secret")
    yield
    del os.environ[USER_SECRET_FILE_ENV]


@pytest.fixture(autouse=True, scope="session")
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tests (and what they start) keep the user's ensemble records (``hpc-elastic zk``)
    in a state directory of their own: a real ensemble of the user's must never become the
    ZooKeeper of a test's job, nor a test's ensemble the user's."""
    os.environ[STATE_DIR_ENV] = str(tmp_path_factory.mktemp("state"))
    yield
    del os.environ[STATE_DIR_ENV]


@pytest.fixture(autouse=True)
def _nothing_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each integration test: on the cluster it ran on, an empty queue, no stray stepd,
    agent or worker, and a whole cluster again (ZooKeeper and all four nodes up) for the next
    test."""
    if request.node.get_closest_marker("integration") is None:
        yield
        return
    running: Cluster = request.getfixturevalue(_cluster_fixture(request.fixturenames))
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
    forget_bad_nodes(running)
    if problems:
        pytest.fail(f"test {' and '.join(problems)}", pytrace=False)


def forget_bad_nodes(running: Cluster) -> None:
    """The next test starts with no node remembered as bad, as it starts with an empty queue.

    The memory outlives a job on purpose (a day by default), and most cluster tests share the
    ZooKeeper root: one node excluded by one test (planted, or a preflight that failed under
    load) would leave the next tests' slots pending for a node they may not use."""
    secret = Path(running.env[USER_SECRET_FILE_ENV])
    if not secret.is_file():
        return  # no agent ran with the memory yet
    try:
        with badnodes.open_book(running.zk_hosts, secret) as book:
            badnodes.clear(book)
    except HpcElasticError:
        pass  # no book yet (no node was ever remembered), or ZooKeeper is down: nothing to forget


@pytest.fixture
def zk_root(cluster: Cluster) -> Iterator[str]:
    """A fresh ZooKeeper path per test, deleted with everything under it afterwards.

    Its ``hpc-elastic`` prefix is made here with an open ACL, as a site admin may: the one the
    agents would give it lets nobody delete a job node, so nothing could clean up.
    """
    root = f"/test-{uuid.uuid4().hex}"
    client = KazooClient(hosts=cluster.zk_hosts, timeout=5)
    client.start(timeout=10)
    try:
        client.create(f"{root}/hpc-elastic", makepath=True)
        client.create(f"{root}/hpc-elastic/{USERS}")  # open too, for the same reason
        yield root
        if not client.connected:  # a test that restarted ZooKeeper may have expired its session
            client.stop()
            client.start(timeout=60)
        # The agents' bad-node memory is guarded by the user's digest: log in with it to clean.
        user_secret = Path(cluster.env[USER_SECRET_FILE_ENV])
        if user_secret.is_file():
            client.add_auth("digest", f"{DIGEST_USER}:{read_secret_file(user_secret)}")
        client.delete(root, recursive=True)
    finally:
        client.stop()
        client.close()
