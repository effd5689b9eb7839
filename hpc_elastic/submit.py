"""The submit use-case: plan a job, then write its directory and sbatch it.

A job directory holds everything one run needs and leaves behind::

    <log-dir>/<run-id>/
        secret        per-job ZooKeeper secret, mode 0600; never on a command line or in the script
        sbatch.sh     the script exactly as submitted
        job.json      the spec, the run id and, once sbatch answered, the Slurm job id
        slurm-*.out   Slurm's output, one file per array task (elastic) or per job (fixed)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from hpc_elastic import __version__
from hpc_elastic.errors import HpcElasticError, UsageError
from hpc_elastic.render import RenderContext, SbatchScript, render
from hpc_elastic.spec import JobSpec

SECRET_FILE = "secret"
SCRIPT_FILE = "sbatch.sh"
JOB_FILE = "job.json"


class SlurmCommands(Protocol):
    """The two Slurm calls submit needs; ``hpc_elastic.slurm.commands`` in real life."""

    def sbatch(self, script_text: str, extra_args: Sequence[str] = ()) -> object: ...

    def partitions(self) -> list[str]: ...


@dataclass(frozen=True)
class Plan:
    """A job ready to submit: what it is, where it goes, and its script."""

    spec: JobSpec
    context: RenderContext
    script: SbatchScript

    @property
    def job_dir(self) -> Path:
        return self.context.job_dir


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    plan: Plan

    @property
    def log_pattern(self) -> Path:
        """Where Slurm writes the job's output (the built-in templates' --output)."""
        elastic = self.plan.spec.nodes.is_elastic
        return self.plan.job_dir / (
            f"slurm-{self.job_id}_*.out" if elastic else f"slurm-{self.job_id}.out"
        )


def new_run_id(job_name: str, now: datetime, suffix: str | None = None) -> str:
    """``<job-name>-<yyyymmdd-hhmmss>-<4 hex>``: sortable by time, unique across quick resubmits."""
    return f"{job_name}-{now:%Y%m%d-%H%M%S}-{suffix or secrets.token_hex(2)}"


def plan(
    spec: JobSpec,
    command_line: Sequence[str],
    python: str,
    now: datetime,
    suffix: str | None = None,
) -> Plan:
    """Decide the run id and job directory, and render the script; touches nothing."""
    run_id = new_run_id(spec.job_name, now, suffix)
    context = RenderContext(
        version=__version__,
        command_line=tuple(command_line),
        python=python,
        run_id=run_id,
        job_dir=spec.log_dir.absolute() / run_id,
    )
    return Plan(spec, context, render(spec, context))


def submit(job: Plan, slurm: SlurmCommands) -> SubmittedJob:
    """Write the job directory, then sbatch the script; on failure nothing is left behind."""
    _check_partition(job.spec, slurm)
    _write_job_dir(job)
    try:
        job_id = str(slurm.sbatch(job.script.text))
    except HpcElasticError:
        shutil.rmtree(job.job_dir, ignore_errors=True)
        raise
    _write_job_json(job, job_id)
    return SubmittedJob(job_id, job)


def _check_partition(spec: JobSpec, slurm: SlurmCommands) -> None:
    if spec.partition is None:
        return
    known = slurm.partitions()
    if spec.partition not in known:
        raise UsageError(
            f"--partition '{spec.partition}' does not exist on this cluster; "
            f"use one of {', '.join(known) or '(none found)'} (see `sinfo -s`)."
        )


def _write_job_dir(job: Plan) -> None:
    try:
        job.job_dir.mkdir(parents=True)
        descriptor = os.open(job.job_dir / SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as secret:
            secret.write(secrets.token_hex(32))
        (job.job_dir / SCRIPT_FILE).write_text(job.script.text)
    except OSError as err:
        raise UsageError(
            f"Job directory '{job.job_dir}' cannot be created ({err.strerror}); "
            "choose a writable --log-dir."
        ) from err
    _write_job_json(job, None)


def _write_job_json(job: Plan, job_id: str | None) -> None:
    """Written once before sbatch (so a crash leaves a readable record) and once after."""
    spec = asdict(job.spec)
    spec.update(nodes=str(job.spec.nodes), signal=str(job.spec.signal), env=dict(job.spec.env))
    record = {
        "run_id": job.context.run_id,
        "job_id": job_id,
        "job_dir": str(job.job_dir),
        "version": job.context.version,
        "command_line": list(job.context.command_line),
        "template": job.script.template,
        "spec": spec,
    }
    temporary = job.job_dir / f".{JOB_FILE}.tmp"
    temporary.write_text(json.dumps(record, indent=2, default=str) + "\n")
    temporary.replace(job.job_dir / JOB_FILE)
