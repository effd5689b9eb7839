"""Prometheus metrics of one agent: served on ``--metrics-port`` or written to a textfile.

HPC nodes often have no open ports but run node_exporter, whose textfile collector reads
``--metrics-textfile`` (written atomically every second). The only module that imports
prometheus_client. The agent feeds its own events in (``observe``); the training step comes
from the workers' heartbeat and the last checkpoint from the job's events file, which any
rank of any node may have written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, start_http_server
from prometheus_client import write_to_textfile as _write_textfile

from hpc_elastic import contract, events
from hpc_elastic.agent.api import AgentPhase
from hpc_elastic.errors import UsageError
from hpc_elastic.events import CHECKPOINTS, Event, Kind, RoundDetails

DEFAULT_BIND = contract.DEFAULT_METRICS_BIND
"""Metrics are served to this node only unless ``--metrics-bind`` widens it (the contract says
why)."""
INTERVAL = 1.0
"""Seconds between two refreshes (step rate, checkpoint age, the textfile)."""
_PHASES = frozenset(phase.value for phase in AgentPhase)
_STOPPED_KINDS = frozenset(
    {Kind.RESTART, Kind.FAILURE, Kind.PREEMPT, Kind.LEAVE, Kind.DONE, Kind.FAILED}
)


class AgentMetrics:
    """The gauges and counters of one agent, labelled with its job and slot."""

    def __init__(self, job: str, slot: str, events_file: Path, now: float | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["job", "slot"]
        values = {"job": job, "slot": slot or "-"}

        def gauge(name: str, help: str) -> Gauge:
            return Gauge(name, help, labels, registry=self.registry).labels(**values)

        def counter(name: str, help: str) -> Counter:
            return Counter(name, help, labels, registry=self.registry).labels(**values)

        self.world_size = gauge("hpc_elastic_world_size", "Workers in the current round.")
        self.round = gauge("hpc_elastic_round", "Number of the current rendezvous round.")
        self.restarts = counter(
            "hpc_elastic_restarts", "Worker-group restarts seen by this agent, of any cause."
        )
        self.restarts_used = gauge(
            "hpc_elastic_restarts_used", "Worker-failure restarts spent of the job's budget."
        )
        self.preemptions = counter(
            "hpc_elastic_preemptions", "Times this agent stopped for preemption."
        )
        self.step = gauge("hpc_elastic_training_step", "Latest training step (heartbeat).")
        self.steps_per_second = gauge(
            "hpc_elastic_steps_per_second", "Training steps per second over the last interval."
        )
        self.checkpoint_age = gauge(
            "hpc_elastic_last_checkpoint_age_seconds",
            "Seconds since the job last committed a checkpoint; NaN before the first.",
        )
        self.goodput = gauge(
            "hpc_elastic_goodput_ratio", "Share of this agent's wall time its workers trained."
        )
        self.stragglers = counter(
            "hpc_elastic_stragglers", "Ranks of this node reported as stragglers."
        )
        self._straggler_score = Gauge(
            "hpc_elastic_straggler_score",
            "A straggling rank's step time over the median of its peers; cleared each round.",
            [*labels, "rank"],
            registry=self.registry,
        )
        self._labels = values
        self.phase = Enum(
            "hpc_elastic_agent_phase",
            "The agent's phase (AgentPhase): 1 for the current one, 0 for the others.",
            labels,
            states=[phase.value for phase in AgentPhase],
            registry=self.registry,
        ).labels(**values)
        self.phase.state(AgentPhase.JOINING.value)
        self._events_file = events_file
        self._events_offset = 0
        self._started = time.time() if now is None else now
        self._training_since: float | None = None
        self._trained = 0.0
        self._last_step: tuple[float, int] | None = None
        self._checkpoint_time: float | None = None
        self._lock = threading.Lock()
        self.checkpoint_age.set(float("nan"))

    def observe(self, event: Event) -> None:
        """Update from one of the agent's own events."""
        with self._lock:
            self._observe_stragglers(event)
            self._observe_phase(event)
            if event.kind == Kind.ROUND:
                self.round.set(event.round or 0)
                details = RoundDetails.from_details(event.details)
                self.world_size.set(details.world_size)
                self.restarts_used.set(details.restarts_used)
            elif event.kind == Kind.START:
                self._training_since = event.time
            elif event.kind in _STOPPED_KINDS:
                if self._training_since is not None:
                    self._trained += max(0.0, event.time - self._training_since)
                    self._training_since = None
                if event.kind == Kind.RESTART:
                    self.restarts.inc()
                elif event.kind == Kind.PREEMPT:
                    self.preemptions.inc()
                self.steps_per_second.set(0.0)
                self._last_step = None

    def _observe_stragglers(self, event: Event) -> None:
        """A ``straggler`` event counts and sets its rank's score; a new round clears the
        scores, since the ranks are renumbered and the slow one may be gone."""
        if event.kind == Kind.STRAGGLER:
            self.stragglers.inc()
            rank = str(event.details.get("rank", "?"))
            score = float(event.details.get("score", 0.0))
            self._straggler_score.labels(**self._labels, rank=rank).set(score)
        elif event.kind == Kind.ROUND:
            self._straggler_score.clear()

    def _observe_phase(self, event: Event) -> None:
        """Every agent event carries the phase it was written in; other values are ignored,
        since an events file is writable by any process of the job's user."""
        phase = event.details.get("phase")
        if phase in _PHASES:
            self.phase.state(phase)

    def refresh(
        self, step: int | None, now: float | None = None, phase: AgentPhase | None = None
    ) -> None:
        """Fold in the workers' step, the agent's phase (when given: it changes between
        events too, e.g. to ``done`` after the last one) and the job's checkpoints; called
        every ``INTERVAL``."""
        now = time.time() if now is None else now
        with self._lock:
            if phase is not None:
                self.phase.state(phase.value)
            if step is not None:
                if self._last_step is not None and now > self._last_step[0]:
                    then, previous = self._last_step
                    self.steps_per_second.set(max(0, step - previous) / (now - then))
                self._last_step = (now, step)
                self.step.set(step)
            self._read_checkpoints()
            if self._checkpoint_time is not None:
                self.checkpoint_age.set(max(0.0, now - self._checkpoint_time))
            trained = self._trained
            if self._training_since is not None:
                trained += max(0.0, now - self._training_since)
            wall = now - self._started
            self.goodput.set(trained / wall if wall > 0 else 0.0)

    def _read_checkpoints(self) -> None:
        """Follow the events file for ``checkpoint`` events: any rank's commit counts."""
        new, self._events_offset = events.read_new(
            self._events_file, self._events_offset, CHECKPOINTS
        )
        for event in new:
            if event.kind == Kind.CHECKPOINT:
                self._checkpoint_time = event.time


