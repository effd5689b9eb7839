"""The agent's life cycle: an explicit loop over rendezvous rounds (see docs/agent.md).

    JOINING --round--> RUNNING --all exit 0--> SUCCEEDING --barrier--> DONE (0)
       ^                  |  \\--worker fails / hangs--> REPORTING --+        |
       |                  |--membership changed / fenced-----------+--> STOPPING --> JOINING
       |                  \\--signal--> DRAINING (grace) --> DONE (75 / 130 / 143)
       +-- next_round raises JobFailedError --> DONE (1)    <-- a failure elsewhere ends the round
       +-- cut off from the store for --zk-outage-limit --> DONE (69: not requeued)

Signals only set a flag (``request_stop``); the loop acts on it within ``poll_interval``.
Blocking rendezvous calls run on a helper thread, so that neither a signal nor the outage
limit is ever stuck behind them (kazoo holds a request until the connection comes back);
after a signal nothing waits past its ``--grace`` except the leave (``LEAVE_WAIT``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from hpc_elastic import events
from hpc_elastic.agent import hangs, investigation, proc, rootcause, rules, sockets, stops, watchdog
from hpc_elastic.agent.api import AgentPhase, AgentSpec, ExitCode
from hpc_elastic.agent.inplace import InPlaceHandover
from hpc_elastic.agent.links import Links, Peer
from hpc_elastic.agent.rules import (
    ENDS_ROUND,
    OVERSLEPT,
    AfterRound,
    Outcome,
    RoundEnd,
    echo_deadline,
    fence_after,
    overslept,
    poll_decision,
    restart_reason,
    told,
)
from hpc_elastic.agent.rundir import RunDir
from hpc_elastic.agent.standby import StandbyPool, may_import, standby_command
from hpc_elastic.agent.storehost import StoreHost, store_host_command, wants_store_host
from hpc_elastic.agent.workers import (
    Worker,
    WorkerGroup,
    attempt_paths,
    launch,
    worker_env,
)
from hpc_elastic.contract import (
    LEASE_FILE_ENV,
    LEASE_TIMEOUT_ENV,
)
from hpc_elastic.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousUnreachableError,
)
from hpc_elastic.events import FailedDetails, FailureDetails, HangDetails, Kind, RoundDetails
from hpc_elastic.protocol import heartbeat
from hpc_elastic.rendezvous import state as rdzv_state
from hpc_elastic.rendezvous.api import (
    Failure,
    JobFailedError,
    Rendezvous,
    Round,
)
from hpc_elastic.rendezvous.handler import free_port
from hpc_elastic.spec import MASTER_PORTS_ENV

T = TypeVar("T")

REFILL_AFTER = 30.0
"""New standbys start importing once every local rank has beaten its heartbeat, or has been
connected to the round's store for ``REFILL_SETTLE``, or this many seconds into a round, so
that they do not slow the round's own start."""

REFILL_SETTLE = 1.0
"""Seconds after every local rank connected to the round's store (``sockets``) before new
standbys start importing. A script that never beats a heartbeat (a plain torchrun script)
otherwise had none for the first ``REFILL_AFTER`` seconds of every round, so a failure in
that time restarted cold: ``import torch`` again in every worker (2 s at best). Connected,
a warm rank's group and first step follow within a few tenths of a second, a cold rank has
finished its imports: the standbys' imports then compete with training steps only, as they do
after a heartbeat."""

WARM_UP_WAIT = 60.0
"""Seconds an agent arriving at a job that already trains waits for its standbys to finish
importing before it joins (``Agent._warm_up``); after that it joins anyway, and the round waits
for them as it would without the wait. Eight standbys importing torch and ``torch._dynamo``
take a few seconds on a GPU node; a minute means a stalled import (a slow shared file
system), which the running job should not wait on forever."""

WARM_UP_POLL = 0.05
"""Seconds between two looks at the standbys' ready files while warming up."""

LEAVE_WAIT = 2.0
"""Seconds the agent waits for its clean leave of the rendezvous (one delete and the close of
its connection, milliseconds when the store answers) once its workers are gone. Past that, or
when it is cut off, it exits without: its membership then goes with its session, and the
others notice within a session timeout instead of at once."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Ended:
    """How one round ended for this node."""

    outcome: Outcome
    failure: Failure | None = None
    hung: bool = False
    """This node records a hang's failure: its culprit is here, or nobody can be blamed and
    this node was chosen to say so (``hangs.Verdict.reporter``)."""
    victim: bool = False
    """A hang's culprit is on another node (or it is ambiguous and another node records it):
    this node's ranks only waited, and the round ends as for an echo of a peer's failure."""
    sentence: str = ""
    """A hang's verdict, the one sentence the failure is read as."""
    said: str = ""
    """What the agent prints under a hang's sentence: where the culprit hung and where its
    stacks are (``rootcause.hung_sentence``), or each rank's evidence when nobody is blamed."""
    node_fault: bool = True
    """Whether the failure counts against this node (never for a hang not blamed on it)."""
    blamed: int | None = None
    """A hang's culprit rank, None when nobody can be blamed."""


@dataclass
class _RoundFacts:
    """What ``Agent._finish_round``'s actions share beyond ``RoundEnd``'s plain facts."""

    round: Round
    failure: Failure | None
    unfixable: str | None = None
    """The sentence of why no restart can fix the failure, once announced."""
    hang: bool = False
    """The failure is a hang's (``_Ended.hung`` or ``victim``)."""
    sentence: str = ""
    said: str = ""
    """``_Ended.said``."""
    node_fault: bool = True
    blamed: int | None = None
    """A hang's culprit, None when nobody is blamed."""


class _Interrupted(Exception):
    """A stop signal arrived while waiting on the rendezvous."""


def _stderr(message: str) -> None:
    print(f"hpc-elastic agent: {message}", file=sys.stderr, flush=True)


@dataclass
class Prepared:
    """What an agent sets up on its node before it joins (``prepare``): its run directory, and
    the standby workers, importing from the start. ``close`` removes both; the ``Agent`` that
    takes them closes them at its end, and whoever prepared them closes them if it never ran.
    """

    run: RunDir
    """Removed at the exit; one a SIGKILLed agent left is swept by the next (rundir.py)."""
    standbys: StandbyPool | None
    store_host: StoreHost | None = None
    """Opens each round's TCPStore before the workers start, when this node is the round's
    group rank 0 (agent/storehost.py); kept beside torch standbys only."""
    links: Links | None = None
    """The links to the other agents of each round (agent/links.py): listening from the
    start, so that this node's ``NodeInfo`` can name the port."""

    def close(self) -> None:
        """Only once the workers are gone: closing the links tells the others this node's
        process is done (agent/links.py)."""
        if self.standbys is not None:
            self.standbys.close()
        if self.store_host is not None:
            self.store_host.close()
        if self.links is not None:
            self.links.close()
        self.run.remove()


