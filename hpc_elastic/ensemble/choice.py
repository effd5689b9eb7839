"""Which ZooKeeper a command uses, and why: the one rule ``submit``, ``doctor``, ``nodes`` and the
Python API share.

In order: ``--zk``; ``$HPC_ELASTIC_ZK``; the config file's ``zk``; the ensemble the user
started (``hpc-elastic zk start`` or ``zk serve``, from its connect-string file); else the
built-in default, 127.0.0.1:2181, which is said to be a guess. Each command says in one line
which it used (``ZkChoice.line``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic import contract
from hpc_elastic.ensemble import files
from hpc_elastic.ensemble.files import Ensemble
from hpc_elastic.errors import EnsembleError, SlurmError

log = logging.getLogger(__name__)

DEFAULT_SOURCE = "the built-in default"


@dataclass(frozen=True)
class ZkChoice:
    """A ZooKeeper address and where it came from."""

    address: str
    source: str
    ensemble: Ensemble | None = None
    """The user's own ensemble, when that is the source."""

    @property
    def is_default(self) -> bool:
        return self.source == DEFAULT_SOURCE

    def line(self) -> str:
        """``ZooKeeper: <address> (<source>)``, with what to do when it is only the default."""
        if self.is_default:
            return (
                f"ZooKeeper: {self.address} ({self.source}: no --zk, ${contract.ZK_ENV}, config "
                "file or ensemble of yours names one; `hpc-elastic zk start` starts one)"
            )
        return f"ZooKeeper: {self.address} ({self.source})"


def choose_zk(
    flag: str | None,
    config_values: Mapping[str, object],
    config_path: Path | None = None,
    environ: Mapping[str, str] = os.environ,
) -> ZkChoice:
    """The ZooKeeper to use (module docstring). ``config_values`` is ``load_config``'s, which
    holds ``$HPC_ELASTIC_ZK`` as ``zk`` when it is set. An ensemble file that another user
    could have planted raises ``EnsembleTrustError``: it is never used, and never skipped in
    silence."""
    if flag:
        return ZkChoice(flag, "--zk")
    if config_values.get("zk"):
        source = (
            f"${contract.ZK_ENV}"
            if environ.get(contract.ZK_ENV)
            else f"the config file {config_path or ''}".rstrip()
        )
        return ZkChoice(str(config_values["zk"]), source)
    ensemble = files.load_ensemble(files.Layout.of(environ))
    if ensemble is not None:
        return ZkChoice(ensemble.connect, ensemble.source(), ensemble)
    return ZkChoice(contract.DEFAULT_ZK, DEFAULT_SOURCE)


def require_alive(
    address: str,
    environ: Mapping[str, str] = os.environ,
    squeue: Callable[[Sequence[str]], Sequence[object]] | None = None,
    answers: Callable[[str, int], bool] | None = None,
) -> None:
    """Refuse to submit a job to the user's own ensemble once it has ended (its Slurm job is
    no longer listed, or its ``zk serve`` does not answer): the job could never rendezvous.
    Any other address is the user's word and is not second-guessed here (``doctor`` checks
    it), and neither is an ensemble whose job Slurm cannot be asked about."""
    try:
        ensemble = files.load_ensemble(files.Layout.of(environ))
    except EnsembleError:
        return  # not the source: choose_zk refuses such a file when it would be
    if ensemble is None or not ensemble.names(address):
        return
    if ensemble.job_id:
        if squeue is None:
            from hpc_elastic.slurm import commands  # noqa: PLC0415

            squeue = commands.squeue
        try:
            listed = [getattr(status, "job_id", None) for status in squeue([ensemble.job_id])]
        except SlurmError as error:
            log.debug("cannot tell whether the ensemble's job runs: %s", error)
            return
        if ensemble.job_id in listed:
            return
        gone = f"its Slurm job {ensemble.job_id} is no longer listed by squeue"
    else:
        server = ensemble.servers[0]
        if (answers or _answers)(server.host, server.client_port):
            return
        gone = f"its server at {server.address} does not answer"
    raise EnsembleError(
        f"Your ensemble at '{address}' has ended ({gone}), so a job submitted to it could "
        "never rendezvous; start one with `hpc-elastic zk start` (`hpc-elastic zk stop` "
        "clears the old record), or give --zk."
    )


def _answers(host: str, port: int) -> bool:
    from hpc_elastic.ensemble import fourletter  # noqa: PLC0415

    return fourletter.health(host, port, timeout=2.0).mode != "down"
