"""The health preflight: checks a slot's agent runs before it joins the rendezvous.

A node that fails one should not take part: its slot requeues with the node in
``ExcNodeList`` and the node is remembered as bad for a while (``badnodes.py``). The checks
are pluggable (a name and a function returning a ``Result``); the built-in ones look at the
GPUs (NVML, and a tiny matmul in a subprocess, since the agent never imports torch), the job
and checkpoint directories (free space, write rate), ZooKeeper (reachable, clock skew).

Each check measures, then hands plain numbers to a ``*_verdict`` function: the verdicts are
the rules, and they are what the unit tests exercise.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hpc_elastic.agent import nvml
from hpc_elastic.agent.badnodes import DEFAULT_TTL, current, exclude_list, remembered
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.events import Kind
from hpc_elastic.rendezvous import zookeeper
from hpc_elastic.rendezvous.badnode import BadNode

logger = logging.getLogger(__name__)


class Status(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    NOT_APPLICABLE = "not applicable"
    """The hardware or service is absent here (no GPU, no ZooKeeper given): not a failure."""


@dataclass(frozen=True)
class Result:
    check: str
    status: Status
    detail: str
    """One sentence: what was measured, and for a failure, what is wrong."""


Check = Callable[[], Result]

MIN_FREE_BYTES = 1 << 30
"""A checkpoint directory with less than 1 GiB free will fail its next save."""
MIN_WRITE_RATE = 10e6
"""Bytes per second: below this a shared filesystem is too sick to checkpoint on."""
PROBE_BYTES = 8 << 20
MAX_CLOCK_SKEW = 5.0
"""Seconds. Leases, event timelines and learned deadlines compare clocks across nodes."""
MATMUL_TIMEOUT = 120.0
_NOT_APPLICABLE_EXIT = 3


def run(checks: Mapping[str, Check]) -> list[Result]:
    """Run every check in order; one that raises counts as failed, with its message."""
    results = []
    for name, check in checks.items():
        try:
            result = check()
        except (HpcElasticError, OSError) as error:
            result = Result(name, Status.FAILED, f"The {name} check could not run: {error}")
        logger.debug("health: %s %s: %s", result.check, result.status.value, result.detail)
        results.append(result)
    return results


def verdict(results: Sequence[Result]) -> str | None:
    """None for a healthy node, else the failures' sentences joined: the ``health`` event's
    reason and the bad-node record's."""
    failed = [result.detail for result in results if result.status is Status.FAILED]
    return " ".join(failed) if failed else None


# --- GPUs ----------------------------------------------------------------------------------


def gpu_verdict(gpus: Sequence[nvml.Gpu], expected: int | None) -> Result:
    """Too few GPUs, uncorrectable ECC errors, pages awaiting retirement or a failed row
    remap each fail the node; a counter the GPU does not support (None) does not."""
    if expected is not None and len(gpus) < expected:
        return Result(
            "gpu", Status.FAILED, f"NVML lists {len(gpus)} GPUs where {expected} were expected."
        )
    problems = []
    for gpu in gpus:
        if gpu.uncorrected_ecc:
            problems.append(f"GPU {gpu.index} has {gpu.uncorrected_ecc} uncorrectable ECC errors")
        if gpu.retired_pages_pending:
            problems.append(f"GPU {gpu.index} has memory pages waiting to be retired")
        if gpu.remap_failed:
            problems.append(f"GPU {gpu.index} ran out of spare memory rows")
    if problems:
        return Result("gpu", Status.FAILED, "; ".join(problems) + ".")
    return Result("gpu", Status.OK, f"{len(gpus)} GPUs without memory errors.")


def gpu_check(expected: int | None = None) -> Check:
    def check() -> Result:
        try:
            gpus = nvml.gpus()
        except nvml.NvmlUnavailable as error:
            return Result("gpu", Status.NOT_APPLICABLE, f"No GPUs to check: {error}.")
        if not gpus and not expected:
            return Result("gpu", Status.NOT_APPLICABLE, "NVML lists no GPUs.")
        return gpu_verdict(gpus, expected)

    return check


MATMUL_SCRIPT = f"""
import sys
try:
    import torch
except ImportError:
    sys.exit({_NOT_APPLICABLE_EXIT})
if not torch.cuda.is_available():
    sys.exit({_NOT_APPLICABLE_EXIT})
for index in range(torch.cuda.device_count()):
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(index))
    product = (a.to(f"cuda:{{index}}") @ a.to(f"cuda:{{index}}")).cpu()
    if not torch.allclose(product, a @ a, rtol=1e-2, atol=1e-2):
        print(f"GPU {{index}} computed a wrong matrix product")
        sys.exit(1)
print(torch.cuda.device_count())
"""
"""Run by a separate interpreter: the agent itself must never import torch."""


