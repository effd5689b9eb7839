"""Local mode: ``hpc-elastic run`` runs the job's agents as processes on this machine.

No Slurm and no ZooKeeper: this process serves the rendezvous itself (``local_store``, a
thread on a unix socket) and starts one ``hpc-elastic agent`` per local "node", exactly the
command a Slurm step runs. ``--simulate-churn`` SIGKILLs a random node now and then and
starts it again a little later, so a user can watch elasticity before going near a cluster.

    hpc-elastic run --nodes 1:3 --simulate-churn examples/train.py -- --sleep-per-step 0.1
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Annotated

import typer

from hpc_elastic import __version__, events
from hpc_elastic.errors import UsageError
from hpc_elastic.ops import timeline
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.local_store import SCHEME, LocalStoreServer
from hpc_elastic.spec import NodeRange, count_parser, parse_job_name, seconds_parser
from hpc_elastic.submit import JOB_FILE, new_run_id

POLL = 0.2
"""Seconds between two looks at the agents, the churn schedule and the events file."""
SHOWN = frozenset({"round", "failure", "failed", "checkpoint", "preempt", "done", "churn"})
"""Events the progress view prints; ``hpc-elastic events`` shows them all."""


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


@dataclass(frozen=True)
class LocalRun:
    """Everything ``hpc-elastic run`` was asked for, validated."""

    script: Path
    nodes: NodeRange
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    log_dir: Path = Path("hpc-elastic-runs")
    job_name: str = "job"
    max_restarts: int = 3
    churn: Churn | None = None
    seed: int = 0
    tee: bool = False
    prewarm: bool = True
    """Standby workers with torch imported, so a round after churn skips the import."""
    grace: float = 10.0
    metrics_port: int | None = None
    """Node ``i`` serves Prometheus metrics on this port + i; 0 lets each agent pick one."""
    python: str = sys.executable


@dataclass
class _Node:
    """One local "node": its slot name and its current agent process, if any."""

    slot: str
    process: subprocess.Popen[bytes] | None = None
    back_at: float | None = None
    """When a churned node is started again."""


@dataclass
class _Progress:
    """Prints new events once: a round is told by its first agent only."""

    path: Path
    say: Callable[[str], None]
    offset: int = 0
    seen: set[tuple[str, int | None, object, object]] = field(default_factory=set)

    def poll(self) -> list[events.Event]:
        new, self.offset = events.read_new(self.path, self.offset)
        for event in new:
            key = (event.kind, event.round, event.details.get("step"), _teller(event))
            if event.kind in SHOWN and key not in self.seen:
                self.seen.add(key)
                self.say(f"{timeline.clock(event.time)}  {timeline.describe(event)}")
        return new


def _teller(event: events.Event) -> object:
    """What makes an event news: every agent reports the same round, but each its own stop."""
    if event.kind == "churn":
        return event.time
    return event.slot if event.kind == "preempt" else None


class LocalJob:
    """One local run: the store, the agents, the churn schedule and the progress view."""

    def __init__(self, run: LocalRun, say: Callable[[str], None]) -> None:
        self.run = run
        self.say = say
        self.run_id = new_run_id(run.job_name, datetime.now())
        self.job_dir = run.log_dir.absolute() / self.run_id
        self._socket_dir = Path(tempfile.mkdtemp(prefix="hpc-elastic-"))
        self.address = f"{SCHEME}{self._socket_dir / 'rendezvous.sock'}"
        self._server = LocalStoreServer(self._socket_dir / "rendezvous.sock")
        self._nodes = [_Node(f"node{i}") for i in range(run.nodes.max)]
        self._random = random.Random(run.seed)
        self._next_kill: float | None = None
        """Set once the first round has formed: churn starts when training does."""
        self._stop_signal: int | None = None
        self._progress = _Progress(self.job_dir / "events.jsonl", say)
        self._ending = False
        """Once an agent ended by itself the job is over: no more churn."""

    def request_stop(self, signum: int) -> None:
        self._stop_signal = self._stop_signal or signum

    def execute(self) -> int:
        """Run the job to its end; always leaves no agent and no socket behind."""
        self._write_job_dir()
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
                if event.kind in ("done", "failed"):
                    self._ending = True
                elif event.kind == "round" and self._next_kill is None:
                    self._schedule_kill(time.monotonic())
            if self._stop_signal is not None:
                self.say("Stopping: the agents get their grace period to save.")
                self._stop_all()
                self._progress.poll()
                return 128 + self._stop_signal
            codes = [node.process.poll() for node in self._nodes if node.process]
            if any(code is not None for code in codes):
                self._ending = True
            if all(code is not None for code in codes):
                self._progress.poll()
                return self._result([code for code in codes if code is not None])
            if not self._ending:
                self._churn(time.monotonic())
            time.sleep(POLL)

    def _result(self, codes: list[int]) -> int:
        if codes and all(code == 0 for code in codes):
            self.say(f"Run {self.run_id} succeeded. See `hpc-elastic status {self.run_id}`.")
            return 0
        code = max(codes, default=1) or 1
        self.say(
            f"Run {self.run_id} ended with exit code {code}; see `hpc-elastic events "
            f"{self.run_id}` and `hpc-elastic logs {self.run_id}`."
        )
        return code

    def _churn(self, now: float) -> None:
        for node in self._nodes:
            if node.back_at is not None and now >= node.back_at:
                node.back_at = None
                self._event("churn", action="add", target=node.slot)
                self._start(node)
        if self._next_kill is None or now < self._next_kill or self._finishing():
            return
        alive = [node for node in self._nodes if node.process and node.process.poll() is None]
        if len(alive) > self.run.nodes.min:
            victim = self._random.choice(alive)
            assert victim.process is not None
            self._event("churn", action="kill", target=victim.slot)
            victim.process.kill()
            victim.process.wait()
            victim.process = None
            victim.back_at = now + (self.run.churn.downtime if self.run.churn else 0.0)
        self._schedule_kill(now)

    def _finishing(self) -> bool:
        """Whether a node already reported success: a loss now would fail the exit barrier."""
        data = self._server.snapshot()
        return data is not None and bool(st.decode(data).succeeded)

    def _schedule_kill(self, now: float) -> None:
        if self.run.churn is not None:
            self._next_kill = now + self._random.uniform(*self.run.churn.every)

    def _start(self, node: _Node) -> None:
        index = self._nodes.index(node)
        log: IO[bytes] | None = None
        if not self.run.tee:
            log = (self.job_dir / "logs" / f"agent_{node.slot}.log").open("ab")
        node.process = subprocess.Popen(
            self._agent_argv(node.slot, index),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
        )
        if log is not None:
            log.close()

    def _agent_argv(self, slot: str, index: int) -> list[str]:
        run = self.run
        argv = [
            run.python,
            "-m",
            "hpc_elastic",
            "agent",
            f"--run-id={self.run_id}",
            f"--job-dir={self.job_dir}",
            f"--zk={self.address}",
            f"--nodes={run.nodes.min}:{run.nodes.max}",
            f"--nproc-per-node={run.nproc_per_node}",
            f"--max-restarts={run.max_restarts}",
            f"--slot={slot}",
            "--host=127.0.0.1",
            f"--grace={run.grace:g}",
        ]
        if run.tee:
            argv.append("--tee")
        if run.prewarm:
            argv.append("--prewarm=torch")
        if run.metrics_port is not None:
            port = run.metrics_port + index if run.metrics_port else 0
            argv.append(f"--metrics-port={port}")
        return [*argv, "--", run.python, "-u", str(run.script), *run.script_args]

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

    def _event(self, kind: str, **details: object) -> None:
        events.append(
            self.job_dir / "events.jsonl",
            events.Event(kind=kind, job=self.run_id, slot="run", details=details),
        )

    def _write_job_dir(self) -> None:
        try:
            (self.job_dir / "logs").mkdir(parents=True)
        except OSError as error:
            raise UsageError(
                f"Job directory '{self.job_dir}' cannot be created ({error.strerror}); "
                "choose a writable --log-dir."
            ) from error
        run = self.run
        record = {
            "run_id": self.run_id,
            "job_id": None,
            "job_dir": str(self.job_dir),
            "mode": "local",
            "zk": self.address,
            "pid": os.getpid(),
            "version": __version__,
            "command_line": ["hpc-elastic", *sys.argv[1:]],
            "spec": {
                "script": str(run.script),
                "script_args": list(run.script_args),
                "nodes": str(run.nodes),
                "nproc_per_node": run.nproc_per_node,
                "job_name": run.job_name,
                "max_restarts": run.max_restarts,
                "churn": None if run.churn is None else list(run.churn.every),
            },
        }
        (self.job_dir / JOB_FILE).write_text(json.dumps(record, indent=2) + "\n")


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


RUN_HELP = """Run SCRIPT elastically on this machine: MAX local agents, no Slurm, no ZooKeeper.

