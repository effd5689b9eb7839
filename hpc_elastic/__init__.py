"""hpc-elastic: keep multi-node PyTorch training alive on Slurm while nodes come and go.

The Python API (``submit``, ``jobs``, ``Job``) is imported on first use, so ``import
hpc_elastic`` stays cheap (no click, no jinja2, never torch) for the agent and the workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_elastic._version import __version__

__all__ = ["Executor", "Job", "RankOutput", "__version__", "jobs", "submit"]

if TYPE_CHECKING:
    from hpc_elastic.api import Job, RankOutput, jobs, submit
    from hpc_elastic.submitit_plugin import HpcElasticExecutor as Executor

_API = frozenset({"Job", "RankOutput", "jobs", "submit"})


def __getattr__(name: str) -> Any:
    """PEP 562: ``hpc_elastic.submit`` and friends load ``hpc_elastic.api`` when first named."""
    if name == "Executor":  # submitit's executor: submitit is imported only now
        from hpc_elastic.submitit_plugin import HpcElasticExecutor  # noqa: PLC0415

        return HpcElasticExecutor
    if name in _API:
        from hpc_elastic import api  # noqa: PLC0415

        return getattr(api, name)
    raise AttributeError(f"module 'hpc_elastic' has no attribute {name!r}")
