"""What the job commands share: the JOB argument, ``--log-dir`` and where job directories live."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hpc_elastic.ops import jobs

LogDir = Annotated[
    Path | None,
    typer.Option(
        metavar="DIR",
        help="Where job directories live. Default: the config file's, else ./hpc-elastic-runs.",
    ),
]
JobArg = Annotated[
    str,
    typer.Argument(metavar="JOB", help="A run id, a job directory or a Slurm job id."),
]


def log_dir_of(flag: Path | None) -> Path:
    """``--log-dir``, else the config file's ``log-dir``, else ``./hpc-elastic-runs``."""
    return jobs.log_dir(flag)
