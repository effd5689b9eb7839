"""Local mode: ``hpc-elastic run`` runs the job's agents as processes on this machine.

No Slurm and no ZooKeeper: this process serves the rendezvous itself (``local_store``, a
thread on a unix socket) and starts one ``hpc-elastic agent`` per local "node", exactly the
command a Slurm step runs. ``--simulate-churn`` SIGKILLs a random node now and then and
starts it again a little later, so a user can watch elasticity before going near a cluster.

    hpc-elastic run --nodes 1:3 --simulate-churn examples/train.py -- --sleep-per-step 0.1
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from hpc_elastic import checkpoint_key, contract, events, schema
from hpc_elastic._version import __version__
from hpc_elastic.contract import RUN_ID_ENV
from hpc_elastic.errors import UsageError
from hpc_elastic.events import ChurnDetails, Kind
from hpc_elastic.invocation import AgentInvocation
from hpc_elastic.jobdir import (
    JobDir,
    JobRecord,
    job_dir_problem,
    make_private_dir,
    untrusted_job_dir,
    write_private,
)
from hpc_elastic.ops.progress import Progress
from hpc_elastic.options import agent_flag, agent_options
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.local_store import SCHEME, LocalStoreServer
from hpc_elastic.spec import JobSpec, NodeRange, default_job_name
from hpc_elastic.submission import new_run_id

POLL = 0.2
"""Seconds between two looks at the agents, the churn schedule and the events file."""


@dataclass(frozen=True)
class Churn:
    """Kill a random node every ``every`` (MIN:MAX seconds), start it again ``downtime`` later."""

    every: tuple[float, float] = (20.0, 40.0)
    downtime: float = 10.0

    @classmethod
    def parse(cls, text: str) -> tuple[float, float]:
        """``--churn-every 20:40`` (or ``30``) seconds between two kills."""
        low, _, high = text.partition(":")
        try:
            bounds = (float(low), float(high or low))
        except ValueError:
            raise UsageError(
                f"--churn-every '{text}' is not MIN:MAX seconds; give e.g. '20:40'."
            ) from None
        if not 0 < bounds[0] <= bounds[1]:
            raise UsageError(
                f"--churn-every '{text}' needs 0 < MIN <= MAX seconds; give e.g. '20:40'."
            )
        return bounds


def _churn_every(text: str) -> str:
    """``--churn-every``'s parser: the text once ``Churn.parse`` took it, so that a bad value
    is refused with the other flags, and ``--help`` shows the default as it is typed."""
    Churn.parse(text)
    return text


@dataclass(frozen=True)
class RunExtras:
    """``run``'s options that ``submit`` has no like of, each declared on its field
    (``schema``): the simulated churn, its seed, the agents' metrics and output.
    ``LocalRun.from_values`` makes ``LocalRun``'s ``churn``, ``seed``, ``metrics_port`` and
    ``tee`` of them (``run_fields``)."""

    simulate_churn: bool = schema.option(
        "Kill a random node now and then and start it again later.", False
    )
    churn_every: str = schema.option(
        "Seconds between two simulated node losses.",
        ":".join(f"{bound:g}" for bound in Churn.every),
        parse=_churn_every,
        metavar="MIN:MAX",
    )
    churn_downtime: float = schema.duration("Seconds a killed node stays away.", Churn.downtime)
    seed: int = schema.option("Seed of the churn schedule.", 0, metavar="N")
    metrics_port: int | None = schema.option(
        "Serve metrics: node i on PORT+i (0: any free port).", None, metavar="PORT"
    )
    tee: bool = schema.option("Show the agents' and workers' output.", False)

    def run_fields(self) -> dict[str, object]:
        """``LocalRun``'s fields these options give."""
        churn = Churn(Churn.parse(self.churn_every), self.churn_downtime)
        return {
            "churn": churn if self.simulate_churn else None,
            "seed": self.seed,
            "metrics_port": self.metrics_port,
            "tee": self.tee,
        }


EXTRA_OPTIONS = schema.options_of(RunExtras)
"""``run``'s own options, in ``--help`` order (after ``LocalRun``'s and the checkpoint
settings: ``commands.run.RUN_OPTIONS``)."""


