"""Worker processes: torchrun's environment, one process group each, nothing left behind.

Each worker is started through a tiny ``python -I -S`` trampoline that asks the kernel to
SIGKILL it when the agent dies (``PR_SET_PDEATHSIG``) and then ``exec``s the real command,
so even a SIGKILLed agent leaves no orphans. Doing the ``prctl`` in a ``preexec_fn`` instead
would run Python code between ``fork`` and ``exec`` of a multi-threaded process (kazoo's
threads), which can deadlock. The trampoline also gives the worker back the limit of open
files the agent started with (``USER_FILES``): the centre of a round of thousands raises its
own (agent/links.py), and a worker gets the limit the user's job set, as under torchrun.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hpc_elastic import contract
from hpc_elastic.agent.api import AgentSpec
from hpc_elastic.agent.standby import StandbyPool, hand_off
from hpc_elastic.errors import AgentError
from hpc_elastic.jobdir import JobDir
from hpc_elastic.protocol import heartbeat
from hpc_elastic.rendezvous.api import NodeInfo, Round
from hpc_elastic.tracking import tracker_env

log = logging.getLogger(__name__)

_TRAMPOLINE = """\
import ctypes, os, resource, sys
ctypes.CDLL(None, use_errno=True).prctl(1, 9)
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft > int(sys.argv[2]):
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), hard))
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as error:
    print(f"hpc-elastic: cannot run {sys.argv[3]!r}: {error.strerror}.", file=sys.stderr)
    os._exit(127)
"""
"""prctl(PR_SET_PDEATHSIG=1, SIGKILL=9); the getppid check closes the race with an agent
that died before the prctl took effect. Then the open-files limit the agent started with."""

USER_FILES = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
"""The soft limit of open files this process started with (read when it imports this module,
before any round): the one its workers get, whatever the agent raised its own to since."""


def launch(
    command: list[str], env: Mapping[str, str], *, stdin: int | IO[bytes], stdout: int | IO[bytes]
) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own process group, to be SIGKILLed if the agent dies."""
    files = str(USER_FILES)
    argv = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), files, *command]
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
    nccl_trace: Path | None = None
    """NCCL's flight-recorder dump prefix; None: torch's default (/tmp)."""


def attempt_paths(spec: AgentSpec, run_dir: Path, attempt: int, rank: int) -> WorkerPaths:
    job_dir = JobDir(spec.job_dir)
    attempt_dir = job_dir.attempt(attempt)
    return WorkerPaths(
        log=attempt_dir / f"rank_{rank}.log",
        error_file=attempt_dir / f"error_{rank}.json",
        heartbeat=run_dir / f"heartbeat_{rank}",
        nccl_trace=job_dir.nccl_trace_prefix(attempt),
    )


NCCL_TRACE_ENTRIES = 2000
"""Collectives NCCL's flight recorder keeps per rank: enough to see where ranks diverged."""


FLIGHT_RECORDER_ALIASES = {
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
}
"""The flight recorder's current names and the older spellings torch still reads. A user's
value under either name is the user's setting: ours under the new name would win over it."""


def hang_debug_defaults(base: Mapping[str, str], nccl_trace: Path | None) -> dict[str, str]:
    """The variables that make a hang explain itself, minus those the user set already.

    ``PYTHONFAULTHANDLER`` makes a worker print every thread's stack on the SIGABRT the
    agent sends a hung group (``WorkerGroup.dump_stacks``). The ``TORCH_NCCL_*`` ones make
    NCCL abort a timed-out collective (3: tear down the communicator, no process kill) and
    dump its flight recorder (``TORCH_FR_*``) beside the rank's log. They are set with or
    without CUDA: without NCCL nothing reads them, and the agent never imports torch to find
    out. The flight recorder gets its current names only: torch 2.13 warns in every rank's
    log for the old ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (docs/unattended.md).
    """
    defaults = {
        "PYTHONFAULTHANDLER": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
    }
    if nccl_trace is not None:
        defaults["TORCH_FR_DUMP_TEMP_FILE"] = str(nccl_trace)
    return {
        name: value
        for name, value in defaults.items()
        if not any(alias in base for alias in (name, *FLIGHT_RECORDER_ALIASES.get(name, ())))
    }