def matmul_verdict(returncode: int, output: str) -> Result:
    if returncode == _NOT_APPLICABLE_EXIT:
        return Result("matmul", Status.NOT_APPLICABLE, "No torch with CUDA to run a matmul on.")
    if returncode != 0:
        last = output.strip().splitlines()[-1:] or [f"exit code {returncode}"]
        return Result("matmul", Status.FAILED, f"The GPU matmul test failed: {last[0]}.")
    return Result("matmul", Status.OK, f"A matmul ran correctly on {output.strip()} GPUs.")


def matmul_check(python: str = sys.executable, timeout: float = MATMUL_TIMEOUT) -> Check:
    def check() -> Result:
        # Importing torch takes seconds: not worth it where NVML sees no GPU at all.
        try:
            if not nvml.gpus():
                return Result("matmul", Status.NOT_APPLICABLE, "NVML lists no GPUs.")
        except nvml.NvmlUnavailable as error:
            return Result("matmul", Status.NOT_APPLICABLE, f"No GPUs to test: {error}.")
        try:
            done = subprocess.run(
                [python, "-c", MATMUL_SCRIPT],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Result(
                "matmul", Status.FAILED, f"The GPU matmul test hung for over {timeout:g} s."
            )
        return matmul_verdict(done.returncode, done.stdout + done.stderr)

    return check


# --- directories ---------------------------------------------------------------------------


def disk_verdict(
    path: Path, free: int, write_rate: float, min_free: int, min_rate: float
) -> Result:
    name = f"disk {path}"
    if free < min_free:
        return Result(
            name,
            Status.FAILED,
            f"'{path}' has {free / 1e9:.2f} GB free, below the {min_free / 1e9:.2f} GB needed.",
        )
    if write_rate < min_rate:
        return Result(
            name,
            Status.FAILED,
            f"'{path}' takes writes at {write_rate / 1e6:.1f} MB/s, below "
            f"{min_rate / 1e6:.1f} MB/s.",
        )
    return Result(
        name, Status.OK, f"'{path}': {free / 1e9:.1f} GB free, {write_rate / 1e6:.0f} MB/s."
    )


def write_rate(path: Path, size: int = PROBE_BYTES) -> float:
    """Bytes per second of one synced write of ``size`` bytes, in a file removed afterwards."""
    probe = path / f".hpc-elastic-health-{os.getpid()}"
    started = time.monotonic()
    try:
        with open(probe, "wb") as file:
            file.write(b"\0" * size)
            file.flush()
            os.fsync(file.fileno())
        elapsed = time.monotonic() - started
    finally:
        probe.unlink(missing_ok=True)
    return size / max(elapsed, 1e-6)


WRITE_RATE_WINDOW = 20.0
"""Seconds over which a slow disk is probed again before it fails the node: see
``best_write_rate``."""
WRITE_RATE_PAUSE = 2.0
"""Seconds between two probes of a disk that was slow."""


def best_write_rate(
    path: Path,
    min_rate: float,
    measure: Callable[[Path], float] = write_rate,
    *,
    window: float = WRITE_RATE_WINDOW,
    pause: float = WRITE_RATE_PAUSE,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """The first probe that is fast enough, else the best of the probes over ``window`` s.

    One synced write on a shared, loaded machine can stall for seconds behind other
    processes' fsyncs (the CI suite saw healthy nodes excluded, and remembered as bad for a
    day, at load 20-37), and such stalls come in bursts: three probes back to back, the rule
    before this one, can all land in the same burst. Probes spread over a window outlast it;
    a disk that is really slow is slow for the whole window. A healthy node pays one probe; a
    sick one pays ``window`` seconds before its slot is requeued elsewhere."""
    deadline = clock() + window
    best = measure(path)
    while best < min_rate and clock() + pause < deadline:
        sleep(pause)
        best = max(best, measure(path))
    return best


def disk_check(
    path: Path,
    min_free: int = MIN_FREE_BYTES,
    min_rate: float = MIN_WRITE_RATE,
    measure: Callable[[Path], float] = write_rate,
    window: float = WRITE_RATE_WINDOW,
) -> Check:
    def check() -> Result:
        path.mkdir(parents=True, exist_ok=True)
        rate = best_write_rate(path, min_rate, measure, window=window)
        return disk_verdict(path, shutil.disk_usage(path).free, rate, min_free, min_rate)

    return check


# --- ZooKeeper -----------------------------------------------------------------------------


def clock_verdict(
    sent: float, received: float, server_time: float | None, max_skew: float
) -> Result:
    """Our clock against the server's, taken at the middle of the round trip; the round trip
    bounds how wrong that estimate can be, so it is allowed on top of ``max_skew``."""
    if server_time is None:
        return Result("clock", Status.NOT_APPLICABLE, "ZooKeeper did not tell its time.")
    skew = (sent + received) / 2 - server_time
    if abs(skew) > max_skew + (received - sent):
        return Result(
            "clock",
            Status.FAILED,
            f"This node's clock is {skew:+.1f} s off ZooKeeper's, beyond {max_skew:g} s.",
        )
    return Result("clock", Status.OK, f"Clock within {abs(skew):.2f} s of ZooKeeper's.")


def zookeeper_checks(
    zk: str, max_skew: float = MAX_CLOCK_SKEW, connect_timeout: float = zookeeper.CONNECT_TIMEOUT
) -> dict[str, Check]:
    """Reachability and clock skew from one probe, which runs once for both."""
    found: list[zookeeper.Probe] = []

    def reachable() -> Result:
        found.append(zookeeper.probe(zk, connect_timeout))
        rtt = found[0].received - found[0].sent
        return Result("zookeeper", Status.OK, f"ZooKeeper at '{zk}' answered in {rtt:.3f} s.")

    def clock() -> Result:
        if not found:
            return Result("clock", Status.NOT_APPLICABLE, "ZooKeeper was not reached.")
        return clock_verdict(found[0].sent, found[0].received, found[0].server_time, max_skew)

    return {"zookeeper": reachable, "clock": clock}


def default_checks(
    directories: Sequence[Path], zk: str | None = None, expected_gpus: int | None = None
) -> dict[str, Check]:
    """The built-in preflight: GPUs, each directory, ZooKeeper when the job uses it."""
    checks: dict[str, Check] = {"gpu": gpu_check(expected_gpus), "matmul": matmul_check()}
    for directory in dict.fromkeys(directories):
        checks[f"disk {directory}"] = disk_check(directory)
    if zk is not None:
        checks.update(zookeeper_checks(zk))
    return checks


# --- the preflight as the agent runs it ----------------------------------------------------


class BadNodeStore(Protocol):
    """Where the user's bad nodes are remembered (``zookeeper.BadNodeBook``)."""

    def remember(self, record: BadNode) -> None: ...

    def records(self) -> list[BadNode]: ...


@dataclass(frozen=True)
class Preflight:
    results: tuple[Result, ...]
    reason: str | None
    """Why this node must not join; None for a healthy node."""
    exclude: str
    """Slurm's ``ExcNodeList`` for the requeue: the user's bad nodes, this one included."""

    @property
    def healthy(self) -> bool:
        return self.reason is None


def preflight(
    checks: Mapping[str, Check],
    *,
    node: str,
    job: str,
    now: float,
    book: BadNodeStore | None = None,
    ttl: float = DEFAULT_TTL,
    emit: Callable[..., Any] | None = None,
) -> Preflight:
    """Run the checks before joining, remember a bad node, and say where not to go next.

    A node the user's memory still lists as bad is unhealthy without a second look: it
    failed a check recently, and a check that passes once (a flaky GPU) proves little.
    Losing the memory (ZooKeeper down) loses only the memory: the checks still decide.
    """
    results = tuple(run(checks))
    reason = verdict(results)
    records: list[BadNode] = []
    if book is not None:
        try:
            records = book.records()
            known = {record.host: record for record in current(records, now)}
            if reason is None and node in known:
                reason = f"Node '{node}' is remembered as bad: {known[node].reason}"
            elif reason is not None:
                record = remembered(node, reason, now, ttl, job)
                book.remember(record)
                records.append(record)
        except HpcElasticError as error:  # ZooKeeper down, or the user's secret unreadable.
            logger.warning("health: the bad-node memory is unavailable: %s", error)
    exclude = exclude_list(records, now, also=[node] if reason is not None else [])
    logger.debug("health: node %s %s; exclude %r", node, reason or "healthy", exclude)
    if emit is not None:
        emit(
            Kind.HEALTH,
            node=node,
            healthy=reason is None,
            reason=reason,
            checks={result.check: result.status.value for result in results},
            exclude=exclude,
        )
    return Preflight(results, reason, exclude)