@dataclass(frozen=True)
class LocalRun:
    """Everything ``hpc-elastic run`` was asked for, validated.

    The fields from ``nodes`` to ``in_place`` are ``run``'s options (``schema.options_of``,
    ``commands.run``), each ``like`` ``submit``'s: the same flag, parser and check, with help
    that speaks of local nodes; the defaults are the contract's, as ``JobSpec``'s are."""

    script: Path
    nodes: NodeRange = schema.like(
        JobSpec,
        NodeRange.parse(contract.DEFAULT_NODES),
        help="Local nodes (agents): N, or MIN:MAX to train on while MIN run.",
    )
    nproc_per_node: int = schema.like(
        JobSpec, contract.DEFAULT_NPROC_PER_NODE, help="Workers per node."
    )
    max_restarts: int = schema.like(JobSpec, contract.DEFAULT_MAX_RESTARTS)
    job_name: str = schema.like(JobSpec, contract.DEFAULT_JOB_NAME, help="The run's name.")
    """Unset on the command line (None), the script's name (``spec.default_job_name``)."""
    log_dir: Path = schema.like(
        JobSpec, contract.DEFAULT_RUNS_DIR, help="Where the run's directory is made."
    )
    prewarm: bool = schema.like(
        JobSpec,
        contract.DEFAULT_PREWARM,
        help="Keep standby workers with torch imported: faster rounds after churn.",
    )
    """Standby workers with torch imported, so a round after churn skips the import."""
    in_place: bool = schema.like(
        JobSpec,
        contract.DEFAULT_IN_PLACE,
        help="Keep surviving workers through churn and hand them the new round; for loops "
        "that use hpc_elastic.train.InPlace.",
    )
    """``agent --in-place``: surviving workers keep their process through churn (loops that
    use ``hpc_elastic.train.InPlace``); off by default, as for ``submit``."""
    script_args: tuple[str, ...] = ()
    churn: Churn | None = None
    seed: int = 0
    tee: bool = False
    grace: float = 10.0
    metrics_port: int | None = None
    """Node ``i`` serves Prometheus metrics on this port + i; 0 lets each agent pick one."""
    environment: tuple[tuple[str, str], ...] = ()
    """Variables for the agents and their workers, as ``submit``'s script exports them."""
    python: str = sys.executable

    @classmethod
    def from_values(cls, script: Path, values: Mapping[str, object], **others: Any) -> LocalRun:
        """The run of ``script`` with its options' values as ``options.resolve`` gives them
        (``OPTIONS``' and ``EXTRA_OPTIONS``'; a ``job_name`` left unset is the script's name)
        and ``others``, the fields that are no options."""
        own = {row.name: values[row.name] for row in OPTIONS}
        own["job_name"] = own["job_name"] or default_job_name(script)
        # click converted each value by its row's type or parser, which mypy cannot follow
        # through the table; the names are the fields'.
        extras = RunExtras(**{row.name: values[row.name] for row in EXTRA_OPTIONS})  # type: ignore[arg-type]
        return cls(script=script, **own, **extras.run_fields(), **others)  # type: ignore[arg-type]


OPTIONS = schema.options_of(LocalRun)
"""The options ``LocalRun``'s fields declare, in ``--help`` order (``commands.run`` adds the
checkpoint settings, then ``EXTRA_OPTIONS``)."""


@dataclass
class _Node:
    """One local "node": its slot name and its current agent process, if any."""

    slot: str
    process: subprocess.Popen[bytes] | None = None


def exit_status(returncode: int) -> int:
    """A process's return code as a shell would give it: 128 + N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(slot: str, returncode: int) -> str:
    """How one agent ended, e.g. "node1's agent exited with 1" or "...was killed by SIGABRT"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{slot}'s agent was killed by {name}"
    return f"{slot}'s agent exited with {returncode}"


@dataclass
class ChurnSchedule:
    """When ``--simulate-churn`` kills a node and when it comes back: decisions only.

    No processes and no clock of its own: the caller passes ``now`` (any monotonic seconds)
    and the names of the nodes alive, so a test can drive it through hours in microseconds.
    The same seed gives the same schedule.
    """

    churn: Churn
    min_nodes: int
    random: random.Random
    next_kill: float | None = None
    """Set once the first round has formed: churn starts when training does."""
    back_at: dict[str, float] = field(default_factory=dict)
    """Killed nodes and when each is started again."""

    def training_started(self, now: float) -> None:
        if self.next_kill is None:
            self._schedule(now)

    def returning(self, now: float) -> list[str]:
        """The killed nodes due back by ``now``; each is returned once."""
        due = [slot for slot, at in self.back_at.items() if now >= at]
        for slot in due:
            del self.back_at[slot]
        return due

    def kill_due(self, now: float) -> bool:
        return self.next_kill is not None and now >= self.next_kill

    def victim(self, now: float, alive: list[str]) -> str | None:
        """The node to kill now, if more than MIN are alive; the next kill is scheduled."""
        chosen = None
        if len(alive) > self.min_nodes:
            chosen = self.random.choice(alive)
            self.back_at[chosen] = now + self.churn.downtime
        self._schedule(now)
        return chosen

    def _schedule(self, now: float) -> None:
        self.next_kill = now + self.random.uniform(*self.churn.every)


