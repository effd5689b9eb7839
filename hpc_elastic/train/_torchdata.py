"""torchdata's ``StatefulDataLoader``, behind this one module: it is optional
(``pip install 'hpc-elastic[data]'``), and nothing else here imports it or reads its state.

A ``StatefulDataLoader``'s ``state_dict()`` holds, per loader worker, the state of that
worker's dataset iterator as of the last batch the loader handed out (workers send it along
with their batches; ``snapshot_every_n_steps`` says how often), and the number of batches
handed out since. ``iterator_states`` reads those out of the nested dict; its layout is
torchdata's own, not a public format, and was read off the versions in ``TESTED``. A state of
another layout is refused in one sentence rather than misread.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

from hpc_elastic.errors import DataError

TESTED = {"torchdata": ("0.11.0",), "torch": ("2.13.0",)}
"""The versions the stateful-loader support was tested with (docs/training.md says so too)."""
INSTALL_HINT = "pip install 'hpc-elastic[data]'"

# torchdata 0.11's key names (stateful_dataloader.py, incremental_state.py).
_NUM_YIELDED = "_num_yielded"
_SNAPSHOT = "_snapshot"
_WORKER_SNAPSHOTS = "_worker_snapshots"
_MAIN_SNAPSHOT = "_main_snapshot"
_NUM_WORKERS = "_num_workers"
_STEPS_SINCE_SNAPSHOT = "_steps_since_snapshot"
_FETCHER_STATE = "fetcher_state"
_DATASET_ITER_STATE = "dataset_iter_state"


def loader_class() -> type[Any]:
    """``torchdata.stateful_dataloader.StatefulDataLoader``, or one sentence saying how to
    install it."""
    try:
        module = importlib.import_module("torchdata.stateful_dataloader")
    except ImportError as error:
        raise DataError(
            f"torchdata is not installed ({error}); {INSTALL_HINT} (tested: torchdata "
            f"{', '.join(TESTED['torchdata'])} with torch {', '.join(TESTED['torch'])})."
        ) from error
    found: type[Any] = module.StatefulDataLoader
    return found


def stateful_loader(dataset: Any, **options: Any) -> Any:
    """``StatefulDataLoader(dataset, **options)``: a loader whose state (workers included)
    ``TrainState(loader=...)`` keeps in checkpoints."""
    return loader_class()(dataset, **options)


def version() -> str | None:
    """The installed torchdata's version, or None."""
    try:
        return metadata.version("torchdata")
    except metadata.PackageNotFoundError:
        return None


def is_stateful(loader: object) -> bool:
    """A loader with ``state_dict``/``load_state_dict``, as ``StatefulDataLoader`` has."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def iterator_states(state: dict[str, Any]) -> tuple[list[Any], int]:
    """The state of every worker's dataset iterator (one, without workers), in worker order,
    and the batches the loader handed out after those states were taken."""
    try:
        if _SNAPSHOT in state:
            workers = state[_SNAPSHOT][_WORKER_SNAPSHOTS]
            found = [
                workers[f"worker_{w}"][_FETCHER_STATE][_DATASET_ITER_STATE]
                for w in range(len(workers))
            ]
            return found, int(state[_STEPS_SINCE_SNAPSHOT])
        if _NUM_YIELDED in state:
            return [state[_FETCHER_STATE][_DATASET_ITER_STATE]], 0
    except (KeyError, TypeError) as error:
        raise _unknown(state, error) from error
    raise _unknown(state, None)


def num_workers(state: dict[str, Any]) -> int:
    """The loader's ``num_workers`` when ``state`` was taken."""
    try:
        if _SNAPSHOT in state:
            return int(state[_SNAPSHOT][_MAIN_SNAPSHOT][_NUM_WORKERS])
        if _NUM_YIELDED in state:
            return 0
    except (KeyError, TypeError) as error:
        raise _unknown(state, error) from error
    raise _unknown(state, None)


def _unknown(state: object, error: Exception | None) -> DataError:
    keys = sorted(map(str, state))[:6] if isinstance(state, dict) else type(state).__name__
    cause = f" ({error!r})" if error is not None else ""
    return DataError(
        f"The loader's state has a layout this version of hpc-elastic does not know "
        f"(keys {keys}){cause}, with torchdata {version()}; use torchdata "
        f"{' or '.join(TESTED['torchdata'])}."
    )