class MetricsExporter:
    """Serves ``metrics`` over HTTP and/or rewrites a textfile, refreshed by a daemon thread."""

    def __init__(
        self,
        metrics: AgentMetrics,
        progress: Callable[[], int | None],
        *,
        port: int | None = None,
        bind: str = DEFAULT_BIND,
        textfile: Path | None = None,
        interval: float = INTERVAL,
        phase: Callable[[], AgentPhase] | None = None,
    ) -> None:
        self.metrics = metrics
        self._progress = progress
        self._phase = phase
        self._textfile = textfile
        self._interval = interval
        self._stopped = threading.Event()
        self._server = None
        self.port: int | None = None
        self.bind: str | None = None
        if port is not None:
            try:
                self._server, _ = start_http_server(port, addr=bind, registry=metrics.registry)
            except (OSError, ValueError) as error:
                reason = error.strerror if isinstance(error, OSError) else str(error)
                raise UsageError(
                    f"--metrics-port '{port}' cannot be served on '{bind}' ({reason}); pick a "
                    "free port (0 for any) and an address of this node for --metrics-bind."
                ) from error
            self.port = int(self._server.server_port)
            self.bind = str(self._server.server_address[0])
        if textfile is not None:
            try:
                _write_textfile(str(textfile), metrics.registry)
            except OSError as error:
                raise UsageError(
                    f"--metrics-textfile '{textfile}' cannot be written ({error.strerror}); "
                    "give a file in a writable directory, e.g. node_exporter's textfile dir."
                ) from error
        self._thread = threading.Thread(target=self._loop, name="metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """A last refresh (so the textfile ends true), then stop serving."""
        self._stopped.set()
        self._thread.join(self._interval + 1.0)
        self._refresh()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _loop(self) -> None:
        while not self._stopped.wait(self._interval):
            self._refresh()

    def _refresh(self) -> None:
        phase = self._phase() if self._phase is not None else None
        self.metrics.refresh(self._progress(), phase=phase)
        if self._textfile is not None:
            with suppress(OSError):
                _write_textfile(str(self._textfile), self.metrics.registry)
