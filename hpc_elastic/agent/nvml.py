"""The GPUs as NVML sees them: the only module that imports ``pynvml`` (nvidia-ml-py).

``pynvml`` is imported when asked, not at import time, so a node without the package or the
driver simply has no GPUs to check ("not applicable"), and tests fake NVML at exactly this
boundary by putting their own ``pynvml`` in ``sys.modules``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Gpu:
    """One GPU's identity and the error counters that say it should not be trusted."""

    index: int
    name: str
    uncorrected_ecc: int | None
    """Volatile (since the driver loaded) uncorrectable ECC errors; None where not supported."""
    retired_pages_pending: bool | None
    """A page is waiting to be retired at the next reset: memory known bad, still in use."""
    remap_failed: bool | None
    """Row remapping (A100 and newer) ran out of spare rows: the GPU needs service."""


class NvmlUnavailable(Exception):
    """No NVML here (no package, no driver, no GPU): the GPU checks do not apply."""


def gpus() -> list[Gpu]:
    """Every GPU NVML lists, or NvmlUnavailable; NVML is shut down again before returning."""
    try:
        nvml: Any = importlib.import_module("pynvml")
    except ImportError as error:
        raise NvmlUnavailable("the nvidia-ml-py package is not installed") from error
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        raise NvmlUnavailable(f"NVML did not start ({error})") from error
    try:
        return [_gpu(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
    finally:
        nvml.nvmlShutdown()


def _gpu(nvml: Any, index: int) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = nvml.nvmlDeviceGetName(handle)
    pending = _supported(nvml, lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    remapped = _supported(nvml, lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    gpu = Gpu(
        index=index,
        name=name.decode() if isinstance(name, bytes) else str(name),
        uncorrected_ecc=_supported(
            nvml,
            lambda: int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            ),
        ),
        retired_pages_pending=None if pending is None else pending == nvml.NVML_FEATURE_ENABLED,
        # (corrected rows, uncorrected rows, remap pending, remap failure occurred)
        remap_failed=None if remapped is None else bool(remapped[3]),
    )
    logger.debug("nvml: %s", gpu)
    return gpu


def _supported(nvml: Any, query: Callable[[], T]) -> T | None:
    """A query's answer, or None where this GPU or driver does not support it (consumer GPUs
    have no ECC, pre-A100 GPUs no row remapping): unknown is not unhealthy."""
    try:
        return query()
    except nvml.NVMLError as error:
        logger.debug("nvml: query not supported: %s", error)
        return None