def without_agent_secrets(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` minus what only the agent may know (``contract.AGENT_ONLY_ENV``: the webhook)."""
    return {name: value for name, value in base.items() if name not in contract.AGENT_ONLY_ENV}


def worker_env(
    base: Mapping[str, str],
    spec: AgentSpec,
    rdzv_round: Round,
    *,
    node: NodeInfo,
    run_id: str,
    local_rank: int,
    paths: WorkerPaths,
    agent_store: bool = False,
) -> dict[str, str]:
    """torchrun's environment for one worker, plus the HPC_ELASTIC_* training contract.

    ``agent_store``: the round's TCPStore is already open on ``MASTER_PORT``, hosted by this
    node's agent (agent/storehost.py): ``TORCHELASTIC_USE_AGENT_STORE=True`` makes torch's
    ``env://`` connect every rank, rank 0 too, as a client instead of opening a second one.
    """
    group_rank = rdzv_round.group_rank(node.node_id)
    rank = rdzv_round.first_rank(node.node_id) + local_rank
    env = without_agent_secrets(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    # The job's own directory unless the job named another (``--env
    # HPC_ELASTIC_CHECKPOINT_DIR=s3://bucket/run``): that one is passed on untouched, never made.
    env.setdefault(contract.CHECKPOINT_DIR_ENV, str(spec.checkpoint_dir))
    env.update(hang_debug_defaults(base, paths.nccl_trace))
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
            "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
            "TORCHELASTIC_ERROR_FILE": str(paths.error_file),
            contract.JOB_DIR_ENV: str(spec.job_dir),
            contract.EVENTS_FILE_ENV: str(spec.events_file),
            contract.HEARTBEAT_FILE_ENV: str(paths.heartbeat),
            contract.SLOT_ENV: node.slot,
            contract.ROUND_ENV: str(rdzv_round.number),
        }
    )
    env.update(tracker_env(run_id, base))  # the same tracker run across rounds and requeues
    return env


def waits_for(*, peer_dead: bool, saving: bool) -> bool:
    """Whether a stopping group keeps waiting, within its grace, for a rank still running.

    A rank that is saving always gets its grace: the checkpoint is what a restart resumes
    from. Otherwise the grace is there to let a rank reach its next step boundary and save,
    which a rank cannot do once a peer of its group is dead (its collectives never complete),
    so then waiting only delays the restart."""
    return saving or not peer_dead


def exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, without reaping it (``WNOWAIT``).

    An unreaped child keeps its pid, and so its process group id, from being reused: while
    the leader is a zombie, ``killpg(pid)`` can only reach processes of its own group.
    """
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # Already reaped (by Popen): it has exited.


@dataclass
class Worker:
    rank: int
    local_rank: int
    paths: WorkerPaths
    process: subprocess.Popen[bytes]
    started: float

    @property
    def returncode(self) -> int | None:
        """None while the worker runs. Once it exits, whatever it left in its process group
        (a dataloader child, a forked helper that ignores SIGTERM) is SIGKILLed before the
        worker is reaped, and only then: the one moment the group id surely is still ours."""
        if self.process.returncode is not None:
            return self.process.returncode
        if not exited(self.process.pid):
            return None
        self.signal_group(signal.SIGKILL)
        code = self.process.wait()
        log.debug("rank %d (pid %d) exited with %s", self.rank, self.process.pid, code)
        return code

    @property
    def saving(self) -> bool:
        """Whether the rank is writing a checkpoint: the training helpers mark the heartbeat."""
        return heartbeat.checkpointing(self.paths.heartbeat)

    def heartbeat_age(self, now: float) -> float | None:
        """Seconds since the last heartbeat; None (not timed) until the worker's first one,
        and again once it said its training loop is over (``heartbeat.FINISHED``)."""
        try:
            if heartbeat.finished(self.paths.heartbeat):
                return None
            mtime, _ = heartbeat.read(self.paths.heartbeat)
        except (FileNotFoundError, ValueError):
            return None
        return now - mtime

    def signal_group(self, signum: int) -> None:
        """Signal the worker's whole process group, unless the worker has been reaped: its
        pid may then name another process's group (``returncode`` already emptied ours)."""
        if self.process.returncode is not None:
            return
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
                group.add(spec, env, worker_paths, local_rank, standbys)
        except BaseException:
            group.stop(0.0)
            raise
        return group

    def add(
        self,
        spec: AgentSpec,
        env: dict[str, str],
        paths: WorkerPaths,
        local_rank: int,
        standbys: StandbyPool | None = None,
    ) -> Worker:
        """Start one more worker (in-place mode: one for a local rank that has no survivor),
        keeping the workers ordered by local rank."""
        worker = self._spawn(spec, env, paths, local_rank, standbys)
        self.workers.append(worker)
        self.workers.sort(key=lambda each: each.local_rank)
        return worker

    def keep_running(self) -> list[Worker]:
        """Forget the workers that exited (in-place mode, between rounds); the rest go on."""
        self.workers = self.running()
        return self.workers

    def _spawn(
        self,
        spec: AgentSpec,
        env: dict[str, str],
        paths: WorkerPaths,
        local_rank: int,
        standbys: StandbyPool | None,
    ) -> Worker:
        paths.log.parent.mkdir(parents=True, exist_ok=True)
        # The log exists from the start, even when a standby opens it only once it has
        # imported torch: `logs` then shows every rank that ran, also one killed before then.
        paths.log.touch()
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

    def dump_stacks(self, deadline: float) -> None:
        """SIGABRT every worker of a hung group so that faulthandler prints its threads'
        stacks into its log, wait up to ``deadline`` seconds for them to die of it, then
        SIGKILL what is left. faulthandler writes from the signal handler without the GIL,
        so even a rank stuck in a C call (a collective) dumps; a rank started without it
        just dies of the SIGABRT."""
        for worker in self.running():
            # The leader only, not its group: a DataLoader child's dump would bury the rank's.
            # SIGCONT after it: a stopped rank (SIGSTOP, the fault matrix's hang) takes the
            # pending SIGABRT as it resumes, before it runs a single Python instruction.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                worker.process.send_signal(signal.SIGABRT)
                worker.process.send_signal(signal.SIGCONT)
        log.debug("sent SIGABRT to %d rank(s) for their stacks", len(self.workers))
        self.wait(deadline)
        self.stop(0.0, signal.SIGKILL)

    def stop(self, grace: float, signum: int = signal.SIGTERM, *, peer_dead: bool = False) -> None:
        """Ask politely, wait up to ``grace`` seconds (with a dead peer: only while a rank is
        saving, see ``waits_for``), then SIGKILL every process group that is left (each
        before its leader is reaped, see ``Worker.returncode``)."""
        self.forward(signum)
        self.forward(signal.SIGCONT)
        deadline = time.monotonic() + grace
        while any(waits_for(peer_dead=peer_dead, saving=w.saving) for w in self.running()):
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        log.debug("stopping %d rank(s) left after the grace", len(self.running()))
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)
        for worker in self.workers:
            while worker.returncode is None:
                time.sleep(0.01)  # SIGKILLed: it is gone in a moment.
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
