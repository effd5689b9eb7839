"""Finding a job's directory from what the user types: a run id, a path or a Slurm job id."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_elastic import events
from hpc_elastic.errors import UsageError
from hpc_elastic.submit import JOB_FILE, SECRET_FILE

DEFAULT_LOG_DIR = Path("hpc-elastic-runs")
_SLURM_ID = re.compile(r"(\d+)(?:_\d+)?")


@dataclass(frozen=True)
class JobRecord:
    """A job as its ``job.json`` describes it; the same for submitted and local runs."""

    run_id: str
    job_dir: Path
    job_id: str | None
    local: bool
    zk: str | None
    nodes: str
    nproc_per_node: int
    max_restarts: int
    runner_pid: int | None = None
    """The ``hpc-elastic run`` process of a local run."""

    @property
    def events_file(self) -> Path:
        return self.job_dir / "events.jsonl"

    @property
    def log_dir(self) -> Path:
        return self.job_dir / "logs"

    @property
    def secret_file(self) -> Path:
        return self.job_dir / SECRET_FILE

    def events(self) -> list[events.Event]:
        return list(events.read(self.events_file))

    def runner_alive(self) -> bool:
        if self.runner_pid is None:
            return False
        try:
            os.kill(self.runner_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def load(job_dir: Path) -> JobRecord:
    path = job_dir / JOB_FILE
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        spec = raw.get("spec", {})
        return JobRecord(
            run_id=str(raw["run_id"]),
            job_dir=job_dir.absolute(),
            job_id=str(raw["job_id"]) if raw.get("job_id") else None,
            local=raw.get("mode") == "local",
            zk=raw.get("zk") or spec.get("zk"),
            nodes=str(spec.get("nodes", "?")),
            nproc_per_node=int(spec.get("nproc_per_node", 1)),
            max_restarts=int(spec.get("max_restarts", 0)),
            runner_pid=raw.get("pid"),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise UsageError(
            f"'{path}' is not a readable hpc-elastic job record; check that '{job_dir}' is a "
            "job directory made by `hpc-elastic submit` or `hpc-elastic run`."
        ) from error


def scan(log_dir: Path) -> list[JobRecord]:
    """Every job under ``log_dir``, oldest first; unreadable directories are skipped."""
    records = []
    for job_file in sorted(log_dir.glob(f"*/{JOB_FILE}"), key=lambda p: p.stat().st_mtime):
        try:
            records.append(load(job_file.parent))
        except UsageError:
            continue
    return records


def resolve(job: str, log_dir: Path) -> JobRecord:
    """``job`` as a job directory, a run id under ``log_dir`` or a Slurm job id in a job.json."""
    for candidate in (Path(job).expanduser(), log_dir / job):
        if (candidate / JOB_FILE).is_file():
            return load(candidate)
    match = _SLURM_ID.fullmatch(job.strip())
    if match is not None:
        for record in scan(log_dir):
            if record.job_id == match.group(1):
                return record
    raise UsageError(
        f"Job '{job}' is unknown: it is neither a job directory nor a run id or Slurm job id "
        f"under '{log_dir}'; run `hpc-elastic list --log-dir DIR` to see your jobs."
    )
