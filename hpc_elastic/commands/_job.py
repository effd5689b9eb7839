"""What the job commands share: the JOB argument, ``--log-dir`` and where job directories live."""

from __future__ import annotations

from pathlib import Path

import click

from hpc_elastic.ops import jobs

log_dir_option = click.option(
    "--log-dir",
    type=click.Path(path_type=Path),
    metavar="DIR",
    help="Where job directories live. Default: the config file's, else ./hpc-elastic-runs.",
)
"""``--log-dir DIR``, given to the function as ``log_dir`` (a ``Path``, or None)."""
job_argument = click.argument("job", help="A run id, a job directory or a Slurm job id.")
"""The JOB argument, given to the function as ``job``."""


def log_dir_of(flag: Path | None) -> Path:
    """``--log-dir``, else the config file's ``log-dir``, else ``./hpc-elastic-runs``."""
    return jobs.log_dir(flag)
