"""What ``hpc-elastic submit`` prints (``hpc_elastic/commands/submit.py``), read back in one
place for the integration tests that submit through the CLI: the Slurm job id and the job
directory. A change of those lines then breaks one helper, not every test that submits."""

from __future__ import annotations

import re
from pathlib import Path


def submitted(stdout: str) -> tuple[str, Path]:
    """The Slurm job id and the job directory that ``submit`` printed."""
    job = re.search(r"Submitted batch job (\d+)", stdout)
    job_dir = re.search(r"Job directory: (\S+)", stdout)
    assert job is not None, stdout
    assert job_dir is not None, stdout
    return job.group(1), Path(job_dir.group(1))
