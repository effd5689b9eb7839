"""Finding a job's directory from what the user types: a run id, a path or a Slurm job id.

Nothing in a ``job.json`` is trusted: a job directory may sit in a shared log directory, and
what it names reaches ``scancel``, ``kill`` and ZooKeeper. ``parse_record`` checks every field
(a numeric Slurm id, a pid above 1, a safe run id); a signal goes to a recorded pid only while
that process, or one of its children, carries this job's ``HPC_ELASTIC_RUN_ID`` marker in its
environment, which only the job's own processes have and only their owner can read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

from hpc_elastic.contract import DEFAULT_RUNS_DIR, RUN_ID_ENV
from hpc_elastic.errors import UsageError
from hpc_elastic.jobdir import JOB_FILE, JobDir, JobRecord, indexed

DEFAULT_LOG_DIR = DEFAULT_RUNS_DIR
"""``RUN_ID_ENV`` is set in the environment of a local run's agents (and so their workers): the
marker that proves a pid still belongs to this job before ``cancel`` signals it."""
__all__ = ["RUN_ID_ENV", "JobRecord", "is_job_process", "load", "parse_record", "runner_alive"]
_SLURM_ID = re.compile(r"(\d+)(?:_\d+)?")
_PROC = Path("/proc")
_log = logging.getLogger(__name__)


def log_dir(given: Path | str | None = None) -> Path:
    """Where job directories live: ``given``, else the config file's ``log-dir`` (the file found
    from the current directory), else ``./hpc-elastic-runs``. The JOB commands, the Python API
    and ``zk status`` all look there."""
    if given is not None:
        return Path(given)
    from hpc_elastic.config import load_config  # noqa: PLC0415 (the config file's reader and its option table: only without a --log-dir)

    configured = load_config(Path.cwd()).values.get("log_dir")
    return Path(str(configured)) if configured else DEFAULT_LOG_DIR


def runner_alive(record: JobRecord) -> bool:
    """Whether the recorded local runner still runs this job (not a recycled pid)."""
    return record.runner_pid is not None and is_job_process(record.runner_pid, record.run_id)


def is_job_process(pid: int, run_id: str, proc: Path = _PROC) -> bool:
    """Whether ``pid`` (> 1) or one of its children carries ``run_id``'s environment marker.

    The runner of a local run has no marker of its own (its environment was fixed before it
    chose the run id); its agents, started with the marker, vouch for it.
    """
    if pid <= 1:
        return False
    marker = f"{RUN_ID_ENV}={run_id}".encode()
    found = _has_marker(proc / str(pid), marker) or any(
        _has_marker(proc / str(child), marker) for child in _children(pid, proc)
    )
    _log.debug("pid %d %s job %s's marker", pid, "carries" if found else "lacks", run_id)
    return found


def _has_marker(process: Path, marker: bytes) -> bool:
    try:
        return marker in (process / "environ").read_bytes().split(b"\0")
    except OSError:
        return False  # gone, or another user's (its environ is unreadable to us)


def _children(pid: int, proc: Path) -> list[int]:
    """Children of ``pid`` from ``/proc/*/stat`` (field 4 is the parent's pid)."""
    children = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            children.append(int(stat.parent.name))
    return children


parse_record = JobRecord.from_json
"""A JobRecord from a decoded ``job.json``, every field checked (kept for old callers)."""
load = JobRecord.load
"""The record in a job directory, refused unless it is the user's own (see ``JobRecord.load``)."""


def scan(log_dir: Path) -> list[JobRecord]:
    """Every job under ``log_dir``, oldest first; an unreadable one is skipped, so one bad job
    never hides the others."""
    return _oldest_first(job_file.parent for job_file in log_dir.glob(f"*/{JOB_FILE}"))


def everywhere(log_dir: Path) -> list[JobRecord]:
    """Every job in the user's index, whatever log directory it used, and every job under
    ``log_dir`` (jobs made before the index existed), each once, oldest first."""
    under = [job_file.parent for job_file in log_dir.glob(f"*/{JOB_FILE}")]
    return _oldest_first([*indexed(), *under])


def _oldest_first(job_dirs: Iterable[Path]) -> list[JobRecord]:
    """The records of ``job_dirs`` (each directory once), by the age of their ``job.json``;
    a gone or unreadable one is skipped (``load`` checks it as if found anywhere)."""
    found = []
    for job_dir in dict.fromkeys(path.absolute() for path in job_dirs):
        try:
            found.append((JobDir(job_dir).record.stat().st_mtime, load(job_dir)))
        except (OSError, UsageError) as error:
            _log.debug("skipping %s: %s", job_dir, error)
    return [record for _, record in sorted(found, key=lambda pair: pair[0])]


def resolve(job: str, log_dir: Path) -> JobRecord:
    """``job`` as a job directory, a run id under ``log_dir`` or a Slurm job id in a job.json."""
    for candidate in _candidates(job, log_dir):
        if _is_file(candidate / JOB_FILE):
            return load(candidate)
    match = _SLURM_ID.fullmatch(job.strip())
    if match is not None:
        for record in scan(log_dir):
            if record.job_id == match.group(1):
                return record
    found = _from_index(job.strip(), match.group(1) if match else None)
    if found is not None:
        return found
    raise UsageError(
        f"Job '{job:.200}' is unknown: it is neither a job directory nor a run id or Slurm job id "
        f"under '{log_dir}'; run `hpc-elastic list --log-dir DIR` to see your jobs."
    )


def _from_index(run_id: str, job_id: str | None) -> JobRecord | None:
    """The newest indexed job with this run id or Slurm id, whatever ``--log-dir`` it used;
    each record is checked as if found anywhere (``load``), so a bad entry is skipped."""
    for job_dir in indexed():
        if job_dir.name != run_id and job_id is None:
            continue  # a run id names its directory: skip the others without reading them
        try:
            record = load(job_dir)
        except UsageError as error:
            _log.debug("skipping indexed %s: %s", job_dir, error)
            continue
        if record.run_id == run_id or (job_id is not None and record.job_id == job_id):
            return record
    return None


def _candidates(job: str, log_dir: Path) -> list[Path]:
    try:
        typed = Path(job).expanduser()
    except RuntimeError:  # "~nobody": no such user's home
        typed = Path(job)
    return [typed, log_dir / job]


def _is_file(path: Path) -> bool:
    """``Path.is_file`` that says False, not raises, for a name too long or holding NUL."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False
