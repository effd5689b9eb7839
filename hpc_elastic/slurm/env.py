"""What Slurm tells a process about its job, read once from the environment into a frozen value.

submitit's ``SlurmJobEnvironment`` reads ``os.environ`` itself and knows neither the node name
nor the restart count, so it does not fit an agent that is tested with a plain dict. Nothing here
expands ``SLURM_JOB_NODELIST``: no product path needs the host names (the agents find each other
through the rendezvous), and the scripts that do use ``scontrol show hostnames``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hpc_elastic.errors import SlurmError


def _optional_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError as error:
        raise SlurmError(
            f"{name}='{text}' is not a number; run inside a Slurm job or unset {name}."
        ) from error


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = _optional_int(environ, name)
    return default if value is None else value


@dataclass(frozen=True)
class SlurmContext:
    """The job, array task, node and step this process runs in."""

    job_id: str
    node_name: str
    node_id: int
    num_nodes: int
    nodelist: str
    restart_count: int = 0
    """How often Slurm requeued the job (SLURM_RESTART_COUNT, absent before the first requeue)."""
    array_job_id: str | None = None
    array_task_id: int | None = None
    step_id: str | None = None
    """None in the batch script, the step number inside ``srun``."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SlurmContext | None:
        """None outside a Slurm job, so callers can fall back to local mode."""
        job_id = environ.get("SLURM_JOB_ID")
        if not job_id:
            return None
        return cls(
            job_id=job_id,
            node_name=environ.get("SLURMD_NODENAME", ""),
            node_id=_int(environ, "SLURM_NODEID", 0),
            num_nodes=_int(environ, "SLURM_JOB_NUM_NODES", _int(environ, "SLURM_NNODES", 1)),
            nodelist=environ.get("SLURM_JOB_NODELIST", ""),
            restart_count=_int(environ, "SLURM_RESTART_COUNT", 0),
            array_job_id=environ.get("SLURM_ARRAY_JOB_ID") or None,
            array_task_id=_optional_int(environ, "SLURM_ARRAY_TASK_ID"),
            step_id=environ.get("SLURM_STEP_ID") or None,
        )

    @property
    def slot(self) -> str:
        """The stable name of this node's place in the job: array task id, else node name."""
        return str(self.array_task_id) if self.array_task_id is not None else self.node_name
