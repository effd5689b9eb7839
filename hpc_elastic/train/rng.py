"""Capture and restore every random number generator a training loop draws from.

States are stored as tensors and plain Python values, so a checkpoint loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """Python's, NumPy's, torch's CPU and (when present) every CUDA generator, as they are now."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": position,
            "has_gauss": has_gauss,
            "cached_gaussian": cached_gaussian,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put the generators back exactly; CUDA states are skipped on a machine without CUDA."""
    random.setstate(_as_python_state(state["python"]))
    saved = state["numpy"]
    np.random.set_state(
        (
            saved["kind"],
            saved["keys"].numpy().astype(np.uint32),
            saved["position"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        devices = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(state["cuda"][:devices])


def _as_python_state(saved: Any) -> tuple[Any, ...]:
    """``random.setstate`` wants tuples, and serializers may hand lists back."""
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)
