"""Training-side helpers: checkpoints, elastic data (a sampler, shards), constant global batch,
preemption.

Use it as ``import hpc_elastic.train as elastic``. This is the only part of hpc-elastic that
imports torch, and it does so lazily. What the agent and the workers share lives below it, so
the agent never imports this package: the heartbeat, the lease and the round assignment in
``hpc_elastic.protocol``, the exit codes in ``hpc_elastic.contract``. ``heartbeat``, ``lease``,
``assignment`` and ``exitcodes`` here re-export them for training scripts that import them here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpc_elastic.contract import FENCED_EXIT_CODE, PREEMPTED_EXIT_CODE

if TYPE_CHECKING:
    from hpc_elastic.train._torchdata import stateful_loader
    from hpc_elastic.train.batch import BatchPlan, group, plan
    from hpc_elastic.train.checkpoint import (
        Checkpointer,
        TrainState,
        load,
        reading,
        save,
        verify,
    )
    from hpc_elastic.train.collectives import collective, watch_collectives
    from hpc_elastic.train.inplace import InPlace
    from hpc_elastic.train.preemption import (
        exit_preempted,
        finish,
        install_signal_handlers,
        requested,
        should_stop,
    )
    from hpc_elastic.train.sampler import ElasticSampler
    from hpc_elastic.train.sharded import load_sharded, save_sharded
    from hpc_elastic.train.shards import ElasticShards, TokenFiles, shard_paths

_LAZY = {
    "BatchPlan": "batch",
    "group": "batch",
    "plan": "batch",
    "Checkpointer": "checkpoint",
    "TrainState": "checkpoint",
    "load": "checkpoint",
    "reading": "checkpoint",
    "save": "checkpoint",
    "verify": "checkpoint",
    "collective": "collectives",
    "watch_collectives": "collectives",
    "exit_preempted": "preemption",
    "finish": "preemption",
    "install_signal_handlers": "preemption",
    "requested": "preemption",
    "should_stop": "preemption",
    "ElasticSampler": "sampler",
    "ElasticShards": "shards",
    "TokenFiles": "shards",
    "shard_paths": "shards",
    "stateful_loader": "_torchdata",
    "InPlace": "inplace",
    "load_sharded": "sharded",
    "save_sharded": "sharded",
}

__all__ = [
    "FENCED_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "BatchPlan",
    "Checkpointer",
    "ElasticSampler",
    "ElasticShards",
    "InPlace",
    "TokenFiles",
    "TrainState",
    "collective",
    "exit_preempted",
    "finish",
    "group",
    "install_signal_handlers",
    "load",
    "load_sharded",
    "plan",
    "reading",
    "requested",
    "save",
    "save_sharded",
    "shard_paths",
    "should_stop",
    "stateful_loader",
    "verify",
    "watch_collectives",
]


def __getattr__(name: str) -> Any:
    """Import the torch-using submodule only when its name is first used."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
