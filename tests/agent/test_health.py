"""The health preflight, with NVML faked at its import boundary (a ``pynvml`` module)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpc_elastic.agent import health, nvml
from hpc_elastic.agent.badnodes import remembered
from hpc_elastic.agent.health import Check, Result, Status
from hpc_elastic.errors import RendezvousError
from hpc_elastic.rendezvous.badnode import BadNode


class FakeNvmlError(Exception):
    pass


class NotSupported(FakeNvmlError):
    pass


def fake_pynvml(gpus: list[dict[str, Any]], *, init_fails: bool = False) -> types.ModuleType:
    """A stand-in for nvidia-ml-py with the calls nvml.py makes; a GPU dict key missing means
    the query is not supported there, as on a consumer GPU."""
    module = types.ModuleType("pynvml")
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_fails:
            raise FakeNvmlError("Driver Not Loaded")

    def query(key: str) -> Any:
        def answer(handle: int, *args: object) -> Any:
            if key not in gpus[handle]:
                raise NotSupported("Not Supported")
            return gpus[handle][key]

        return answer

    module.__dict__.update(
        NVMLError=FakeNvmlError,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        NVML_FEATURE_ENABLED=1,
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetName=lambda handle: b"NVIDIA H200",
        nvmlDeviceGetTotalEccErrors=query("ecc"),
        nvmlDeviceGetRetiredPagesPendingStatus=query("pending"),
        nvmlDeviceGetRemappedRows=query("remap"),
    )
    return module


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Callable[[types.ModuleType | None], None]:
    def put(module: types.ModuleType | None) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", module)  # None: the import fails

    return put


HEALTHY = {"ecc": 0, "pending": 0, "remap": (0, 0, 0, 0)}


def test_healthy_gpus_pass_and_nvml_is_shut_down_again(install: Any) -> None:
    module = fake_pynvml([HEALTHY] * 4)
    install(module)
    result = health.gpu_check(expected=4)()
    assert result.status is Status.OK
    assert module.calls == ["init", "shutdown"]


def test_fewer_gpus_than_expected_fail_the_node(install: Any) -> None:
    install(fake_pynvml([HEALTHY] * 3))
    result = health.gpu_check(expected=4)()
    assert result.status is Status.FAILED
    assert result.detail == "NVML lists 3 GPUs where 4 were expected."


def test_ecc_errors_pending_retirement_and_failed_remaps_each_fail_the_node(install: Any) -> None:
    install(
        fake_pynvml(
            [
                HEALTHY,
                {**HEALTHY, "ecc": 2},
                {**HEALTHY, "pending": 1},
                {**HEALTHY, "remap": (0, 3, 0, 1)},
            ]
        )
    )
    result = health.gpu_check()()
    assert result.status is Status.FAILED
    assert result.detail == (
        "GPU 1 has 2 uncorrectable ECC errors; GPU 2 has memory pages waiting to be retired; "
        "GPU 3 ran out of spare memory rows."
    )


def test_a_counter_the_gpu_does_not_support_is_not_a_failure(install: Any) -> None:
    install(fake_pynvml([{}, {}]))
    assert nvml.gpus()[0].uncorrected_ecc is None
    assert health.gpu_check(expected=2)().status is Status.OK


def test_without_the_package_or_the_driver_the_gpu_checks_do_not_apply(install: Any) -> None:
    install(None)
    assert health.gpu_check(expected=4)().status is Status.NOT_APPLICABLE
    assert health.matmul_check()().status is Status.NOT_APPLICABLE
    install(fake_pynvml([HEALTHY], init_fails=True))
    result = health.gpu_check()()
    assert result.status is Status.NOT_APPLICABLE
    assert "Driver Not Loaded" in result.detail


def test_the_matmul_verdict_reads_the_subprocess_exit() -> None:
    assert health.matmul_verdict(0, "8\n").status is Status.OK
    assert health.matmul_verdict(3, "").status is Status.NOT_APPLICABLE
    failed = health.matmul_verdict(1, "GPU 5 computed a wrong matrix product\n")
    assert failed.status is Status.FAILED
    assert failed.detail == "The GPU matmul test failed: GPU 5 computed a wrong matrix product."


def test_a_matmul_that_hangs_fails_the_node(install: Any, tmp_path: Path) -> None:
    install(fake_pynvml([HEALTHY]))
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nexec sleep 30\n")
    sleeper.chmod(0o755)
    result = health.matmul_check(python=str(sleeper), timeout=0.5)()
    assert result.status is Status.FAILED
    assert "hung" in result.detail


def test_a_directory_with_room_and_speed_passes_and_keeps_no_probe_file(tmp_path: Path) -> None:
    result = health.disk_check(tmp_path / "job", min_free=1, min_rate=1.0)()
    assert result.status is Status.OK
    assert list((tmp_path / "job").iterdir()) == []


def test_too_little_space_or_too_slow_a_disk_fails_with_the_path_quoted() -> None:
    path = Path("/scratch/ckpt")
    full = health.disk_verdict(path, free=10**8, write_rate=1e9, min_free=10**9, min_rate=1e7)
    assert full.status is Status.FAILED
    assert full.detail == "'/scratch/ckpt' has 0.10 GB free, below the 1.00 GB needed."
    slow = health.disk_verdict(path, free=10**10, write_rate=2e6, min_free=10**9, min_rate=1e7)
    assert slow.status is Status.FAILED
    assert "2.0 MB/s" in slow.detail


class Stalls:
    """A disk whose probes measure ``rates`` in turn, on a clock that only ``sleep`` moves."""

    def __init__(self, rates: list[float]) -> None:
        self.rates = rates
        self.now = 0.0
        self.probed_at: list[float] = []

    def measure(self, path: Path) -> float:
        self.probed_at.append(self.now)
        return self.rates[len(self.probed_at) - 1]

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def best(self) -> float:
        return health.best_write_rate(
            Path("/scratch"), 10e6, self.measure, window=20.0, pause=2.0,
            clock=lambda: self.now, sleep=self.sleep,
        )  # fmt: skip


def test_a_fast_disk_is_probed_once() -> None:
    disk = Stalls([500e6])
    assert disk.best() == 500e6
    assert disk.probed_at == [0.0]


def test_a_disk_that_stalls_for_a_burst_passes_once_a_later_probe_is_fast() -> None:
    # Seven stalled probes, 12 s in all: back-to-back retries would all have landed in them.
    disk = Stalls([1e6] * 7 + [300e6])
    assert disk.best() == 300e6
    assert disk.probed_at == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]


def test_a_disk_slow_for_the_whole_window_fails_with_its_best_rate() -> None:
    disk = Stalls([1e6, 4e6, 2e6, 3e6, 1e6, 2e6, 1e6, 2e6, 1e6, 2e6, 1e6])
    assert disk.best() == 4e6
    assert disk.probed_at[-1] < 20.0
    assert len(disk.probed_at) == 10


def test_a_clock_off_by_more_than_the_limit_fails_the_node() -> None:
    assert health.clock_verdict(100.0, 100.2, 100.1, max_skew=5.0).status is Status.OK
    off = health.clock_verdict(100.0, 100.2, 60.0, max_skew=5.0)
    assert off.status is Status.FAILED
    assert off.detail == "This node's clock is +40.1 s off ZooKeeper's, beyond 5 s."
    assert health.clock_verdict(0.0, 0.1, None, 5.0).status is Status.NOT_APPLICABLE


def test_a_check_that_raises_fails_and_the_verdict_joins_the_failures() -> None:
    def unreachable() -> Result:
        raise RendezvousError("ZooKeeper at 'zk:2181' did not answer within 10 s.")

    results = health.run(
        {
            "gpu": lambda: Result("gpu", Status.NOT_APPLICABLE, "No GPUs."),
            "zookeeper": unreachable,
            "disk": lambda: Result("disk", Status.FAILED, "'/x' has 0.00 GB free."),
        }
    )
    assert [result.status for result in results] == [
        Status.NOT_APPLICABLE,
        Status.FAILED,
        Status.FAILED,
    ]
    assert health.verdict(results) == (
        "The zookeeper check could not run: ZooKeeper at 'zk:2181' did not answer within "
        "10 s. '/x' has 0.00 GB free."
    )
    assert health.verdict(results[:1]) is None


def test_an_unreachable_zookeeper_fails_the_preflight_and_the_clock_does_not_apply() -> None:
    results = health.run(health.zookeeper_checks("127.0.0.1:1", connect_timeout=1.0))
    assert results[0].status is Status.FAILED
    assert "127.0.0.1:1" in results[0].detail
    assert results[1].status is Status.NOT_APPLICABLE


class Book:
    """The user's bad-node memory kept in a list: storage only, the rules are health's."""

    def __init__(self, records: list[BadNode] | None = None) -> None:
        self.stored = list(records or [])

    def remember(self, record: BadNode) -> None:
        self.stored.append(record)

    def records(self) -> list[BadNode]:
        return list(self.stored)


def ok(name: str) -> Check:
    return lambda: Result(name, Status.OK, f"{name} fine.")


def test_a_failed_check_keeps_the_node_out_remembers_it_and_says_why() -> None:
    book = Book([remembered("node2", "disk full", now=0.0, ttl=100.0)])
    emitted: list[tuple[str, dict[str, Any]]] = []
    outcome = health.preflight(
        {
            "gpu": lambda: Result("gpu", Status.FAILED, "GPU 1 has 2 uncorrectable ECC errors."),
            "clock": ok("clock"),
        },
        node="node7",
        job="llm",
        now=10.0,
        book=book,
        emit=lambda kind, **details: emitted.append((kind, details)),
    )
    assert not outcome.healthy
    assert outcome.reason == "GPU 1 has 2 uncorrectable ECC errors."
    assert outcome.exclude == "node2,node7"
    [record] = [record for record in book.stored if record.host == "node7"]
    assert (record.reason, record.job, record.since) == (outcome.reason, "llm", 10.0)
    [(kind, details)] = emitted
    assert kind == "health"
    assert details["healthy"] is False
    assert details["checks"] == {"gpu": "failed", "clock": "ok"}
    assert details["exclude"] == "node2,node7"


def test_a_healthy_node_joins_and_still_steers_clear_of_remembered_ones() -> None:
    book = Book([remembered("node2", "disk full", now=0.0, ttl=100.0)])
    outcome = health.preflight({"gpu": ok("gpu")}, node="node7", job="llm", now=10.0, book=book)
    assert outcome.healthy
    assert outcome.exclude == "node2"
    assert len(book.stored) == 1


def test_a_node_still_remembered_as_bad_does_not_join_until_it_expires() -> None:
    book = Book([remembered("node7", "GPU 3 missing", now=0.0, ttl=100.0)])
    outcome = health.preflight({"gpu": ok("gpu")}, node="node7", job="llm", now=50.0, book=book)
    assert outcome.reason == "Node 'node7' is remembered as bad: GPU 3 missing"
    later = health.preflight({"gpu": ok("gpu")}, node="node7", job="llm", now=150.0, book=book)
    assert later.healthy
    assert later.exclude == ""


def test_without_the_memory_the_checks_alone_decide() -> None:
    class Unreachable(Book):
        def records(self) -> list[BadNode]:
            raise RendezvousError("ZooKeeper at 'zk:2181' did not answer within 10 s.")

    outcome = health.preflight(
        {"disk": lambda: Result("disk", Status.FAILED, "'/ckpt' has 0.00 GB free.")},
        node="node7",
        job="llm",
        now=0.0,
        book=Unreachable(),
    )
    assert outcome.reason == "'/ckpt' has 0.00 GB free."
    assert outcome.exclude == "node7"


def test_a_disk_still_slow_after_its_window_fails_the_node_with_its_best_rate_quoted(
    tmp_path: Path,
) -> None:
    rates = [2e6, 3e6]
    slow = health.disk_check(
        tmp_path, min_free=1, min_rate=1e7, measure=lambda path: rates.pop(0), window=0.0
    )
    result = slow()
    assert result.status is Status.FAILED
    assert "2.0 MB/s" in result.detail
