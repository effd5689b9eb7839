"""What the job commands share: the JOB argument, ``--log-dir`` and where job directories live."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hpc_elastic.config import load_config
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
    if flag is not None:
        return flag
    configured = load_config(Path.cwd()).values.get("log_dir")
    return Path(str(configured)) if configured else jobs.DEFAULT_LOG_DIR
