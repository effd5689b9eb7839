"""``hpc-elastic doctor``: the Typer signature; ``hpc_elastic.doctor`` runs the checks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, cast

import typer

from hpc_elastic.config import load_config
from hpc_elastic.contract import DEFAULT_RUNS_DIR, DEFAULT_SESSION_TIMEOUT, DEFAULT_ZK
from hpc_elastic.doctor import Level, diagnose, is_url
from hpc_elastic.ensemble.choice import choose_zk
from hpc_elastic.errors import UsageError
from hpc_elastic.spec import parse_zk


def _local_dir(text: str) -> Path:
    directory = Path(text)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--checkpoint-dir '{directory}' is a file; give a directory.")
    return directory.absolute()


def doctor_command(
    partition: Annotated[
        str | None, typer.Option(metavar="NAME", help="Partition to check; default: Slurm's.")
    ] = None,
    zk: Annotated[
        str | None,
        typer.Option(
            parser=parse_zk,
            metavar="HOST:PORT[,...]",
            help="ZooKeeper to check. Default: $HPC_ELASTIC_ZK, the config file, the ensemble "
            f"you started (hpc-elastic zk start), or {DEFAULT_ZK}.",
        ),
    ] = None,
    checkpoint_dir: Annotated[
        str | None,
        typer.Option(
            metavar="DIR|URL",
            help="Where jobs will write. Default: ./hpc-elastic-runs. An s3:// URL is not "
            "created or checked here.",
        ),
    ] = None,
) -> None:
    """Check a cluster before the first submit: one line per check, pass, warn or fail."""
    config = load_config(Path.cwd())
    values = config.values
    choice = choose_zk(zk, values, config.path)
    where = checkpoint_dir or str(values.get("log_dir", DEFAULT_RUNS_DIR))
    session = values.get("session_timeout") or DEFAULT_SESSION_TIMEOUT
    checks = diagnose(
        partition,
        choice,
        where if is_url(where) else _local_dir(where),
        session_timeout=float(cast(float, session)),
        prewarm=values.get("prewarm") is not False,
    )
    for check in checks:
        for line in check.lines():
            typer.echo(line)
    failed = sum(check.level is Level.FAIL for check in checks)
    warned = sum(check.level is Level.WARN for check in checks)
    typer.echo(f"{len(checks)} checks: {failed} failed, {warned} warnings.")
    raise typer.Exit(1 if failed else 0)
