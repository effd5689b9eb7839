"""``hpc-elastic doctor``: the Typer signature; ``hpc_elastic.doctor`` runs the checks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, cast

import typer

from hpc_elastic.config import load_config
from hpc_elastic.contract import (
    DEFAULT_PREEMPT_SIGNAL,
    DEFAULT_RUNS_DIR,
    DEFAULT_SESSION_TIMEOUT,
    DEFAULT_ZK,
)
from hpc_elastic.doctor import TEST_SAVE_BYTES, Level, SavePlan, diagnose, is_url
from hpc_elastic.ensemble.choice import choose_zk
from hpc_elastic.errors import UsageError
from hpc_elastic.spec import PreemptSignal, parse_mem, parse_zk, seconds_parser

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(text: str) -> int:
    """``--save-size``: a size as ``--mem`` takes it (``512M``, ``2G``), above zero."""
    value = parse_mem(text)
    number, unit = value.rstrip("KMGT"), value[len(value.rstrip("KMGT")) :]
    if int(number) <= 0:
        raise UsageError(f"--save-size '{text}' is no size; give the checkpoint's size, e.g. '2G'.")
    return int(number) * _UNITS[unit]


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
    *,
    signal: Annotated[
        str,
        typer.Option(
            metavar="SIG[@SECONDS]",
            help="The --signal your jobs will have: its lead must hold a save.",
        ),
    ] = DEFAULT_PREEMPT_SIGNAL,
    save_seconds: Annotated[
        float | None,
        typer.Option(
            parser=seconds_parser("--save-seconds"),
            metavar="S",
            help="How long one checkpoint save takes (status shows the agents' figure); "
            "default: time a test save.",
        ),
    ] = None,
    save_size: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help=f"Time a test save of this size (e.g. 2G) in the checkpoint directory; "
            f"default {TEST_SAVE_BYTES // 2**20}M.",
        ),
    ] = None,
    qos: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="The QoS your jobs will run under (preempt/qos)."),
    ] = None,
) -> None:
    """Check a cluster before the first submit: one line per check, pass, warn or fail."""
    config = load_config(Path.cwd())
    values = config.values
    choice = choose_zk(zk, values, config.path)
    where = checkpoint_dir or str(values.get("log_dir", DEFAULT_RUNS_DIR))
    session = values.get("session_timeout") or DEFAULT_SESSION_TIMEOUT
    save = SavePlan(
        lead_s=float(PreemptSignal.parse(signal).seconds),
        seconds=save_seconds,
        size=TEST_SAVE_BYTES if save_size is None else _bytes(save_size),
        qos=qos,
    )
    checks = diagnose(
        partition,
        choice,
        where if is_url(where) else _local_dir(where),
        session_timeout=float(cast(float, session)),
        prewarm=values.get("prewarm") is not False,
        save=save,
    )
    for check in checks:
        for line in check.lines():
            typer.echo(line)
    failed = sum(check.level is Level.FAIL for check in checks)
    warned = sum(check.level is Level.WARN for check in checks)
    typer.echo(f"{len(checks)} checks: {failed} failed, {warned} warnings.")
    raise typer.Exit(1 if failed else 0)
