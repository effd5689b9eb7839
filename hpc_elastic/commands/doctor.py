"""``hpc-elastic doctor``: the click command; ``hpc_elastic.doctor`` runs the checks."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import click

from hpc_elastic.clicktools import Parsed, exit_with
from hpc_elastic.commands._job import seconds_option
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
from hpc_elastic.spec import PreemptSignal, parse_mem, parse_zk

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


@click.command("doctor")
@click.option("--partition", metavar="NAME", help="Partition to check; default: Slurm's.")
@click.option(
    "--zk",
    type=Parsed(parse_zk),
    metavar="HOST:PORT[,...]",
    help="ZooKeeper to check. Default: $HPC_ELASTIC_ZK, the config file, the ensemble you "
    f"started (hpc-elastic zk start), or {DEFAULT_ZK}.",
)
@click.option(
    "--checkpoint-dir",
    metavar="DIR|URL",
    help="Where jobs will write. Default: ./hpc-elastic-runs. An s3:// URL is not created or "
    "checked here.",
)
@click.option(
    "--signal",
    default=DEFAULT_PREEMPT_SIGNAL,
    metavar="SIG[@SECONDS]",
    help="The --signal your jobs will have: its lead must hold a save.",
)
@seconds_option(
    "--save-seconds",
    "How long one checkpoint save takes (status shows the agents' figure); default: "
    "time a test save.",
)
@click.option(
    "--save-size",
    metavar="SIZE",
    help=f"Time a test save of this size (e.g. 2G) in the checkpoint directory; default "
    f"{TEST_SAVE_BYTES // 2**20}M.",
)
@click.option("--qos", metavar="NAME", help="The QoS your jobs will run under (preempt/qos).")
def doctor_command(
    partition: str | None,
    zk: str | None,
    checkpoint_dir: str | None,
    *,
    signal: str,
    save_seconds: float | None,
    save_size: str | None,
    qos: str | None,
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
            click.echo(line)
    failed = sum(check.level is Level.FAIL for check in checks)
    warned = sum(check.level is Level.WARN for check in checks)
    click.echo(f"{len(checks)} checks: {failed} failed, {warned} warnings.")
    exit_with(1 if failed else 0)
