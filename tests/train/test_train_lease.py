"""Worker self-fencing: a stale agent lease stops training at once, saves nothing, exits 77."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from ranks import python

from hpc_elastic.errors import UsageError
from hpc_elastic.train import FENCED_EXIT_CODE
from hpc_elastic.train.lease import Lease, expired, renew


class Clocks:
    """A wall clock (for mtimes) and a monotonic one (for the rate limit), moved by hand."""

    def __init__(self, wall: float) -> None:
        self.wall = wall
        self.monotonic = 0.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.monotonic += seconds


def lease_at(path: Path, clocks: Clocks, timeout: float = 10.0) -> Lease:
    return Lease(path, timeout, 0.5, lambda: clocks.wall, lambda: clocks.monotonic)


@pytest.mark.parametrize(
    ("age", "stale"), [(0.0, False), (9.9, False), (10.0, False), (10.1, True), (-5.0, False)]
)
def test_a_lease_is_stale_only_when_older_than_its_timeout(age: float, stale: bool) -> None:
    assert expired(1000.0 - age, 1000.0, 10.0) is stale


def test_a_missing_lease_file_is_stale() -> None:
    assert expired(None, 1000.0, 10.0)


def test_the_lease_goes_stale_when_the_agent_stops_renewing(tmp_path: Path) -> None:
    path = tmp_path / "lease"
    renew(path)
    clocks = Clocks(path.stat().st_mtime)
    lease = lease_at(path, clocks)
    assert not lease.expired()
    clocks.advance(9)
    renew(path)
    clocks.wall = path.stat().st_mtime + 9
    clocks.monotonic += 1
    assert not lease.expired(), "a renewed lease is fresh"
    clocks.advance(2)
    assert lease.expired()


def test_the_lease_file_is_looked_at_at_most_every_half_second(tmp_path: Path) -> None:
    path = tmp_path / "lease"
    renew(path)
    clocks = Clocks(path.stat().st_mtime)
    lease = lease_at(path, clocks)
    assert not lease.expired()
    path.unlink()
    clocks.monotonic += 0.4
    assert not lease.expired(), "looked at the file again within half a second"
    assert lease.expired(force=True), "a forced look (before a commit) sees it at once"


def test_a_stale_lease_stays_stale_after_a_late_renewal(tmp_path: Path) -> None:
    path = tmp_path / "lease"
    clocks = Clocks(1000.0)
    lease = lease_at(path, clocks)
    assert lease.expired()
    renew(path)
    clocks.wall = path.stat().st_mtime
    clocks.monotonic += 10
    assert lease.expired(), "an agent that wakes up does not make the old round current"


def test_the_lease_comes_from_the_agent(tmp_path: Path) -> None:
    assert Lease.from_environment({}) is None
    assert Lease.from_environment({"HPC_ELASTIC_LEASE_FILE": "x"}) is None
    lease = Lease.from_environment(
        {"HPC_ELASTIC_LEASE_FILE": str(tmp_path / "l"), "HPC_ELASTIC_LEASE_TIMEOUT": "7.5"}
    )
    assert lease is not None
    assert (lease.path, lease.timeout) == (tmp_path / "l", 7.5)
    for bad in ("soon", "0", "-1", "nan"):
        with pytest.raises(UsageError, match=f"'{bad}'"):
            Lease.from_environment(
                {"HPC_ELASTIC_LEASE_FILE": "l", "HPC_ELASTIC_LEASE_TIMEOUT": bad}
            )


TRAINING = """
import os, sys, torch
import hpc_elastic.train as elastic
from hpc_elastic.train import checkpoint

lease = os.environ["HPC_ELASTIC_LEASE_FILE"]
state = elastic.TrainState(torch.nn.Linear(2, 2))
if sys.argv[1] == "step":
    os.utime(lease, (0, 0))
else:
    elastic.save(state, "ckpt")
    real_fsync = checkpoint._fsync_file

    def fsync_then_freeze_the_agent(path):
        real_fsync(path)
        os.utime(lease, (0, 0))

    checkpoint._fsync_file = fsync_then_freeze_the_agent
for step in range(1, 1000):
    state.finish_step()
    print(f"trained step={step}", flush=True)
    if elastic.should_stop(step) or step % 2 == 0:
        elastic.save(state, "ckpt")
        print(f"saved step={step}", flush=True)
print("not fenced", flush=True)
"""


@pytest.mark.parametrize("goes_stale", ["step", "commit"])
def test_a_worker_with_a_stale_lease_stops_without_saving(tmp_path: Path, goes_stale: str) -> None:
    lease = tmp_path / "lease"
    renew(lease)
    result = python(
        textwrap.dedent(TRAINING),
        goes_stale,
        cwd=tmp_path,
        env={"HPC_ELASTIC_LEASE_FILE": str(lease), "HPC_ELASTIC_LEASE_TIMEOUT": "30"},
    )
    assert result.returncode == FENCED_EXIT_CODE, result.stdout + result.stderr
    assert "saved" not in result.stdout
    assert "was not renewed for 30 s" in result.stderr
    committed = sorted(path.name for path in (tmp_path / "ckpt").glob("step-*"))
    if goes_stale == "step":
        assert result.stdout.split() == ["trained", "step=1"], "trained on with a stale lease"
        assert committed == []
    else:
        assert committed == ["step-00000000"], "committed with a stale lease"
