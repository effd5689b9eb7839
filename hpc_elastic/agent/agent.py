"""The agent's life cycle: an explicit loop over rendezvous rounds (see docs/agent.md).

    JOINING --round--> RUNNING --all exit 0--> SUCCEEDING --barrier--> done (0)
       ^                  |  \\--worker fails / hangs--> REPORTING --+
       |                  |--membership changed--------------------+--> STOPPING --> JOINING
       |                  \\--signal--> DRAINING (grace) --> done (75 / 130 / 143)
       +-- next_round raises JobFailedError --> done (1)

Signals only set a flag (``request_stop``); the loop acts on it within ``poll_interval``.
Blocking rendezvous calls run on a helper thread so a signal is never stuck behind them.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from hpc_elastic import events
from hpc_elastic.agent import rootcause
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.agent.standby import StandbyPool, standby_command
from hpc_elastic.agent.workers import WorkerGroup, attempt_paths, launch, worker_env
from hpc_elastic.errors import RendezvousClosedError
from hpc_elastic.rendezvous.api import Failure, JobFailedError, Rendezvous, Round
from hpc_elastic.train import heartbeat

T = TypeVar("T")

REFILL_AFTER = 30.0
"""New standbys start importing once every local rank has beaten its heartbeat, or this many
seconds into a round, so that they do not slow the round's own start."""


class _Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CHANGED = "changed"
    SIGNALLED = "signalled"
    PREEMPTED = "preempted"


@dataclass(frozen=True)
class _Ended:
    """How one round ended for this node."""

    outcome: _Outcome
    failure: Failure | None = None
    hung: bool = False


class _Interrupted(Exception):
    """A stop signal arrived while waiting on the rendezvous."""