def prepare(
    spec: AgentSpec,
    run_id: str,
    environ: Mapping[str, str],
    say: Callable[[str], None] = _stderr,
    *,
    links: bool = False,
) -> Prepared:
    """Make the run directory and start the standbys (``--prewarm``) at once. The CLI calls it
    before the health preflight, so that their imports overlap its checks (on a GPU node the
    matmul check alone imports torch and initialises CUDA in a process of its own): an
    arriving node is warm sooner, and joins sooner (``Agent._warm_up``). With ``links``, this
    node also listens for the links of the rounds it will be the centre of (agent/links.py)."""
    run = RunDir(run_id)
    standbys = standby_pool(spec, environ, say, run.path / "standbys")
    store_host = None
    if standbys is not None:
        standbys.fill()
        store_host = make_store_host(spec, environ, run.path)
    linked = Links.open(environ) if links else None
    if links and linked is None:
        ports = environ.get(MASTER_PORTS_ENV, "any")
        say(
            f"No port free for the links to the other agents ({MASTER_PORTS_ENV} '{ports}'); "
            "this node's death will be noticed when its ZooKeeper session expires, not at "
            "once: widen --master-port-range."
        )
    return Prepared(run, standbys, store_host, linked)


def make_store_host(spec: AgentSpec, environ: Mapping[str, str], run_dir: Path) -> StoreHost | None:
    """A started store host for a node whose standbys prewarm torch; None otherwise."""
    if not wants_store_host(spec.command, spec.prewarm):
        return None
    argv = store_host_command(spec.command[0], run_dir / "store_host.log")
    env = {"OMP_NUM_THREADS": "1", **environ}
    launcher = functools.partial(launch, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    host = StoreHost(argv, env, launcher)
    host.start()
    return host


def standby_pool(
    spec: AgentSpec, environ: Mapping[str, str], say: Callable[[str], None], ready: Path
) -> StandbyPool | None:
    """The standbys of ``--prewarm``, when the command can be prewarmed and may import one of
    the modules; None (and a sentence on why) otherwise."""
    if not spec.prewarm:
        return None
    argv = standby_command(spec.command, spec.prewarm)
    if argv is None:
        say(
            "--prewarm needs a 'python [-u] SCRIPT' or 'python -m MODULE' command; "
            "workers start cold."
        )
        return None
    if not may_import(spec.command, spec.prewarm):
        say(
            f"The script imports none of {', '.join(spec.prewarm)}; "
            "no standby workers are kept (they would only slow the start)."
        )
        return None
    env = {"OMP_NUM_THREADS": "1", **environ}
    stdout = subprocess.PIPE if spec.tee else subprocess.DEVNULL
    launcher = functools.partial(launch, stdin=subprocess.PIPE, stdout=stdout)
    return StandbyPool(argv, env, spec.nproc_per_node, launcher, ready)


class Agent:
    """Runs this node's workers through rounds until the job succeeds, fails or is stopped.

    Why 51 methods: it is the executor of every decision of the loop (the phases in the
    module's docstring), each action a small method of its own, and it owns the one thing
    those actions share, this node's round and its workers. The decisions themselves are
    pure functions in ``rules.py``; hangs, investigations, links, workers and in-place mode's
    hand-over of a round to the survivors (``InPlaceHandover``) have their own modules.
    """

    def __init__(
        self,
        spec: AgentSpec,
        rdzv: Rendezvous,
        *,
        environ: Mapping[str, str] | None = None,
        say: Callable[[str], None] | None = None,
        on_event: Callable[[events.Event], None] | None = None,
        deadline_rules: Mapping[watchdog.Phase, watchdog.DeadlineRule] | None = None,
        prepared: Prepared | None = None,
    ) -> None:
        """``deadline_rules`` replaces ``watchdog.DEFAULT_RULES`` (whose floors are minutes),
        so that a test can see a hang caught by a learned deadline within seconds.
        ``prepared`` (``prepare``): the run directory and standbys made before the agent,
        which it then owns; without it the agent prepares them itself."""
        self.spec = spec
        self.rdzv = rdzv
        self._environ = dict(os.environ if environ is None else environ)
        self._say = say or _stderr
        self._on_event = on_event
        self._stop_signal: int | None = None
        self._stop_by: float | None = None
        """When the first stop signal's ``--grace`` ends (monotonic): nothing after the signal
        waits past it, the workers' save included; only the leave may add ``LEAVE_WAIT``."""
        self._group: WorkerGroup | None = None
        self._members: dict[str, str] | None = None
        """node_id -> slot of the last round, to log which nodes were lost or arrived."""
        self._prepared = prepared or prepare(spec, rdzv.settings.run_id, self._environ, self._say)
        self._run_dir = self._prepared.run.path
        self._lease = self._run_dir / "lease"
        """Touched every poll while this node holds a live round and is connected; workers
        stop on their own once it is older than the session timeout (self-fencing)."""
        self._phase = AgentPhase.JOINING
        self._standbys = self._prepared.standbys
        self._store_host = self._prepared.store_host
        self._agent_store: int | None = None
        """The port of the store this node's store host opened for the current round, if the
        round's master port is one (then its workers join it as clients)."""
        if self._store_host is not None:
            rdzv.pick_master_port = self._open_master_store
        self._deadlines = watchdog.Deadlines(
            rules=dict(deadline_rules or watchdog.DEFAULT_RULES), override=spec.hang_timeout
        )
        """Hang deadlines learned from the heartbeats, kept across rounds (docs/unattended.md);
        ``--hang-timeout`` overrides them."""
        self._watch: watchdog.RankWatch | None = None
        self._round_number: int | None = None
        self._round: Round | None = None
        self._hangs_answered: set[int] = set()
        """The round's hang investigations this agent took part in (agent/investigation.py)."""
        self._breaker = watchdog.Breaker()
        self._in_place = (
            InPlaceHandover(self._run_dir, self._node, spec, self._standbys)
            if spec.in_place
            else None
        )
        """``--in-place``: the hand-over of each new round to the surviving workers
        (agent/inplace.py); None in the normal mode. None rather than an object whose methods
        do nothing: in-place mode starts a round's workers differently (``hand_over`` instead
        of ``WorkerGroup.start``), which no null object can stand in for, and
        ``if self._in_place is not None`` shows at each point where the two modes part."""
        rdzv.on_spare = self._waiting_as_spare
        self._links = self._prepared.links
        """Last: a link's end may call ``_peer_departed`` from now on."""
        if self._links is not None:
            self._links.start(rdzv.node.node_id, rdzv.settings.run_id, self._peer_departed)

    def _open_master_store(self) -> int:
        """The port this node publishes as group rank 0 of a round (``pick_master_port``, on
        the rendezvous' thread): the store host's new store, listening already; a free port
        when the host is not ready (the script's rank 0 then opens the store itself)."""
        assert self._store_host is not None
        port = self._store_host.open(self.rdzv.node.host, free_port)
        return free_port() if port is None else port

    def _peer_departed(self, peer: Peer) -> None:
        """A link of a round this node holds ended in order: the peer's agent process exited
        (agent/links.py). Mark it departed, so that the next round forms without waiting for
        its session. On a thread of the links' own: this waits on the store."""
        try:
            marked = self.rdzv.report_departed(peer.node_id, peer.round)
        except RendezvousError as error:  # closed, failed or cut off: the session decides
            log.debug("%s: could not report %s departed: %s", self._node, peer.node_id, error)
            return
        if not marked:
            return
        held = self._round
        members = held.members if held is not None and held.number == peer.round else ()
        name = next((m.slot for m in members if m.node_id == peer.node_id and m.slot), "")
        self._event(
            Kind.DEPARTED,
            round=peer.round,
            node=name or peer.node_id,
            departed=peer.node_id,
            cause="connection closed",
        )

    def _waiting_as_spare(self, round_number: int) -> None:
        """A hot spare (``submit --spares``): its standbys are warm, it waits to replace a
        member; the event makes ``status`` show the slot as a spare."""
        self._event(Kind.SPARE, round=round_number, standbys=self._standbys is not None)

    @property
    def _node(self) -> str:
        return self.rdzv.node.slot or self.rdzv.node.node_id

    @property
    def phase(self) -> AgentPhase:
        """Where the agent is in its life cycle (for metrics and status)."""
        return self._phase

    def request_stop(self, signum: int) -> None:
        """Only records the signal, and when its grace ends (called from a signal handler);
        the loop forwards it to the workers."""
        if self._stop_signal is None:
            self._stop_by = time.monotonic() + self.spec.grace
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
        self._event(Kind.JOIN, host=self.rdzv.node.host, nproc=self.spec.nproc_per_node)
        try:
            if self._standbys is not None:
                self._standbys.fill()
                if self.rdzv.job_running() and not self._warm_up(self._standbys):
                    return self._leave_on_signal()
            return self._loop()
        except RendezvousUnreachableError as error:
            return self._unreachable(error)
        except RendezvousError as error:
            # Cut off from the store: this slot can do nothing now, but the job may go on;
            # stop the workers with grace and let Slurm requeue the slot. Any other refusal
            # (a state this version cannot read, access denied) would only repeat: exit 1.
            cut_off = self.rdzv.suspended_since() is not None
            return self._abort(error, ExitCode.PREEMPTED if cut_off else ExitCode.FAILED)
        except Exception as error:  # A bug: never leave workers without their grace.
            log.exception("the agent loop failed")
            return self._abort(error, ExitCode.FAILED)
        finally:
            self._enter(AgentPhase.DONE)
            if self._group is not None:
                self._group.stop(0.0)
            self._prepared.close()

    def _warm_up(self, standbys: StandbyPool) -> bool:
        """Arriving at a job that trains: wait until the standbys are warm before joining.

        Joining ends the running round, and its members would stand idle while this node's
        workers import torch (2 s on an idle core, far more on a loaded one); waiting first,
        the job trains meanwhile and pauses only for the hand-over. At most ``WARM_UP_WAIT``
        seconds; False when a stop signal came meanwhile (the agent leaves without joining).
        """
        if self._warm(standbys):
            return True
        modules = ", ".join(self.spec.prewarm)
        self._say(
            f"Waiting for the standby workers to import {modules} before joining the running "
            "job, so that it trains meanwhile."
        )
        started = time.monotonic()
        while not self._warm(standbys):
            if self._stop_signal is not None:
                return False
            if time.monotonic() - started > WARM_UP_WAIT:
                self._say(
                    f"The standby workers have not imported {modules} within {WARM_UP_WAIT:g} s;"
                    " joining anyway (the job waits for them there)."
                )
                return True
            time.sleep(WARM_UP_POLL)
        log.debug("%s: standbys warm after %.2f s", self._node, time.monotonic() - started)
        return True

    def _warm(self, standbys: StandbyPool) -> bool:
        """Every live standby imported its modules, and the store host (if it lives) too:
        a node that joins as the next round's group rank 0 would otherwise publish a port
        its workers' rank 0 must open itself."""
        host = self._store_host
        return standbys.warm and (host is None or host.ready or not host.alive)

    def _abort(self, error: Exception, code: ExitCode) -> ExitCode:
        """Leave after an unexpected error: workers get ``--grace``, the reason is said once."""
        self._say(
            f"The agent cannot go on ({type(error).__name__}: {error}); stopping the workers "
            f"and exiting with code {int(code)}."
        )
        self._event(Kind.ERROR, reason=str(error), exit_code=int(code))
        if self._group is not None:
            self._enter(AgentPhase.DRAINING)
            self._stop_with_grace(
                self._group, signal.SIGTERM, self.spec.grace, self._lease_while_connected
            )
            self._group = None
        self._release()
        return code

    def _unreachable(self, error: RendezvousUnreachableError) -> ExitCode:
        """Cut off from every server for longer than the outage limit: say so in its one
        sentence and leave for good. Not a requeue (75): the next incarnation would join the
        same dead ensemble; not a failure of the job (1): a partition of this node alone
        looks the same from here, and the others may go on."""
        code = ExitCode.UNREACHABLE
        self._say(str(error))
        self._event(Kind.ERROR, reason=str(error), exit_code=int(code))
        if self._group is not None:  # fenced long ago; stopped all the same, with grace
            self._enter(AgentPhase.DRAINING)
            self._stop_with_grace(
                self._group, signal.SIGTERM, self.spec.grace, self._lease_while_connected
            )
            self._group = None
        self._release()
        return code

    def _enter(self, phase: AgentPhase) -> None:
        if phase is not self._phase:
            log.debug("%s: %s -> %s", self._node, self._phase.value, phase.value)
            self._phase = phase

    def _loop(self) -> ExitCode:
        while True:
            self._enter(AgentPhase.JOINING)
            try:
                rdzv_round = self._interruptibly(self.rdzv.next_round)
            except _Interrupted:
                return self._leave_on_signal()
            except RendezvousClosedError:
                self._say("The job's rendezvous is closed; nothing left to do.")
                return ExitCode.SUCCESS
            except JobFailedError as error:
                return self._job_failed(error)
            ended = self._run_round(rdzv_round)
            try:
                code = self._finish_round(rdzv_round, ended)
            except JobFailedError as error:  # the exit barrier learned it
                return self._job_failed(error)
            if code is not None:
                return code

    def _job_failed(self, error: JobFailedError) -> ExitCode:
        self._say(f"The job failed: {error}")
        self._event(Kind.FAILED, **FailedDetails(str(error)).to_details())
        return ExitCode.FAILED

    def _run_round(self, rdzv_round: Round) -> _Ended:
        if self._links is not None:
            self._links.hold(rdzv_round)
        self._log_membership(rdzv_round)
        self._event(Kind.ROUND, round=rdzv_round.number, **round_details(rdzv_round).to_details())
        self._renew_lease()
        self._watch = watchdog.RankWatch(
            self._deadlines,
            watchdog.Stragglers(),
            time.time(),
            poll_interval=self.spec.poll_interval,
        )
        self._round_number = rdzv_round.number
        self._round = rdzv_round
        self._hangs_answered = set()
        self._group = self._start_workers(rdzv_round)
        self._enter(AgentPhase.RUNNING)
        self._event(
            Kind.START, round=rdzv_round.number, ranks=[w.rank for w in self._group.workers]
        )
        self._forget_past_hangs(rdzv_round)
        ended = self._monitor(self._group, rdzv_round.number)
        self._event(Kind.ROUND_ENDED, round=rdzv_round.number, outcome=ended.outcome.value)
        return ended

    def _forget_past_hangs(self, rdzv_round: Round) -> None:
        """The notes of past rounds' hangs, removed off the agent's thread by the round's first
        member (``investigation.past_topics``): housekeeping never delays the workers' watch,
        and one that fails (the ensemble out of reach) is tried again next round."""
        topics = investigation.past_topics(self.rdzv, rdzv_round)
        if not topics:
            return

        def forget() -> None:
            try:
                for topic in topics:
                    self.rdzv.forget(topic)
            except RendezvousError as error:
                log.debug("%s: past hangs' notes not forgotten: %s", self._node, error)

        threading.Thread(target=forget, name="hpc-elastic-forget-hangs", daemon=True).start()

    def _log_membership(self, rdzv_round: Round) -> None:
        """Node losses and arrivals, logged once per round by the node with group rank 0."""
        current = {member.node_id: member.slot or member.node_id for member in rdzv_round.members}
        previous, self._members = self._members, current
        if previous is None or rdzv_round.group_rank(self.rdzv.node.node_id) != 0:
            return
        lost = sorted(previous[node] for node in previous.keys() - current.keys())
        arrived = sorted(current[node] for node in current.keys() - previous.keys())
        for nodes in events.in_lines(lost):
            self._event(Kind.NODE_LOST, round=rdzv_round.number, nodes=list(nodes))
        for nodes in events.in_lines(arrived):
            self._event(Kind.NODE_ARRIVED, round=rdzv_round.number, nodes=list(nodes))

    def _start_workers(self, rdzv_round: Round) -> WorkerGroup:
        node = self.rdzv.node
        first = rdzv_round.first_rank(node.node_id)
        paths = [
            attempt_paths(self.spec, self._run_dir, rdzv_round.number, first + local)
            for local in range(self.spec.nproc_per_node)
        ]
        if self._in_place is not None:
            paths = self._in_place.worker_paths(paths, rdzv_round.number, first)
        environ = {
            **self._environ,
            LEASE_FILE_ENV: str(self._lease),
            LEASE_TIMEOUT_ENV: f"{fence_after(self.rdzv.settings.session_timeout):g}",
        }
        agent_store = self._keep_stores(rdzv_round)
        envs = [
            worker_env(
                environ,
                self.spec,
                rdzv_round,
                node=node,
                run_id=self.rdzv.settings.run_id,
                local_rank=local,
                paths=paths[local],
                agent_store=agent_store,
            )
            for local in range(self.spec.nproc_per_node)
        ]
        if self._in_place is not None:
            group, kept = self._in_place.hand_over(rdzv_round.number, envs, paths, self._group)
            if kept:
                self._event(Kind.WORKERS_KEPT, round=rdzv_round.number, ranks=kept)
            return group
        return WorkerGroup.start(self.spec, envs, paths, self._standbys)

    def _keep_stores(self, rdzv_round: Round) -> bool:
        """Whether the round's store is this node's store host's (it published the port as
        group rank 0, once the store listened); the host keeps that store and the previous
        round's (survivors of ``--in-place`` leave their old group at their next step), and
        closes the rest (ports it opened for a proposal that lost its compare-and-set)."""
        host = self._store_host
        if host is None:
            return False
        previous = self._agent_store
        ours = rdzv_round.group_rank(self.rdzv.node.node_id) == 0 and host.hosts(
            rdzv_round.master_port
        )
        self._agent_store = rdzv_round.master_port if ours else None
        host.keep(port for port in (previous, self._agent_store) if port is not None)
        short = host.short_of_files(rdzv_round.world_size) if ours else None
        if short is not None:
            log.warning("%s: round %d: %s", self._node, rdzv_round.number, short)
        log.debug(
            "%s: round %d's store on port %d is %s",
            self._node,
            rdzv_round.number,
            rdzv_round.master_port,
            "this agent's" if ours else "not this agent's",
        )
        return ours

    def _monitor(self, group: WorkerGroup, round_number: int) -> _Ended:
        """Wake every ``poll_interval``: a few waitpid and stat calls, well under 1% CPU."""
        refill_at = time.monotonic() + REFILL_AFTER
        beating = False
        port = self._round.master_port if self._round is not None else 0
        store = sockets.StoreWatch(port, until=refill_at)
        while True:
            if not beating and self._training(group, float("inf")):
                beating = True  # The restart timeline's first step when no helper reports it.
                self._event(Kind.FIRST_HEARTBEAT, round=round_number)
            pids = [worker.process.pid for worker in group.workers]
            if store.look(pids, time.monotonic()):
                # Seen in /proc: the phase exists for any script, helpers or not.
                ranks = [worker.rank for worker in group.workers]
                self._event(Kind.STORE_CONNECTED, round=round_number, ranks=ranks, port=port)
                refill_at = min(refill_at, time.monotonic() + REFILL_SETTLE)
            if self._standbys is not None and self._training(group, refill_at):
                self._standbys.fill()
                if self._store_host is not None:
                    self._store_host.start()  # again, if it died
            ended = self._poll(group)
            if ended is not None:
                log.debug("%s: round ended: %s", self._node, ended.outcome.value)
                return ended
            time.sleep(self.spec.poll_interval)

    def _poll(self, group: WorkerGroup) -> _Ended | None:
        """One step of the monitor: renew the lease while the round is ours, then decide."""
        codes = [worker.returncode for worker in group.workers]
        decision = poll_decision(
            codes,
            stop_requested=self._stop_signal is not None,
            changed=self.rdzv.changed.is_set(),
            suspended_since=self.rdzv.suspended_since(),
            now=time.monotonic(),
            session_timeout=self.rdzv.settings.session_timeout,
        )
        if decision.renew_lease:
            self._renew_lease()
        decided = decision.ended
        if decided is None:
            return self._unacknowledged(group) or self._hung_rank(group)
        outcome, index = decided
        if outcome is Outcome.PREEMPTED:
            return self._preempted_or_changed()
        if index is not None:
            worker = group.workers[index]
            code = codes[index]
            return _Ended(outcome, self._failure(worker.rank, code))
        return _Ended(outcome)

    def _unacknowledged(self, group: WorkerGroup) -> _Ended | None:
        """In-place mode: the failure of a survivor that did not take up its round in time
        (``InPlaceHandover.overdue`` killed it), which restarts it the normal way (from a
        survivor's broadcast or the checkpoint); None while every survivor is in time, and
        in the normal mode."""
        if self._in_place is None:
            return None
        missed = self._in_place.overdue(group)
        if missed is None:
            return None
        rank, reason = missed
        return _Ended(Outcome.FAILED, self._failure(rank, None, reason), hung=True)

    def _renew_lease(self) -> None:
        try:
            self._lease.touch()
        except OSError as error:  # The run dir vanished: workers will fence, say why.
            log.debug("%s: cannot renew the lease %s: %s", self._node, self._lease, error)

    def _preempted_or_changed(self) -> _Ended:
        """Every local worker saved and exited 75. With a stop signal of its own this node
        leaves. Without one, a peer was preempted: the training helpers stop every rank at the
        same step, so this node's workers stopped with the peer's, and this node must rejoin
        once the peer has left, not leave with it (Slurm would then requeue a slot that was
        never preempted). No change within a session timeout: leave as before."""
        if self._stop_signal is None and self._wait_for_change():
            return _Ended(Outcome.CHANGED)
        return _Ended(Outcome.PREEMPTED)

    @staticmethod
    def _training(group: WorkerGroup, deadline: float) -> bool:
        if time.monotonic() > deadline:
            return True
        now = time.time()
        return all(worker.heartbeat_age(now) is not None for worker in group.workers)

    def _hung_rank(self, group: WorkerGroup) -> _Ended | None:
        """Report new stragglers; when a local rank is past its deadline, or another node
        opened a hang's investigation, take part in it and end the round as its agreed
        verdict says (docs/unattended.md, "Who hung")."""
        watch, rdzv_round = self._watch, self._round
        if watch is None or rdzv_round is None:
            return None
        running = {
            worker.rank: worker
            for worker in group.running()
            if not heartbeat.finished(worker.paths.heartbeat)  # its loop is over: not timed
        }
        times = {rank: proc.cpu_times(w.process.pid) for rank, w in running.items()}
        marked = {rank: _reading(w) for rank, w in running.items()}
        verdict = watch.poll(
            time.time(),
            {rank: None if read is None else read[:2] for rank, read in marked.items()},
            queued={rank: cpu[1] for rank, cpu in times.items() if cpu is not None},
            ran={rank: cpu[0] for rank, cpu in times.items() if cpu is not None},
            # a rank writing a checkpoint cannot beat: it is timed by the checkpoint deadline,
            # learned from how long its saves took
            saving={rank for rank, read in marked.items() if read is not None and read[2]},
        )
        for rank in verdict.stragglers:
            score = round(verdict.scores.get(rank, 0.0), 2)
            self._event(Kind.STRAGGLER, round=self._round_number, rank=rank, score=score)
        try:
            number = investigation.unanswered(
                self.rdzv, rdzv_round.number, self._hangs_answered, self._interruptibly
            )
            if number is None and not verdict.hung:
                return None
            if number is None:
                number = investigation.next_number(self.rdzv, rdzv_round.number)
            return self._investigate(group, rdzv_round, number, verdict)
        except _Interrupted:
            # A stop signal during the investigation's requests: the next poll drains the
            # workers (thawed, they get the signal and --grace) and the agent leaves.
            log.debug("%s: hang investigation given up on a stop signal", self._node)
            return None

    def _investigate(
        self, group: WorkerGroup, rdzv_round: Round, number: int, verdict: watchdog.Verdict
    ) -> _Ended | None:
        """Take part in investigation ``number`` of the round (agent/investigation.py); None
        while the round goes on (dismissed: the job still moves; or given up)."""
        self._hangs_answered.add(number)
        suspicion = None
        if verdict.hung:
            first = verdict.hung[0]
            overridden = self.spec.hang_timeout is not None and first.phase is not (
                watchdog.Phase.STARTUP
            )
            suspicion = hangs.Suspicion(
                first.rank, first.phase.value, first.waited, first.deadline, overridden
            )
            log.debug("%s: %s", self._node, first.sentence(overridden))
        log.debug("%s: taking part in hang investigation %d", self._node, number)
        found = investigation.Investigation(
            self.rdzv,
            rdzv_round,
            group,
            number,
            verdict.waits,
            suspicion,
            self.spec.poll_interval,
            interrupted=lambda: self._stop_signal is not None,
            say=self._say,
            keep_alive=self._lease_while_round_is_ours,
            through=self._interruptibly,
        ).run()
        if found is None:
            return None
        self._hang_event(found, group)
        if found.verdict.kind == hangs.DISMISSED:
            self._say(found.verdict.sentence)
            assert self._watch is not None
            self._watch.excuse(time.time())
            return None
        return self._hang_ended(found, group)

    def _lease_while_round_is_ours(self) -> None:
        """Renew the workers' lease as a poll would (``poll_decision``'s rule): while the round
        is not superseded and the connection is up."""
        if not self.rdzv.changed.is_set() and self.rdzv.suspended_since() is None:
            self._renew_lease()

    def _hang_event(self, found: investigation.Finding, group: WorkerGroup) -> None:
        """This node's evidence and the agreed verdict: what ``events`` shows of a hang."""
        verdict = found.verdict
        self._event(
            Kind.HANG,
            round=self._round_number,
            **HangDetails(
                investigation=found.number,
                verdict=verdict.kind,
                rank=verdict.rank,
                culprit_slot=verdict.slot,
                sentence=verdict.sentence,
                evidence=investigation.evidence_lines(found.evidence),
                logs={str(worker.rank): str(worker.paths.log) for worker in group.workers},
            ).to_details(),
        )

    def _hang_ended(self, found: investigation.Finding, group: WorkerGroup) -> _Ended:
        """The round's end for this node after a hang's verdict: its culprit is here (this
        node records the failure, against itself), or it is ambiguous and this node was
        chosen to record it (against nobody), or this node's ranks only waited."""
        verdict, node = found.verdict, self.rdzv.node
        if investigation.culprit_here(verdict, node.node_id):
            assert verdict.rank is not None
            worker = next(w for w in group.workers if w.rank == verdict.rank)
            where = rootcause.hung_sentence(worker.rank, worker.paths.log)
            failure = self._failure(verdict.rank, None, f"{verdict.sentence}\n{where}")
            return _Ended(
                Outcome.FAILED,
                failure,
                hung=True,
                sentence=verdict.sentence,
                said=where,
                blamed=verdict.rank,
            )
        lines = "\n".join(f"rank {rank}: {line}" for rank, line in verdict.evidence.items())
        # The rendezvous state wants a rank: the culprit's, else this node's first (the
        # message says nobody is blamed; the failure event says rank None).
        rank = verdict.rank if verdict.rank is not None else min(w.rank for w in group.workers)
        failure = Failure(
            node_id=node.node_id,
            host=node.host,
            rank=rank,
            exit_code=None,
            signal=None,
            message=f"{verdict.sentence}\n{lines}"[: investigation.MESSAGE_BOUND],
            time=time.time(),
            slot=node.slot,
        )
        here = verdict.reporter == node.node_id
        return _Ended(
            Outcome.FAILED,
            failure,
            hung=here,
            victim=not here,
            sentence=verdict.sentence,
            said=lines,
            node_fault=False,
            blamed=verdict.rank,
        )

    def _finish_round(self, rdzv_round: Round, ended: _Ended) -> ExitCode | None:
        """Act on how the round ended; None means: join the next round.

        Decide-then-act: ``after_round`` (pure) names the next action from what is known so
        far, ``_act`` (the one executor) carries it out and adds what it learned, until an
        action ends the round for this node. The simulation runs the same ``after_round``."""
        group = self._group
        assert group is not None
        if ended.outcome is Outcome.SUCCEEDED:
            self._group = None  # every local worker exited 0: nothing left to stop
        failure = ended.failure
        end = RoundEnd(
            ended.outcome,
            hung=ended.hung,
            # A hang's victim waited for a rank elsewhere: it hears of that rank's failure.
            echo=failure is not None
            and (ended.victim or (not ended.hung and rootcause.is_echo(failure))),
            takes_rounds=ended.outcome is not Outcome.SUCCEEDED
            and self._in_place is not None
            and self._in_place.takes_rounds(group),
        )
        facts = _RoundFacts(
            rdzv_round,
            failure,
            hang=ended.hung or ended.victim,
            sentence=ended.sentence,
            said=ended.said,
            node_fault=ended.node_fault,
            blamed=ended.blamed,
        )
        while True:
            end = replace(end, stop_signal=self._stop_signal is not None)
            action = rules.after_round(end)  # looked up here: a test replacing it hits both
            log.debug(
                "%s: round %d %s, next: %s", self._node, rdzv_round.number, told(end), action.value
            )
            if action in ENDS_ROUND:
                return self._end_round(action, end, facts)
            end = self._act(action, end, facts)

    def _act(self, action: AfterRound, end: RoundEnd, facts: _RoundFacts) -> RoundEnd:
        """Carry out one action that does not end the round; return what it learned."""
        number = facts.round.number
        if action is AfterRound.BARRIER:
            return replace(end, barrier=self._succeed(facts.round))
        if action in (AfterRound.STOP_WORKERS, AfterRound.KEEP_WORKERS):
            self._stop_or_keep(action, end.outcome, number)
            if end.outcome is Outcome.FAILED:
                self._enter(AgentPhase.REPORTING)
            return replace(end, workers_stopped=True)
        if action is AfterRound.WAIT_FOR_CHANGE:
            heard, stalled = self._listen_for_change()
            cut_off = not heard and self.rdzv.suspended_since() is not None
            return replace(end, heard_change=heard, stalled=stalled, cut_off=cut_off)
        failure = facts.failure
        assert failure is not None, f"{action.value} needs the failure"
        if action is AfterRound.ANNOUNCE_FAILURE:
            facts.unfixable = self._announce(number, failure, facts)
            return replace(end, announced=True, unfixable=facts.unfixable is not None)
        assert action in (AfterRound.REPORT_FAILURE, AfterRound.FAIL_JOB), action
        if action is AfterRound.FAIL_JOB:
            assert facts.unfixable is not None
            sentence = facts.unfixable
            report: Callable[[], None] = lambda: self.rdzv.fail(sentence)  # noqa: E731
        else:
            report = lambda: self.rdzv.report_failure(failure)  # noqa: E731
        if end.stop_signal:
            # A stop is pending: report all the same (after_round says why), within bounds.
            with contextlib.suppress(_Interrupted):
                self._interruptibly(report, finish_within=self.rdzv.settings.session_timeout)
            return replace(end, reported=True)
        try:
            self._interruptibly(report)
        except _Interrupted:
            return replace(end, reported=True)  # the signal now pending makes it leave
        if action is AfterRound.REPORT_FAILURE:
            self._event(Kind.FAILURE_REPORTED, round=number, rank=failure.rank)
        return replace(end, reported=True)

    def _end_round(self, action: AfterRound, end: RoundEnd, facts: _RoundFacts) -> ExitCode | None:
        """Carry out an action that ends the round for this node: an exit code, or None to
        join the next round."""
        if action is AfterRound.DRAIN:
            assert self._group is not None
            return self._drain(self._group, self._signal_exit_code())
        if action is AfterRound.DRAIN_PREEMPTED:
            assert self._group is not None
            self._say("Workers stopped for preemption; exiting so the job is requeued.")
            return self._drain(self._group, ExitCode.PREEMPTED)
        if action is AfterRound.LEAVE:
            return self._leave_on_signal()
        number = facts.round.number
        if action is AfterRound.DONE:
            self._event(Kind.DONE, round=number)
            return ExitCode.SUCCESS
        assert action is AfterRound.REJOIN, action
        if end.outcome is Outcome.SUCCEEDED:
            self._say("A worker failed on another node; rejoining to rerun from the checkpoint.")
        if end.outcome is Outcome.FENCED:
            self._say(
                "Lost touch with the rendezvous for "
                f"{fence_after(self.rdzv.settings.session_timeout):g} s; stopped the workers so "
                "that the other nodes can re-form without two groups training at once."
            )
        reason = restart_reason(end)
        if reason is not None:
            self._event(Kind.RESTART, round=number, reason=reason)
        return None

    def _stop_or_keep(self, action: AfterRound, outcome: Outcome, round_number: int) -> None:
        group = self._group
        assert group is not None
        self._enter(AgentPhase.STOPPING)
        if action is AfterRound.KEEP_WORKERS:
            # In-place mode: the workers that are alive wait for the next round at a step
            # boundary (or broke out of a collective on the dead peer); only the dead are gone.
            kept = group.keep_running()
            log.debug("%s: keeping %d worker(s) for the next round", self._node, len(kept))
            return
        if outcome is Outcome.CHANGED and self.rdzv.only_arrivals():
            # Every rank is healthy: a slow step still reaches its boundary and saves.
            grace = max(self.spec.stop_grace, rdzv_state.arrival_grace(self.rdzv.settings))
            self._stop_with_grace(group, signal.SIGTERM, grace, self._lease_while_arrivals)
        else:
            # After a worker's death the others are blocked on it: only a saving rank waits.
            # So after a failure or a loss elsewhere: a framework's rank may outlive its
            # failed collective (Lightning tears down first) and would hold the stop grace.
            peer_dead = outcome is Outcome.FAILED or (
                outcome is Outcome.CHANGED and self.rdzv.peer_lost()
            )
            group.stop(self.spec.stop_grace, peer_dead=peer_dead)
        self._event(Kind.WORKERS_STOPPED, round=round_number)
        self._group = None

    def _announce(self, round_number: int, failure: Failure, facts: _RoundFacts) -> str | None:
        """Say the root cause and record it; the sentence of why no restart can fix it, or
        None. The failure event's observers may ask this node to leave (the bad-node watch),
        unless it does not count against this node (``node_fault``: a hang blamed elsewhere
        or on nobody)."""
        hung = facts.hang
        if facts.sentence:
            # The verdict's sentence first, then where the culprit hung and that its log has
            # every thread's stack, or each rank's evidence; not the log's tail (the failure's
            # message keeps that), which buried the sentence once.
            body = "".join(f"\n    {line}" for line in facts.said.splitlines())
            self._say(f"Hang, root cause: {facts.sentence}{body}")
        else:
            self._say(f"Worker failure, root cause:\n{rootcause.summary(failure)}")
        self._event(
            Kind.FAILURE,
            round=round_number,
            **FailureDetails(
                # A hang's verdict names its culprit, or nobody (None).
                rank=facts.blamed if facts.sentence else failure.rank,
                exit_code=failure.exit_code,
                signal=failure.signal,
                message=failure.message,
                hung=hung,
                sentence=facts.sentence,
                node_fault=facts.node_fault,
            ).to_details(),
        )
        unfixable = self._unfixable(failure, hung)
        if unfixable is None:
            return None
        # Every agent's round is superseded; the next next_round raises JobFailedError,
        # which ends the job through the usual path.
        kind, sentence = unfixable
        self._say(sentence)
        self._event(kind, round=round_number, reason=sentence)
        return sentence

    def _unfixable(self, failure: Failure, hung: bool) -> tuple[Kind, str] | None:
        """A failure no restart can fix, as (event kind, sentence): a user error (an
        ImportError, a bad argument), or the breaker's verdict on restarts without a new
        checkpoint, read from the job's shared events file."""
        if not hung and watchdog.classify_exit(failure.exit_code, failure.message) is (
            watchdog.ExitClass.USER_ERROR
        ):
            return Kind.USER_ERROR, watchdog.user_error_sentence(
                failure.rank, failure.exit_code, failure.message
            )
        history = watchdog.checkpoints_at_restarts(
            events.read(self.spec.events_file, watchdog.BREAKER_KINDS)
        )
        tripped = self._breaker.tripped(history)
        return (Kind.BREAKER, tripped) if tripped is not None else None

    def _wait_for_change(self) -> bool:
        """Wait to hear of the peer that really failed: its failure report or its departure
        (``changed``), up to ``echo_wait``, which allows for an expiry a few ticks late."""
        heard, _ = self._listen_for_change()
        return heard

    def _listen_for_change(self) -> tuple[bool, bool]:
        """``_wait_for_change``, and whether the wait ran out while this process was stalled
        (``overslept``): then it was not listening when the news would have come."""
        started, cut_off_before, stalled = time.monotonic(), self.rdzv.time_cut_off(), 0.0
        while self._stop_signal is None:
            # A freeze may count twice (stalled, and cut off when it outlived the session's
            # pings): that only waits longer, within the bound of one more freeze.
            unheard = stalled + self.rdzv.time_cut_off() - cut_off_before
            deadline = echo_deadline(started, self.rdzv.settings, unheard)
            before = time.monotonic()
            if before >= deadline:
                return False, overslept(deadline, before)
            if self.rdzv.changed.wait(self.spec.poll_interval):
                return True, False
            late = time.monotonic() - before - self.spec.poll_interval
            if late > OVERSLEPT:
                stalled += late
        return False, False

    def _succeed(self, rdzv_round: Round) -> bool | None:
        """The exit barrier: True when every node succeeded, False when a failure elsewhere
        ended the round, None when a stop signal interrupted the wait. A job that failed
        meanwhile raises ``JobFailedError``, which the loop ends the job with."""
        self._enter(AgentPhase.SUCCEEDING)
        self._say("All local workers finished; waiting for the other nodes.")
        try:
            return self._interruptibly(self.rdzv.report_success)
        except _Interrupted:
            return None

    def _drain(self, group: WorkerGroup, code: ExitCode) -> ExitCode:
        """Forward the stop signal once, give the workers ``--grace`` to save, then kill them."""
        self._enter(AgentPhase.DRAINING)
        signum = self._stop_signal
        if signum is not None:
            self._say(
                f"Got {signal.Signals(signum).name}; forwarding it to the workers and giving "
                f"them {self.spec.grace:g} s to save."
            )
        self._stop_with_grace(
            group, signum or signal.SIGTERM, self.spec.grace, self._lease_while_connected
        )
        preempted = ExitCode.PREEMPTED
        if code is not ExitCode.PREEMPTED and all(
            worker.returncode == preempted for worker in group.workers
        ):
            code = ExitCode.PREEMPTED
        self._group = None
        return self._leave(code)

    def _stop_with_grace(
        self, group: WorkerGroup, signum: int, grace: float, keep_lease: Callable[[], bool]
    ) -> None:
        """Send ``signum`` exactly once (a second SIGINT makes the training helpers raise
        KeyboardInterrupt mid-save), keep the lease fresh while ``keep_lease`` allows (a
        stale lease would fence the ranks at their step boundary, before the save), then
        SIGKILL what is left after ``grace``, or once a stop signal's own grace has ended
        (a signal that came while the workers stopped for arrivals ends that wait too)."""
        group.forward(signum)
        group.forward(signal.SIGCONT)
        deadline = time.monotonic() + grace
        if self._stop_by is not None:
            deadline = min(deadline, self._stop_by)
        while group.running() and time.monotonic() < deadline:
            if keep_lease():
                self._renew_lease()
            group.wait(min(self.spec.poll_interval, max(0.0, deadline - time.monotonic())))
        group.stop(0.0, signal.SIGKILL)

    def _lease_while_connected(self) -> bool:
        """While a node leaves on a signal, its lease lasts as long as its connection."""
        return self.rdzv.suspended_since() is None

    def _lease_while_arrivals(self) -> bool:
        """While workers stop for arrivals, the lease lasts as long as the round ends for
        arrivals only (a departure or a lost connection ends it): no round can form without
        this node before the others' straggler timeout, which the arrival grace is under."""
        return self._lease_while_connected() and self.rdzv.only_arrivals()

    def _leave_on_signal(self) -> ExitCode:
        """Leave on the pending stop signal; in-place survivors kept for the next round get
        the signal and ``--grace`` first, as any drained worker does."""
        if self._group is not None:
            self._enter(AgentPhase.DRAINING)
            self._stop_with_grace(
                self._group,
                self._stop_signal or signal.SIGTERM,
                self.spec.grace,
                self._lease_while_connected,
            )
            self._group = None
        return self._leave(self._signal_exit_code())

    def _leave(self, code: ExitCode) -> ExitCode:
        self._event(Kind.PREEMPT if code is ExitCode.PREEMPTED else Kind.LEAVE, exit_code=int(code))
        self._release()
        return code

    def _release(self) -> None:
        """Leave the rendezvous and close the connection, waiting ``LEAVE_WAIT`` at most. Cut
        off, not at all: kazoo would hold the request until the connection came back, for ever
        if the ensemble is gone, and the membership goes with the session anyway."""
        if self.rdzv.suspended_since() is not None:
            log.debug("%s: cut off, leaving without a word to the store", self._node)
            return
        try:
            self._interruptibly(self.rdzv.leave, finish_within=LEAVE_WAIT)
        except _Interrupted:
            log.debug("%s: the store did not take the leave within %g s", self._node, LEAVE_WAIT)
        except Exception as error:  # kazoo's StopFailedError too: the session ends it anyway
            log.debug("%s: the leave failed (%s); the session ends it", self._node, error)

    def _signal_exit_code(self) -> ExitCode:
        assert self._stop_signal is not None, "only asked once a stop signal came"
        return stops.exit_code(self._stop_signal, self.spec.preempt_signal)

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

    def _interruptibly(self, call: Callable[[], T], finish_within: float | None = None) -> T:
        """Run a blocking rendezvous call on a helper thread; give up on a stop signal, also
        one that came before the call (e.g. the bad-node watch, from an event observer), and
        with ``RendezvousUnreachableError`` once the store has been out of reach for the
        outage limit: the call itself may be blocked in kazoo until the connection comes
        back, which a dead ensemble never does, so only this thread can tell.

        With ``finish_within``, the call runs despite a stop, for at most that many seconds."""
        if self._stop_signal is not None and finish_within is None:
            raise _Interrupted
        deadline = None if finish_within is None else time.monotonic() + finish_within
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
            if deadline is not None:
                if time.monotonic() >= deadline:
                    raise _Interrupted
                continue
            if self._stop_signal is not None:
                raise _Interrupted
            self.rdzv.check_reach()
        if error:
            raise error[0]
        return result[0]

    def _event(self, kind: Kind, round: int | None = None, **details: object) -> None:
        event = events.Event(
            kind=kind,
            job=self.rdzv.settings.run_id,
            slot=self.rdzv.node.slot,
            round=round,
            details={"node_id": self.rdzv.node.node_id, "phase": self._phase.value, **details},
        )
        events.append(self.spec.events_file, event)
        if self._on_event is not None:
            self._on_event(event)


def _reading(worker: Worker) -> tuple[float, int | None, bool] | None:
    """A rank's heartbeat (mtime, step, whether it is a checkpoint mark), or None before its
    first beat."""
    try:
        return heartbeat.read_marked(worker.paths.heartbeat)
    except OSError:
        return None


def round_details(rdzv_round: Round) -> RoundDetails:
    """What a round's event records: its sizes, and the first of its members' slots (or node
    ids, ``events.leading``). Every agent writes it every round, so listing every member was
    N lines of N names, and past a few hundred members a line too long to append whole."""
    slots = [member.slot or member.node_id for member in rdzv_round.members]
    return RoundDetails(
        world_size=rdzv_round.world_size,
        members=events.leading(slots),
        restarts_used=rdzv_round.restarts_used,
        member_count=len(slots),
    )
