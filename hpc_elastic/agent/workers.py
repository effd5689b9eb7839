"""Worker processes: torchrun's environment, one process group each, nothing left behind.

Each worker is started through a tiny ``python -I -S`` trampoline that asks the kernel to
SIGKILL it when the agent dies (``PR_SET_PDEATHSIG``) and then ``exec``s the real command,
so even a SIGKILLed agent leaves no orphans. Doing the ``prctl`` in a ``preexec_fn`` instead
would run Python code between ``fork`` and ``exec`` of a multi-threaded process (kazoo's
threads), which can deadlock.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hpc_elastic.agent.api import AgentSpec
from hpc_elastic.agent.standby import StandbyPool, hand_off
from hpc_elastic.errors import AgentError
from hpc_elastic.rendezvous.api import NodeInfo, Round
from hpc_elastic.train import heartbeat

_TRAMPOLINE = """\
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, 9)
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as error:
    print(f"hpc-elastic: cannot run {sys.argv[2]!r}: {error.strerror}.", file=sys.stderr)
    os._exit(127)
"""
"""prctl(PR_SET_PDEATHSIG=1, SIGKILL=9); the getppid check closes the race with an agent
that died before the prctl took effect."""


def launch(
    command: list[str], env: Mapping[str, str], *, stdin: int | IO[bytes], stdout: int | IO[bytes]
) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own process group, to be SIGKILLed if the agent dies."""
    argv = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), *command]
    try:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    except OSError as error:
        raise AgentError(
            f"Could not start worker '{command[0]}': {error.strerror}; "
            "check the command after '--'."
        ) from error


@dataclass(frozen=True)
class WorkerPaths:
    """Where one rank of one attempt writes its log, error file and heartbeat."""

    log: Path
    error_file: Path
    heartbeat: Path


def attempt_paths(spec: AgentSpec, run_dir: Path, attempt: int, rank: int) -> WorkerPaths:
    attempt_dir = spec.log_dir / f"attempt_{attempt}"
    return WorkerPaths(
        log=attempt_dir / f"rank_{rank}.log",
        error_file=attempt_dir / f"error_{rank}.json",
        heartbeat=run_dir / f"heartbeat_{rank}",
    )


def worker_env(
    base: Mapping[str, str],
    spec: AgentSpec,
    rdzv_round: Round,
    *,
    node: NodeInfo,
    run_id: str,
    local_rank: int,
    paths: WorkerPaths,
) -> dict[str, str]:
    """torchrun's environment for one worker, plus the HPC_ELASTIC_* training contract."""
    group_rank = rdzv_round.group_rank(node.node_id)
    rank = rdzv_round.first_rank(node.node_id) + local_rank
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(rdzv_round.world_size),
            "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
            "GROUP_RANK": str(group_rank),
            "GROUP_WORLD_SIZE": str(len(rdzv_round.members)),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(rdzv_round.world_size),
            "MASTER_ADDR": rdzv_round.master_addr,
            "MASTER_PORT": str(rdzv_round.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(rdzv_round.restarts_used),
            "TORCHELASTIC_MAX_RESTARTS": str(rdzv_round.max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": str(paths.error_file),
            "HPC_ELASTIC_JOB_DIR": str(spec.job_dir),
            "HPC_ELASTIC_CHECKPOINT_DIR": str(spec.checkpoint_dir),
            "HPC_ELASTIC_EVENTS_FILE": str(spec.events_file),
            "HPC_ELASTIC_HEARTBEAT_FILE": str(paths.heartbeat),
            "HPC_ELASTIC_SLOT": node.slot,
            "HPC_ELASTIC_ROUND": str(rdzv_round.number),
        }
    )
    return env


@dataclass
class Worker:
    rank: int
    local_rank: int
    paths: WorkerPaths
    process: subprocess.Popen[bytes]
    started: float

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def heartbeat_age(self, now: float) -> float | None:
        """Seconds since the last heartbeat; None until the worker's first one."""
        try:
            mtime, _ = heartbeat.read(self.paths.heartbeat)
        except (FileNotFoundError, ValueError):
            return None
        return now - mtime

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)


class WorkerGroup:
    """This node's workers for one round; ``stop`` always ends with every process gone."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self._tees: list[threading.Thread] = []

    @classmethod
    def start(
        cls,
        spec: AgentSpec,
        envs: list[dict[str, str]],
        paths: list[WorkerPaths],
        standbys: StandbyPool | None = None,
    ) -> WorkerGroup:
        group = cls([])
        try:
            for local_rank, (env, worker_paths) in enumerate(zip(envs, paths, strict=True)):
                group.workers.append(group._spawn(spec, env, worker_paths, local_rank, standbys))
        except BaseException:
            group.stop(0.0)
            raise
        return group

    def _spawn(
        self,
        spec: AgentSpec,
        env: dict[str, str],
        paths: WorkerPaths,
        local_rank: int,
        standbys: StandbyPool | None,
    ) -> Worker:
        paths.log.parent.mkdir(parents=True, exist_ok=True)
        paths.heartbeat.unlink(missing_ok=True)
        paths.error_file.unlink(missing_ok=True)
        process = standbys.take() if standbys is not None else None
        if process is None or not hand_off(process, env, None if spec.tee else paths.log):
            with paths.log.open("ab") as log:
                process = launch(
                    list(spec.command),
                    env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if spec.tee else log,
                )
        rank = int(env["RANK"])
        if spec.tee:
            assert process.stdout is not None
            tee = threading.Thread(
                target=_tee,
                args=(process.stdout, paths.log.open("ab"), f"[rank {rank}]: "),
                daemon=True,
            )
            tee.start()
            self._tees.append(tee)
        return Worker(rank, local_rank, paths, process, time.monotonic())

    def forward(self, signum: int) -> None:
        """Forward a signal to every worker's whole process group."""
        for worker in self.workers:
            if worker.returncode is None:
                worker.signal_group(signum)

    def running(self) -> list[Worker]:
        return [worker for worker in self.workers if worker.returncode is None]

    def wait(self, timeout: float) -> bool:
        """Wait until every worker exited; True if they did within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self, grace: float, signum: int = signal.SIGTERM) -> None:
        """Ask politely, wait ``grace`` seconds, then SIGKILL every process group."""
        self.forward(signum)
        self.forward(signal.SIGCONT)
        self.wait(grace)
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)
        for worker in self.workers:
            worker.process.wait()
        for tee in self._tees:
            tee.join(timeout=1.0)


def _tee(source: IO[bytes], log: IO[bytes], prefix: str) -> None:
    """Copy a worker's output to its log file and, prefixed with its rank, to the console."""
    with source, log:
        for line in iter(source.readline, b""):
            log.write(line)
            log.flush()
            sys.stdout.write(prefix + line.decode(errors="replace"))
            sys.stdout.flush()
