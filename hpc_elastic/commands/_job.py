"""What the commands share: the JOB argument, ``--log-dir`` and where job directories live, and
the flags several commands declare alike (a duration, a count)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from hpc_elastic.clicktools import Parsed
from hpc_elastic.ops import jobs
from hpc_elastic.spec import count_parser, seconds_parser

Decorated = TypeVar("Decorated", bound=Callable[..., Any])

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


def seconds_option(
    flag: str, help: str, *, default: float | None = None
) -> Callable[[Decorated], Decorated]:
    """A flag that takes a duration (``90``, ``2m``, ``1h30m``), parsed and checked as every
    duration flag is (``seconds_parser``: a bad one is one sentence quoting it), shown as
    ``S``."""
    return click.option(
        flag, type=Parsed(seconds_parser(flag)), default=default, metavar="S", help=help
    )


def count_option(
    flag: str,
    help: str,
    *,
    default: int | None = None,
    zero_ok: bool = False,
    metavar: str = "N",
    shown: str | None = None,
) -> Callable[[Decorated], Decorated]:
    """A flag that takes a whole number, at least 1 (or 0 with ``zero_ok``), checked as every
    count flag is (``count_parser``); ``shown`` says in ``--help`` what no value means."""
    return click.option(
        flag,
        type=Parsed(count_parser(flag, zero_ok=zero_ok)),
        default=default,
        metavar=metavar,
        help=help,
        show_default=shown,
    )
