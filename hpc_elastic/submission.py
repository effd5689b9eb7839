"""The submit use-case: plan a job, then write its directory and sbatch it.

What a job directory holds is told in ``hpc_elastic.jobdir``; ``job.json`` is written twice,
before sbatch (so a crash leaves a readable record) and once sbatch has answered with the job id.

Unless ``--no-snapshot``, the plan also decides the job's code snapshot (``hpc_elastic.snapshot``)
and points the script into it: the worker runs the copy of the script, and when ``submit`` was
run from inside the project, sbatch's ``--chdir`` is the same place in the copy (from outside,
the working directory stays where ``submit`` ran, as sbatch's default). Slurm keeps the script
as submitted, so every array task and every requeue runs the copy.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Protocol

from hpc_elastic import checkpoint_key, snapshot, trust
from hpc_elastic._version import __version__
from hpc_elastic.errors import HpcElasticError, SnapshotError, UsageError
from hpc_elastic.jobdir import (
    JOB_FILE,
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    SCRIPT_FILE,
    SECRET_FILE,
    JobDir,
    JobRecord,
    make_log_dir,
    make_private_dir,
    write_private,
    write_private_bytes,
)
from hpc_elastic.render import RenderContext, SbatchScript, render, render_growth
from hpc_elastic.spec import JobSpec

_log = logging.getLogger(__name__)

__all__ = [
    "JOB_FILE",
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "SCRIPT_FILE",
    "SECRET_FILE",
    "Plan",
    "SubmittedJob",
    "make_private_dir",
    "new_run_id",
    "plan",
    "submit",
    "write_private",
]


class SlurmCommands(Protocol):
    """The Slurm calls submit needs; ``hpc_elastic.slurm.commands`` in real life."""

    def sbatch(self, script_text: str, extra_args: Sequence[str] = ()) -> object: ...

    def partitions(self) -> list[str]: ...

    def cancel(self, job_id: str) -> None:
        """Take back a job submitted already (the first array, when the second is refused)."""


@dataclass(frozen=True)
class Plan:
    """A job ready to submit: what it is, where it goes, and its script."""

    spec: JobSpec
    context: RenderContext
    script: SbatchScript
    code: snapshot.Manifest | None = None
    """What the code snapshot will hold; None with ``--no-snapshot``."""
    grow: SbatchScript | None = None
    """The growth slots' array script (``--grow-partition``/``--grow-qos``), submitted right
    after ``script`` as a second Slurm job of the same run; None: one array holds every slot."""

    def shown(self) -> str:
        """What ``render`` prints: the script, and the growth array's after a marked line."""
        if self.grow is None:
            return self.script.text
        return f"{self.script.text}\n{GROW_SEPARATOR}\n{self.grow.text}"

    @property
    def job_dir(self) -> Path:
        return self.context.job_dir

    @property
    def paths(self) -> JobDir:
        return JobDir(self.context.job_dir)


GROW_SEPARATOR = "# ---- the growth slots' array, submitted as a second job of the same run ----"
"""The line ``render`` prints between the two scripts of a job that grows elsewhere."""


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    plan: Plan
    grow_job_id: str | None = None


RUN_ID_RANDOM_BYTES = 16
"""128 random bits: the name and the time are public (``squeue`` shows both), so the suffix
alone keeps another user from guessing the run id and squatting its znode before the job runs."""


def new_run_id(job_name: str, now: datetime, suffix: str | None = None) -> str:
    """``<job-name>-<yyyymmdd-hhmmss>-<32 hex>``: sortable by time, unguessable by others."""
    return f"{job_name}-{now:%Y%m%d-%H%M%S}-{suffix or secrets.token_hex(RUN_ID_RANDOM_BYTES)}"


def plan(
    spec: JobSpec,
    command_line: Sequence[str],
    python: str,
    now: datetime,
    suffix: str | None = None,
    *,
    cwd: Path | None = None,
) -> Plan:
    """Decide the run id, job directory and code snapshot, and render the script; reads the
    project (``snapshot.survey``) but writes nothing. ``cwd``: where ``submit`` runs."""
    run_id = new_run_id(spec.job_name, now, suffix)
    paths = JobDir.under(spec.log_dir, run_id)
    code = None
    if spec.snapshot:
        code = snapshot.survey(
            spec.script,
            spec.log_dir,
            spec.snapshot_max_mb,
            max_files=spec.snapshot_max_files,
            root=spec.snapshot_root,
        )
        spec = run_from_copy(spec, code, paths.code, Path.cwd() if cwd is None else cwd)
    context = RenderContext(
        version=__version__,
        command_line=tuple(command_line),
        python=python,
        run_id=run_id,
        job_dir=paths.path,
    )
    return Plan(spec, context, render(spec, context), code, render_growth(spec, context))


def run_from_copy(spec: JobSpec, code: snapshot.Manifest, copy: Path, cwd: Path) -> JobSpec:
    """``spec`` with its script in the copy, and sbatch's ``--chdir`` the copy of ``cwd`` when
    ``cwd`` is in the project (a user's own ``--chdir`` wins)."""
    script = code.inside(spec.script, copy)
    assert script is not None, "survey puts the script's directory in the project"
    real_cwd = Path(os.path.realpath(cwd))
    if not real_cwd.is_relative_to(code.source) or _sets_chdir(spec.sbatch_args):
        return replace(spec, script=script)
    workdir = copy / real_cwd.relative_to(code.source)
    if any(char.isspace() or not char.isprintable() for char in str(workdir)):
        raise SnapshotError(
            f"The working directory {str(real_cwd)!r} holds spaces or control characters, which "
            "sbatch's --chdir cannot take; submit from a directory without them, or with "
            "--no-snapshot."
        )
    _log.debug("the job runs %s from %s", script, workdir)
    return replace(spec, script=script, sbatch_args=(*spec.sbatch_args, f"--chdir={workdir}"))