class LocalJob:
    """One local run: the store, the agents, the churn schedule and the progress view."""

    def __init__(
        self,
        run: LocalRun,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run = run
        self.say = say
        self._clock = clock
        self.run_id = new_run_id(run.job_name, datetime.now())
        self.paths = JobDir.under(run.log_dir, self.run_id)
        self.job_dir = self.paths.path
        self._socket_dir = Path(tempfile.mkdtemp(prefix="hpc-elastic-"))
        self.address = f"{SCHEME}{self._socket_dir / 'rendezvous.sock'}"
        self._server = LocalStoreServer(self._socket_dir / "rendezvous.sock")
        self._nodes = [_Node(f"node{i}") for i in range(run.nodes.max)]
        self._schedule = (
            None
            if run.churn is None
            else ChurnSchedule(run.churn, run.nodes.min, random.Random(run.seed))
        )
        self._stop_signal: int | None = None
        self._progress = Progress(self.paths.events, say)
        self._ending = False
        """Once an agent ended by itself the job is over: no more churn."""

    def request_stop(self, signum: int) -> None:
        self._stop_signal = self._stop_signal or signum

    def execute(self) -> int:
        """Run the job to its end; always leaves no agent and no socket behind."""
        try:
            self._write_job_dir()
            self._check_job_dir()
        except BaseException:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            raise
        self._server.start()
        try:
            for node in self._nodes:
                self._start(node)
            self.say(
                f"Run {self.run_id}: {self.run.nodes.max} local nodes x "
                f"{self.run.nproc_per_node} workers, nodes {self.run.nodes}; "
                f"job directory {self.job_dir}"
            )
            return self._supervise()
        finally:
            self._stop_all()
            self._server.stop()
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _supervise(self) -> int:
        while True:
            for event in self._progress.poll():
                if event.kind in (Kind.DONE, Kind.FAILED):
                    self._ending = True
                elif event.kind == Kind.ROUND and self._schedule is not None:
                    self._schedule.training_started(self._clock())
            if self._stop_signal is not None:
                self.say("Stopping: the agents get their grace period to save.")
                self._stop_all()
                self._progress.poll()
                return 128 + self._stop_signal
            codes = {node.slot: node.process.poll() for node in self._nodes if node.process}
            ended = {slot: code for slot, code in codes.items() if code is not None}
            self._ending = self._ending or bool(ended)
            if len(ended) == len(codes):
                self._progress.poll()
                return self._result(ended)
            if not self._ending and self._schedule is not None:
                self._churn(self._schedule, self._clock())
            time.sleep(POLL)

    def _result(self, codes: dict[str, int]) -> int:
        """The run's exit code from its agents' (slot: return code), said in one sentence."""
        if codes and all(code == 0 for code in codes.values()):
            self.say(f"Run {self.run_id} succeeded. See `hpc-elastic status {self.run_id}`.")
            return 0
        failed = {slot: code for slot, code in codes.items() if code != 0}
        code = max(map(exit_status, failed.values()), default=1)
        said = "; ".join(describe_exit(slot, code) for slot, code in failed.items())
        self.say(
            f"Run {self.run_id} ended with exit code {code} ({said or 'no agent ran'}); see "
            f"`hpc-elastic events {self.run_id}` and `hpc-elastic logs {self.run_id}`."
        )
        return code

    def _churn(self, schedule: ChurnSchedule, now: float) -> None:
        """Carry out the schedule: start the nodes due back, kill the one it picks."""
        back = schedule.returning(now)
        for node in self._nodes:
            if node.slot in back:
                self._event(Kind.CHURN, **ChurnDetails("add", node.slot).to_details())
                self._start(node)
        if not schedule.kill_due(now) or self._finishing():
            return
        alive = {n.slot: n for n in self._nodes if n.process and n.process.poll() is None}
        victim = schedule.victim(now, list(alive))
        if victim is not None:
            process = alive[victim].process
            assert process is not None
            self._event(Kind.CHURN, **ChurnDetails("kill", victim).to_details())
            process.kill()
            process.wait()
            alive[victim].process = None

    def _finishing(self) -> bool:
        """Whether a node already reported success: a loss now would fail the exit barrier."""
        data = self._server.snapshot()
        return data is not None and bool(st.decode(data).state.succeeded)

    def _start(self, node: _Node) -> None:
        index = self._nodes.index(node)
        log: IO[bytes] | None = None
        if not self.run.tee:
            log = self.paths.agent_log(node.slot).open("ab")
        node.process = subprocess.Popen(
            self._agent_argv(node.slot, index),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
            # RUN_ID_ENV: cancel's proof that the process is our job's.
            env={**os.environ, **dict(self.run.environment), RUN_ID_ENV: self.run_id},
        )
        if log is not None:
            log.close()

    def _agent_argv(self, slot: str, index: int) -> list[str]:
        return self.invocation(slot, index).argv()

    def invocation(self, slot: str, index: int) -> AgentInvocation:
        """The command a Slurm step would run, with this run's store and a local slot."""
        run = self.run
        options: list[tuple[str, ...]] = [
            *agent_options(
                {
                    "max_restarts": run.max_restarts,
                    "prewarm": run.prewarm,
                    "in_place": run.in_place,
                }
            ),
            (agent_flag("slot"), slot),
            (agent_flag("host"), "127.0.0.1"),
            (agent_flag("grace"), f"{run.grace:g}"),
        ]
        if run.tee:
            options.append((agent_flag("tee"),))
        if run.metrics_port is not None:
            port = run.metrics_port + index if run.metrics_port else 0
            options.append((agent_flag("metrics_port"), str(port)))
        return AgentInvocation(
            python=run.python,
            run_id=self.run_id,
            job_dir=self.job_dir,
            nodes=f"{run.nodes.min}:{run.nodes.max}",
            nproc_per_node=run.nproc_per_node,
            zk=self.address,
            worker=(run.python, "-u", str(run.script), *run.script_args),
            options=tuple(options),
        )

    def _stop_all(self) -> None:
        """SIGTERM every agent (they drain their workers), SIGKILL what outlives the grace."""
        running = [node.process for node in self._nodes if node.process]
        for process in running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.run.grace + 5.0
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def _event(self, kind: Kind, **details: object) -> None:
        events.append(
            self.paths.events,
            events.Event(kind=kind, job=self.run_id, slot="run", details=details),
        )

    def _check_job_dir(self) -> None:
        """The job directory is still the one just made, ours alone: someone who may rename
        entries in the log directory could have put theirs in its place by now (the agents
        check again when they start)."""
        problem = job_dir_problem(self.job_dir)
        if problem is not None:
            raise UsageError(untrusted_job_dir(self.job_dir, problem))

    def _write_job_dir(self) -> None:
        try:
            make_private_dir(self.job_dir)
            self.paths.logs.mkdir()
            # The job's secret and the user's checkpoint key, as submit writes them: the workers
            # seal their checkpoints' manifests with the key (hpc_elastic.train._integrity), so
            # the user's next run resumes from them and nobody else's checkpoint loads.
            write_private(self.paths.secret, secrets.token_hex(32), exclusive=True)
            checkpoint_key.write_key(self.paths.checkpoint_key)
        except OSError as error:
            raise UsageError(
                f"Job directory '{self.job_dir}' cannot be created ({error.strerror}); "
                "choose a writable --log-dir."
            ) from error
        run = self.run
        JobRecord(
            run_id=self.run_id,
            job_dir=self.job_dir,
            job_id=None,
            local=True,
            zk=self.address,
            nodes=str(run.nodes),
            nproc_per_node=run.nproc_per_node,
            max_restarts=run.max_restarts,
            runner_pid=os.getpid(),
            version=__version__,
            command_line=("hpc-elastic", *sys.argv[1:]),
            spec={
                "script": str(run.script),
                "script_args": list(run.script_args),
                "nodes": str(run.nodes),
                "nproc_per_node": run.nproc_per_node,
                "job_name": run.job_name,
                "max_restarts": run.max_restarts,
                "churn": None if run.churn is None else list(run.churn.every),
            },
        ).write()


def run_local(run: LocalRun, say: Callable[[str], None]) -> int:
    """Run the job, stopping everything on SIGINT/SIGTERM; returns the exit code."""
    job = LocalJob(run, say)
    handlers = {
        signum: signal.signal(signum, lambda signum, frame: job.request_stop(signum))
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return job.execute()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