class Agent:
    """Runs this node's workers through rounds until the job succeeds, fails or is stopped."""

    def __init__(
        self,
        spec: AgentSpec,
        rdzv: Rendezvous,
        *,
        environ: Mapping[str, str] | None = None,
        say: Callable[[str], None] | None = None,
        on_event: Callable[[events.Event], None] | None = None,
    ) -> None:
        self.spec = spec
        self.rdzv = rdzv
        self._environ = dict(os.environ if environ is None else environ)
        self._say = say or _stderr
        self._on_event = on_event
        self._stop_signal: int | None = None
        self._group: WorkerGroup | None = None
        self._members: dict[str, str] | None = None
        """node_id -> slot of the last round, to log which nodes were lost or arrived."""
        self._run_dir = Path(tempfile.mkdtemp(prefix=f"hpc-elastic-{rdzv.settings.run_id}-"))
        self._standbys = self._standby_pool()

    def _standby_pool(self) -> StandbyPool | None:
        if not self.spec.prewarm:
            return None
        argv = standby_command(self.spec.command, self.spec.prewarm)
        if argv is None:
            self._say(
                "--prewarm needs a 'python [-u] SCRIPT' or 'python -m MODULE' command; "
                "workers start cold."
            )
            return None
        env = {"OMP_NUM_THREADS": "1", **self._environ}
        stdout = subprocess.PIPE if self.spec.tee else subprocess.DEVNULL
        launcher = functools.partial(launch, stdin=subprocess.PIPE, stdout=stdout)
        return StandbyPool(argv, env, self.spec.nproc_per_node, launcher)

    @property
    def _node(self) -> str:
        return self.rdzv.node.slot or self.rdzv.node.node_id

    def request_stop(self, signum: int) -> None:
        """Async-signal-safe: only records the signal; the loop forwards it to the workers."""
        if self._stop_signal is None:
            self._stop_signal = signum

    def step(self) -> int | None:
        """The highest training step the current workers reported (heartbeat), for metrics."""
        group = self._group
        steps = []
        for worker in group.workers if group is not None else ():
            with contextlib.suppress(OSError):
                steps.append(heartbeat.read(worker.paths.heartbeat)[1])
        return max((step for step in steps if step is not None), default=None)

    def run(self) -> ExitCode:
        """The whole life of the agent; always leaves no worker behind."""
        self.spec.job_dir.mkdir(parents=True, exist_ok=True)
        self._event("join", host=self.rdzv.node.host, nproc=self.spec.nproc_per_node)
        try:
            if self._standbys is not None:
                self._standbys.fill()
            return self._loop()
        finally:
            if self._group is not None:
                self._group.stop(0.0)
            if self._standbys is not None:
                self._standbys.close()
            shutil.rmtree(self._run_dir, ignore_errors=True)

    def _loop(self) -> ExitCode:
        while True:
            try:
                rdzv_round = self._interruptibly(self.rdzv.next_round)
            except _Interrupted:
                return self._leave(self._signal_exit_code())
            except RendezvousClosedError:
                self._say("The job's rendezvous is closed; nothing left to do.")
                return ExitCode.SUCCESS
            except JobFailedError as error:
                self._say(f"The job failed: {error}")
                self._event("failed", reason=str(error))
                return ExitCode.FAILED
            ended = self._run_round(rdzv_round)
            code = self._finish_round(rdzv_round, ended)
            if code is not None:
                return code

    def _run_round(self, rdzv_round: Round) -> _Ended:
        self._log_membership(rdzv_round)
        members = [member.slot or member.node_id for member in rdzv_round.members]
        self._event(
            "round",
            round=rdzv_round.number,
            world_size=rdzv_round.world_size,
            members=members,
            restarts_used=rdzv_round.restarts_used,
        )
        self._group = self._start_workers(rdzv_round)
        self._event("start", round=rdzv_round.number, ranks=[w.rank for w in self._group.workers])
        return self._monitor(self._group)

    def _log_membership(self, rdzv_round: Round) -> None:
        """Node losses and arrivals, logged once per round by the node with group rank 0."""
        current = {member.node_id: member.slot or member.node_id for member in rdzv_round.members}
        previous, self._members = self._members, current
        if previous is None or rdzv_round.group_rank(self.rdzv.node.node_id) != 0:
            return
        lost = sorted(previous[node] for node in previous.keys() - current.keys())
        arrived = sorted(current[node] for node in current.keys() - previous.keys())
        if lost:
            self._event("node_lost", round=rdzv_round.number, nodes=lost)
        if arrived:
            self._event("node_arrived", round=rdzv_round.number, nodes=arrived)

    def _start_workers(self, rdzv_round: Round) -> WorkerGroup:
        node = self.rdzv.node
        first = rdzv_round.first_rank(node.node_id)
        paths = [
            attempt_paths(self.spec, self._run_dir, rdzv_round.number, first + local)
            for local in range(self.spec.nproc_per_node)
        ]
        envs = [
            worker_env(
                self._environ,
                self.spec,
                rdzv_round,
                node=node,
                run_id=self.rdzv.settings.run_id,
                local_rank=local,
                paths=paths[local],
            )
            for local in range(self.spec.nproc_per_node)
        ]
        return WorkerGroup.start(self.spec, envs, paths, self._standbys)

    def _monitor(self, group: WorkerGroup) -> _Ended:
        """Wake every ``poll_interval``: a few waitpid and stat calls, well under 1% CPU."""
        preempted = ExitCode.PREEMPTED
        refill_at = time.monotonic() + REFILL_AFTER
        while True:
            if self._standbys is not None and self._training(group, refill_at):
                self._standbys.fill()
            if self._stop_signal is not None:
                return _Ended(_Outcome.SIGNALLED)
            if self.rdzv.changed.is_set():
                return _Ended(_Outcome.CHANGED)
            codes = [worker.returncode for worker in group.workers]
            for worker, code in zip(group.workers, codes, strict=True):
                if code not in (None, 0, preempted):
                    return _Ended(_Outcome.FAILED, self._failure(worker.rank, code))
            if all(code == 0 for code in codes):
                return _Ended(_Outcome.SUCCEEDED)
            if preempted in codes and None not in codes:
                return _Ended(_Outcome.PREEMPTED)
            hung = self._hung_rank(group)
            if hung is not None:
                return hung
            time.sleep(self.spec.poll_interval)

    @staticmethod
    def _training(group: WorkerGroup, deadline: float) -> bool:
        if time.monotonic() > deadline:
            return True
        now = time.time()
        return all(worker.heartbeat_age(now) is not None for worker in group.workers)

    def _hung_rank(self, group: WorkerGroup) -> _Ended | None:
        timeout = self.spec.hang_timeout
        if timeout is None:
            return None
        now = time.time()
        for worker in group.running():
            age = worker.heartbeat_age(now)
            if age is not None and age > timeout:
                worker.signal_group(signal.SIGKILL)
                worker.process.wait()
                reason = (
                    f"Rank {worker.rank} made no progress for {age:.1f} s "
                    f"(--hang-timeout {timeout:g}) and was killed."
                )
                return _Ended(_Outcome.FAILED, self._failure(worker.rank, None, reason), hung=True)
        return None

    def _finish_round(self, rdzv_round: Round, ended: _Ended) -> ExitCode | None:
        """Act on how the round ended; None means: join the next round."""
        group = self._group
        assert group is not None
        outcome = ended.outcome
        if outcome is _Outcome.SIGNALLED:
            return self._drain(group, self._signal_exit_code())
        if outcome is _Outcome.PREEMPTED:
            self._say("Workers stopped for preemption; exiting so the job is requeued.")
            return self._drain(group, ExitCode.PREEMPTED)
        if outcome is _Outcome.SUCCEEDED:
            self._group = None
            return self._succeed(rdzv_round)
        group.stop(self.spec.stop_grace)
        self._group = None
        if outcome is _Outcome.CHANGED:
            self._event("restart", round=rdzv_round.number, reason="membership or job changed")
            return None
        assert ended.failure is not None
        return self._handle_failure(rdzv_round, ended.failure, ended.hung)

    def _handle_failure(self, rdzv_round: Round, failure: Failure, hung: bool) -> ExitCode | None:
        """Report a root cause, unless the rank only echoed a peer's death (then wait to hear)."""
        if not hung and rootcause.is_echo(failure) and self._wait_for_change():
            self._event("restart", round=rdzv_round.number, reason="peer failure")
            return None
        if self._stop_signal is not None:
            return self._leave(self._signal_exit_code())
        self._say(f"Worker failure, root cause:\n{rootcause.summary(failure)}")
        self._event(
            "failure",
            round=rdzv_round.number,
            rank=failure.rank,
            exit_code=failure.exit_code,
            signal=failure.signal,
            message=failure.message,
            hung=hung,
        )
        try:
            self._interruptibly(lambda: self.rdzv.report_failure(failure))
        except _Interrupted:
            return self._leave(self._signal_exit_code())
        self._event("restart", round=rdzv_round.number, reason="worker failure")
        return None

    def _wait_for_change(self) -> bool:
        """Give the rendezvous a session timeout to tell us about the peer that really failed."""
        deadline = time.monotonic() + self.rdzv.settings.session_timeout + 1.0
        while time.monotonic() < deadline and self._stop_signal is None:
            if self.rdzv.changed.wait(self.spec.poll_interval):
                return True
        return False

    def _succeed(self, rdzv_round: Round) -> ExitCode:
        self._say("All local workers finished; waiting for the other nodes.")
        try:
            self._interruptibly(self.rdzv.report_success)
        except _Interrupted:
            return self._leave(self._signal_exit_code())
        except JobFailedError as error:
            self._say(f"The job failed: {error}")
            self._event("failed", reason=str(error))
            return ExitCode.FAILED
        self._event("done", round=rdzv_round.number)
        return ExitCode.SUCCESS

    def _drain(self, group: WorkerGroup, code: ExitCode) -> ExitCode:
        """Forward the stop signal, give the workers ``--grace`` to save, then kill them."""
        signum = self._stop_signal
        if signum is not None:
            self._say(
                f"Got {signal.Signals(signum).name}; forwarding it to the workers and giving "
                f"them {self.spec.grace:g} s to save."
            )
            group.forward(signum)
        group.stop(self.spec.grace, signum or signal.SIGTERM)
        preempted = ExitCode.PREEMPTED
        if code is not ExitCode.PREEMPTED and all(
            worker.returncode == preempted for worker in group.workers
        ):
            code = ExitCode.PREEMPTED
        self._group = None
        return self._leave(code)

    def _leave(self, code: ExitCode) -> ExitCode:
        self._event("preempt" if code is ExitCode.PREEMPTED else "leave", exit_code=int(code))
        self.rdzv.leave()
        return code

    def _signal_exit_code(self) -> ExitCode:
        if self._stop_signal == self.spec.preempt_signal:
            return ExitCode.PREEMPTED
        if self._stop_signal == signal.SIGINT:
            return ExitCode.INTERRUPTED
        return ExitCode.TERMINATED

    def _failure(self, rank: int, returncode: int | None, reason: str = "") -> Failure:
        assert self._group is not None
        worker = next(w for w in self._group.workers if w.rank == rank)
        node = self.rdzv.node
        return rootcause.worker_failure(
            node_id=node.node_id,
            host=node.host,
            slot=node.slot,
            rank=rank,
            returncode=returncode,
            error_file=worker.paths.error_file,
            log=worker.paths.log,
            reason=reason,
        )

    def _interruptibly(self, call: Callable[[], T]) -> T:
        """Run a blocking rendezvous call on a helper thread; give up on a stop signal, also
        one that came before the call (e.g. the bad-node watch, from an event observer)."""
        if self._stop_signal is not None:
            raise _Interrupted
        result: list[T] = []
        error: list[BaseException] = []
        done = threading.Event()

        def target() -> None:
            try:
                result.append(call())
            except BaseException as exc:
                error.append(exc)
            finally:
                done.set()

        threading.Thread(target=target, name="rendezvous-call", daemon=True).start()
        while not done.wait(self.spec.poll_interval):
            if self._stop_signal is not None:
                raise _Interrupted
        if error:
            raise error[0]
        return result[0]

    def _event(self, kind: str, round: int | None = None, **details: object) -> None:
        event = events.Event(
            kind=kind,
            job=self.rdzv.settings.run_id,
            slot=self.rdzv.node.slot,
            round=round,
            details={"node_id": self.rdzv.node.node_id, **details},
        )
        events.append(self.spec.events_file, event)
        if self._on_event is not None:
            self._on_event(event)


def _stderr(message: str) -> None:
    print(f"hpc-elastic agent: {message}", file=sys.stderr, flush=True)