def _sets_chdir(sbatch_args: Sequence[str]) -> bool:
    return any(arg.split("=", 1)[0] == "--chdir" or arg.startswith("-D") for arg in sbatch_args)


def submit(
    job: Plan, slurm: SlurmCommands, files: Mapping[str, bytes] | None = None
) -> SubmittedJob:
    """Write the job directory, then sbatch the script; on failure nothing is left behind.

    ``files`` (name -> bytes) are written into the job directory, mode 0600, before sbatch, so
    the job never starts without them (the submitit plugin's pickled callable). A job that
    grows elsewhere is two sbatch calls: when Slurm refuses the growth array, the first one
    is cancelled again, so a run is either both arrays or nothing."""
    _check_partition(job.spec, slurm)
    _write_job_dir(job, files or {})
    try:
        job_id = str(slurm.sbatch(job.script.text))
    except HpcElasticError:
        shutil.rmtree(job.job_dir, ignore_errors=True)
        raise
    grow_job_id = None
    if job.grow is not None:
        try:
            grow_job_id = str(slurm.sbatch(job.grow.text))
        except HpcElasticError:
            _log.debug("the growth array was refused: cancelling job %s", job_id)
            slurm.cancel(job_id)
            shutil.rmtree(job.job_dir, ignore_errors=True)
            raise
    _write_job_json(job, job_id, grow_job_id)
    return SubmittedJob(job_id, job, grow_job_id)


def _check_partition(spec: JobSpec, slurm: SlurmCommands) -> None:
    given = [
        (option, name)
        for option, name in (
            ("--partition", spec.partition),
            ("--grow-partition", spec.grow_partition),
        )
        if name is not None
    ]
    if not given:
        return
    known = slurm.partitions()
    for option, name in given:
        if name not in known:
            raise UsageError(
                f"{option} '{name}' does not exist on this cluster; "
                f"use one of {', '.join(known) or '(none found)'} (see `sinfo -s`)."
            )


def _write_job_dir(job: Plan, files: Mapping[str, bytes]) -> None:
    """The job directory, complete before sbatch; a failure part way removes it again."""
    log_dir = job.job_dir.parent
    _refuse_unsafe_log_dir(log_dir)  # before anything is written
    try:
        make_log_dir(log_dir)
        _refuse_unsafe_log_dir(log_dir)  # again: who else could have made it meanwhile
        make_private_dir(job.job_dir)
    except OSError as err:
        raise _unwritable(job, err) from err
    try:
        write_private(job.paths.secret, secrets.token_hex(32), exclusive=True)
        checkpoint_key.write_key(job.paths.checkpoint_key)  # the user's, from the user's secret
        write_private(job.paths.sbatch_script, job.script.text)
        if job.grow is not None:
            write_private(job.paths.grow_sbatch_script, job.grow.text)
        for name, data in files.items():
            write_private_bytes(job.job_dir / name, data)
        if job.code is not None:
            snapshot.take(job.code, job.paths.code)
        _write_job_json(job, None, None)
    except OSError as err:
        shutil.rmtree(job.job_dir, ignore_errors=True)
        raise _unwritable(job, err) from err
    except HpcElasticError:
        shutil.rmtree(job.job_dir, ignore_errors=True)
        raise


def _refuse_unsafe_log_dir(log_dir: Path) -> None:
    """Refuse a log directory in which, or above which, another user may rename entries: they
    could put a directory of theirs, with their code and a link to our secret, in place of a
    job's while it waits in the queue. The agents would refuse the swapped directory, but
    the job would never run; this keeps the swap from being possible."""
    found = trust.unsafe_parent(log_dir)
    if found is None:
        return
    where = found.directory
    fix = f"run 'chmod +t {where}' or 'chmod go-w {where}', or give" if found.ours else "give"
    raise UsageError(
        f"--log-dir '{log_dir}' is not safe for job directories: '{where}' is refused because "
        f"{found.reason}, so someone could put a directory of theirs in place of a job's "
        f"before it runs; {fix} a --log-dir under directories only you (and root) can write."
    )


def _unwritable(job: Plan, err: OSError) -> UsageError:
    return UsageError(
        f"Job directory '{job.job_dir}' cannot be created ({err.strerror}); "
        "choose a writable --log-dir."
    )


def _write_job_json(job: Plan, job_id: str | None, grow_job_id: str | None) -> None:
    """Written once before sbatch (so a crash leaves a readable record) and once after."""
    spec = asdict(job.spec)
    spec.update(nodes=str(job.spec.nodes), signal=str(job.spec.signal), env=dict(job.spec.env))
    JobRecord(
        run_id=job.context.run_id,
        job_dir=job.job_dir,
        job_id=job_id,
        local=False,
        zk=job.spec.zk,
        nodes=str(job.spec.nodes),
        nproc_per_node=job.spec.nproc_per_node,
        max_restarts=job.spec.max_restarts,
        version=job.context.version,
        command_line=job.context.command_line,
        template=job.script.template,
        spec=spec,
        snapshot=None if job.code is None else job.code.record(job.paths.code),
        grow_job_id=grow_job_id,
    ).write()