\b
Examples:
  hpc-elastic run --nodes 1:3 --simulate-churn examples/train.py -- --sleep-per-step 0.1
  hpc-elastic run --nodes 2 --nproc-per-node 2 --tee train.py -- --lr 3e-4
"""


def run_command(  # noqa: PLR0917 (Typer reads the options from the signature)
    script: Annotated[
        Path,
        typer.Argument(metavar="SCRIPT", help="The training script, run with python -u."),
    ],
    script_args: Annotated[
        list[str] | None,
        typer.Argument(metavar="SCRIPT_ARGS", help="Arguments for SCRIPT, after '--'."),
    ] = None,
    nodes: Annotated[
        NodeRange | None,
        typer.Option(
            parser=NodeRange.parse, metavar="N|MIN:MAX", help="Local nodes (agents). Default 1."
        ),
    ] = None,
    nproc_per_node: Annotated[
        int,
        typer.Option(
            parser=count_parser("--nproc-per-node"), metavar="P", help="Workers per node."
        ),
    ] = 1,
    simulate_churn: Annotated[
        bool,
        typer.Option(help="Kill a random node now and then and start it again later."),
    ] = False,
    churn_every: Annotated[
        str, typer.Option(metavar="MIN:MAX", help="Seconds between two simulated node losses.")
    ] = "20:40",
    churn_downtime: Annotated[
        float,
        typer.Option(
            parser=seconds_parser("--churn-downtime"),
            metavar="S",
            help="Seconds a killed node stays away.",
        ),
    ] = 10.0,
    seed: Annotated[int, typer.Option(help="Seed of the churn schedule.")] = 0,
    max_restarts: Annotated[
        int,
        typer.Option(
            parser=count_parser("--max-restarts", zero_ok=True),
            metavar="R",
            help="Worker-failure restarts for the whole job.",
        ),
    ] = 3,
    job_name: Annotated[
        str | None,
        typer.Option(parser=parse_job_name, metavar="NAME", help="Default: the script's name."),
    ] = None,
    log_dir: Annotated[
        Path, typer.Option(metavar="DIR", help="Where the run's directory is made.")
    ] = Path("hpc-elastic-runs"),
    metrics_port: Annotated[
        int | None,
        typer.Option(metavar="PORT", help="Serve metrics: node i on PORT+i (0: any free port)."),
    ] = None,
    tee: Annotated[bool, typer.Option(help="Show the agents' and workers' output.")] = False,
    prewarm: Annotated[
        bool,
        typer.Option(help="Keep standby workers with torch imported: faster rounds after churn."),
    ] = True,
) -> None:
    from hpc_elastic.cli import default_job_name, parse_script  # noqa: PLC0415 (no cycle)

    path = parse_script(str(script))
    run = LocalRun(
        script=path,
        script_args=tuple(script_args or ()),
        nodes=nodes or NodeRange(1, 1),
        nproc_per_node=nproc_per_node,
        log_dir=log_dir,
        job_name=job_name or default_job_name(path),
        max_restarts=max_restarts,
        churn=Churn(Churn.parse(churn_every), churn_downtime) if simulate_churn else None,
        seed=seed,
        tee=tee,
        prewarm=prewarm,
        metrics_port=metrics_port,
    )
    raise typer.Exit(run_local(run, lambda text: typer.echo(text, err=True)))
