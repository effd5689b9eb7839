"""``hpc-elastic agent``: what each Slurm step runs through ``srun``, one per node.

Parses the flags the sbatch template passes, connects to the job's rendezvous, installs
the signal handlers and runs the ``Agent``; its exit code is the agent's (see ``ExitCode``).
"""

from __future__ import annotations

import getpass
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpc_elastic import contract, events, notify
from hpc_elastic.agent import badnodes, stops
from hpc_elastic.agent.agent import Agent, Prepared, prepare
from hpc_elastic.agent.api import AgentSpec, ExitCode, parse_signal
from hpc_elastic.clicktools import exit_with
from hpc_elastic.errors import AgentError, RendezvousUnreachableError
from hpc_elastic.events import Kind
from hpc_elastic.jobdir import BEAT_S, ensure_job_dir, untrusted_job_dir, write_beat
from hpc_elastic.logs import configure_from_env
from hpc_elastic.options import AGENT_OPTIONS, AgentArguments, with_options
from hpc_elastic.rendezvous import local_store
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.handler import StoreRendezvous, unreachable_sentence
from hpc_elastic.rendezvous.secret import read_secret_file
from hpc_elastic.slurm.commands import NodeDrain
from hpc_elastic.slurm.elastic import ElasticSlot
from hpc_elastic.slurm.ledger import SlotLimits

if TYPE_CHECKING:
    from hpc_elastic.agent.health import BadNodeStore, Check, Preflight
    from hpc_elastic.agent.metrics import MetricsExporter
    from hpc_elastic.rendezvous.badnode import BadNode

HOST_ENV = contract.HOST_ENV
_log = logging.getLogger(__name__)


@with_options(AGENT_OPTIONS)
@click.command(
    "agent",
    # Everything after ``--`` (or after the first positional argument) is the worker command.
    context_settings={"allow_interspersed_args": False},
)
@click.argument(
    "command", nargs=-1, required=True, help="The worker command, e.g. python -u train.py."
)
def agent(command: tuple[str, ...], **values: Any) -> None:
    """Run this node's workers in the job's rendezvous; restart them as nodes come and go."""
    configure_from_env()  # HPC_ELASTIC_LOG, also when called without main()
    # The handlers stay until the process exits: `scontrol requeue` in settle signals the
    # whole step, this agent too, and that signal may land after run_agent has returned.
    code = run_agent(command, AgentArguments.from_values(values), restore_signals=False)
    exit_with(code)


def run_agent(
    command: tuple[str, ...], args: AgentArguments, *, restore_signals: bool = True
) -> int:
    """Arrive in the slot, pass the preflight, join the rendezvous and run; the exit code.

    SIGTERM, SIGINT and the preemption signal are caught from here on (``stops``); with
    ``restore_signals`` the handlers found are put back at the end (a caller in-process)."""
    spec = agent_spec(command, args)
    signals = stops.StopSignals((signal.SIGTERM, signal.SIGINT, spec.preempt_signal))
    previous = signals.install()
    # One notifier for the whole agent process (submit --notify; it never blocks the agent):
    # the slot's own events (a task Slurm holds, reported by the squeue thread or by the
    # last slot as it requeues itself in settle) come outside the Agent's observers, and
    # settle runs after the Agent is done, so the notifier must outlive both.
    notifier = notify.from_environ(os.environ)
    try:
        return _run_agent(spec, args, notifier, signals)
    finally:
        if notifier is not None:
            notifier.close()
        if restore_signals:
            stops.restore(previous)


def _run_agent(
    spec: AgentSpec,
    args: AgentArguments,
    notifier: notify.Notifier | None,
    signals: stops.StopSignals,
) -> int:
    """``run_agent`` with its notifier and its stop signals."""
    _check_job_dir(spec.job_dir)
    slot = args.slot if args.slot is not None else default_slot(os.environ)
    limits = SlotLimits(args.max_preemptions, args.max_time_limits, args.exclude_after)
    array_slot = ElasticSlot.from_env(os.environ, spec.job_dir, limits)
    if notifier is not None:  # an alert not delivered is said in the job's timeline
        notifier.on_drop = notify.drop_reporter(_emitter(spec, args.run_id, array_slot))
    if array_slot is not None:
        _arrive(array_slot, spec, args.run_id)
    # The standbys start importing now, while the preflight and the connection go on.
    prepared = prepare(spec, args.run_id, os.environ, links=True)
    slot_emit = _emitter(spec, args.run_id, array_slot, notifier)
    try:
        if args.preflight:
            code = _preflight(spec, args, array_slot, signals)
            if code is not None:
                return code
        if array_slot is not None and (drained := array_slot.drain.here()) is not None:
            return _leave_drained(array_slot, drained, slot_emit)
        expected = (
            array_slot.expected_nodes(slot_emit) if array_slot is not None else _slurm_node_count
        )
        link_port = prepared.links.port if prepared.links is not None else 0
        node = this_node(args, slot, link_port)
        rdzv = _connect_until_stopped(args, node, expected, signals)
        code = _supervise(
            spec,
            args,
            rdzv,
            slot,
            array_slot,
            notifier=notifier,
            prepared=prepared,
            signals=signals,
        )
    except stops.Stopped as stopped:
        code = _stopped_before_joining(stopped, spec, args.run_id, slot_emit)
    except RendezvousUnreachableError as error:
        code = _unreachable_before_joining(error, slot_emit)
    finally:
        prepared.close()  # the agent's own end closed it already, unless it never ran
    if array_slot is not None:
        code = array_slot.settle(code, spec.grace, slot_emit)
    return code


def _check_job_dir(job_dir: Path) -> None:
    """Refuse a job directory that is not ours alone before anything in it is read or run:
    the worker command runs the code snapshot in it, and the secret lies in it."""
    problem = ensure_job_dir(job_dir)
    if problem is not None:
        raise AgentError(untrusted_job_dir(job_dir, problem))
    _log.debug("job directory %s is ours alone", job_dir)


def _stopped_before_joining(
    stopped: stops.Stopped, spec: AgentSpec, run_id: str, emit: Callable[..., None]
) -> int:
    """A stop signal during the preflight or the connection: nothing joined, nothing to
    leave; the standbys go with ``prepared``. The preemption signal still exits 75, so that
    ``settle`` requeues the slot as for any preemption."""
    code = stops.exit_code(stopped.signum, spec.preempt_signal)
    click.echo(
        f"hpc-elastic agent: got {stopped} before joining job '{run_id}'; exiting with code "
        f"{int(code)}.",
        err=True,
    )
    emit(Kind.LEAVE, exit_code=int(code), reason=f"{stopped} before joining")
    return int(code)


def _unreachable_before_joining(
    error: RendezvousUnreachableError, emit: Callable[..., None]
) -> int:
    """The ensemble answered the connection, then went away for the outage limit before the
    job's nodes could be set up (``_connect_until_stopped``)."""
    code = ExitCode.UNREACHABLE
    click.echo(f"hpc-elastic agent: {error}", err=True)
    emit(Kind.ERROR, reason=str(error), exit_code=int(code))
    return int(code)


def agent_spec(command: tuple[str, ...], args: AgentArguments) -> AgentSpec:
    return AgentSpec(
        job_dir=args.job_dir.absolute(),
        command=command,
        nproc_per_node=args.nproc_per_node,
        preempt_signal=parse_signal(args.preempt_signal),
        grace=args.grace,
        hang_timeout=args.hang_timeout,
        tee=args.tee,
        prewarm=args.prewarm,
        exclude_stragglers=args.exclude_stragglers,
        in_place=args.in_place,
    )


def rendezvous_settings(args: AgentArguments) -> RendezvousSettings:
    return RendezvousSettings(
        run_id=args.run_id,
        nodes=args.nodes,
        last_call=args.last_call,
        session_timeout=args.session_timeout,
        min_wait=args.min_wait,
        max_restarts=args.max_restarts,
        outage_limit=args.zk_outage_limit,
    )


def this_node(args: AgentArguments, slot: str, link_port: int = 0) -> NodeInfo:
    """This incarnation's member: a fresh id each start (pid and random suffix), so a requeued
    slot never answers for its previous incarnation; ``link_port``: where it takes the links
    of the rounds it is the centre of (agent/links.py), 0 for none."""
    return NodeInfo(
        node_id=f"{slot or socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        host=args.host or default_host(os.environ),
        nproc=args.nproc_per_node,
        slot=slot,
        link_port=link_port,
    )


def _preflight(
    spec: AgentSpec,
    args: AgentArguments,
    array_slot: ElasticSlot | None,
    signals: stops.StopSignals,
) -> int | None:
    """The health checks, which a stop signal ends (``stops.Stopped``) wherever they are."""
    book = None if local_store.is_local(args.zk) else BadNodeMemory(args.zk, args.user_secret_file)
    return check_before_joining(
        _default_checks(spec, args.zk, args.expected_gpus),
        node=_node_name(array_slot, os.environ),
        run_id=args.run_id,
        array_slot=array_slot,
        book=book,
        ttl=args.bad_node_ttl,
        emit=_emitter(spec, args.run_id, array_slot),
        run=lambda checks: stops.until_stopped(checks, signals),
    )


def _supervise(
    spec: AgentSpec,
    args: AgentArguments,
    rdzv: StoreRendezvous,
    slot: str,
    array_slot: ElasticSlot | None,
    *,
    notifier: notify.Notifier | None,
    prepared: Prepared,
    signals: stops.StopSignals,
) -> int:
    """Run the ``Agent`` with its observers (alerts, metrics, the bad-node watch), told of
    every stop signal; stop what was started for it, however it ends."""
    observers: list[Callable[[events.Event], None]] = []
    if notifier is not None:
        leader = notify.RankZero()  # job-level alerts come from rank 0's agent only
        observers += [leader.observe, notify.observer(notifier, leader)]
    runner, exporter = _start(spec, args, rdzv, slot, observers, prepared=prepared)
    watch = drains = saves = None
    if array_slot is not None:
        observers.append(_bad_node_watch(array_slot, runner, spec))
        watch = array_slot.departure.watch(spec.grace)
        # Leaves a node Slurm drains at the next checkpoint, as a preemption would.
        drains = array_slot.drain.watch(
            lambda: runner.request_stop(spec.preempt_signal),
            _emitter(spec, args.run_id, array_slot, notifier),
        )
        # Times this node's saves against what Slurm leaves after its warning signal.
        saves = array_slot.grace.watch(
            prepared.run.path,
            spec.grace,
            args.grace_action,
            lambda: runner.request_stop(spec.preempt_signal),
            _emitter(spec, args.run_id, array_slot, notifier),
        )

    def on_signal(signum: int) -> None:
        runner.request_stop(signum)
        if watch is not None:
            watch.signalled(signum)  # Ask Slurm why now: after the drain it may have moved on.

    signals.listen(on_signal)  # also of a signal caught while connecting
    beating = _beat_the_job(spec.job_dir, slot, runner, array_slot)
    try:
        return int(runner.run())
    finally:
        beating.set()
        if drains is not None:
            drains.stop()
        if saves is not None:
            saves.stop()
        if exporter is not None:
            exporter.stop()


def _beat_the_job(
    job_dir: Path, slot: str, runner: Agent, array_slot: ElasticSlot | None
) -> threading.Event:
    """The job's own heartbeat for a watcher outside it (``hpc-elastic watch``): every
    ``BEAT_S``, the job's lowest running slot (every agent of a job that is not an array)
    writes the time and the training step. Set the returned event to stop."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(BEAT_S):
            if array_slot is not None and not array_slot.arrays.elected():
                continue
            try:
                write_beat(job_dir, time.time(), runner.step(), slot)
            except OSError as error:
                _log.debug("could not write the job's heartbeat: %s", error)

    threading.Thread(target=beat, name="hpc-elastic-beat", daemon=True).start()
    return stop


def _start(
    spec: AgentSpec,
    args: AgentArguments,
    rdzv: StoreRendezvous,
    slot: str,
    observers: list[Callable[[events.Event], None]],
    *,
    prepared: Prepared,
) -> tuple[Agent, MetricsExporter | None]:
    """The ``Agent``, and the metrics exporter when asked for one (it reads the agent's step
    and phase, so it is made after it; its gauges observe events like any other observer)."""
    if args.metrics_port is None and args.metrics_textfile is None:
        return Agent(spec, rdzv, on_event=_fan_out(observers), prepared=prepared), None
    from hpc_elastic.agent import metrics  # noqa: PLC0415 (prometheus_client: only when asked)

    gauges = metrics.AgentMetrics(args.run_id, slot, spec.events_file)
    observers.append(gauges.observe)
    runner = Agent(spec, rdzv, on_event=_fan_out(observers), prepared=prepared)
    exporter = metrics.MetricsExporter(
        gauges,
        runner.step,
        port=args.metrics_port,
        bind=args.metrics_bind,
        textfile=args.metrics_textfile,
        phase=lambda: runner.phase,
    )
    if exporter.port is not None:
        click.echo(f"hpc-elastic agent: metrics on port {exporter.port}", err=True)
    return runner, exporter


def _connect_until_stopped(
    args: AgentArguments,
    node: NodeInfo,
    expected: Callable[[], int | None],
    signals: stops.StopSignals,
) -> StoreRendezvous:
    """``_connect`` on a thread of its own, so that a stop signal ends the wait at once. An
    ensemble that answers the connection and then goes away holds the job's first requests
    in kazoo for ever: past the connect timeout plus the outage limit, that is an outage like
    any other (``RendezvousUnreachableError``)."""
    settings = rendezvous_settings(args)

    def connect() -> StoreRendezvous:
        return _connect(
            args.zk, settings, node, expected, args.zk_auth_file, open_acl=args.zk_open_acl
        )

    if local_store.is_local(args.zk):
        return stops.until_stopped(connect, signals)
    from hpc_elastic.rendezvous.zookeeper import (  # noqa: PLC0415 (kazoo: only here)
        CONNECT_TIMEOUT,
        ZooKeeperAddress,
    )

    where = f"ZooKeeper at '{ZooKeeperAddress.parse(args.zk)}'"
    return stops.until_stopped(
        connect,
        signals,
        within=CONNECT_TIMEOUT + settings.give_up_after,
        on_timeout=lambda: RendezvousUnreachableError(unreachable_sentence(where, settings)),
    )


def _connect(
    zk: str,
    settings: RendezvousSettings,
    node: NodeInfo,
    expected: Callable[[], int | None],
    zk_auth_file: Path | None,
    *,
    open_acl: bool,
) -> StoreRendezvous:
    """This node's rendezvous: a private socket for ``local:`` addresses, else ZooKeeper."""
    if local_store.is_local(zk):
        return local_store.connect(zk, settings, node, expected_nodes=expected)
    from hpc_elastic.rendezvous.zookeeper import connect  # noqa: PLC0415 (kazoo: only here)

    secret = read_secret_file(zk_auth_file) if zk_auth_file is not None else None
    return connect(zk, settings, node, secret=secret, open_acl=open_acl, expected_nodes=expected)


def _fan_out(observers: list[Callable[[events.Event], None]]) -> Callable[[events.Event], None]:
    def observe(event: events.Event) -> None:
        for observer in observers:
            observer(event)

    return observe


def _bad_node_watch(
    array_slot: ElasticSlot, runner: Agent, spec: AgentSpec
) -> Callable[[events.Event], None]:
    """Count this slot's worker failures on its node (never a hang blamed on another node or
    on nobody: ``events.charges_node``); at the limit, stop and move elsewhere.
    With ``--exclude-stragglers`` a straggling rank here makes the node bad at once: the
    slot drains (its workers save) and ``settle`` requeues it away, as after failures."""

    def observe(event: events.Event) -> None:
        if events.charges_node(event) and array_slot.count_failure():
            runner.request_stop(spec.preempt_signal)
        elif event.kind == Kind.STRAGGLER and spec.exclude_stragglers:
            array_slot.mark_bad()
            runner.request_stop(spec.preempt_signal)

    return observe


def _emitter(
    spec: AgentSpec,
    run_id: str,
    array_slot: ElasticSlot | None,
    notifier: notify.Notifier | None = None,
) -> Callable[..., None]:
    """Write the slot's own events (arrival, requeue, a task Slurm holds) to the timeline;
    with ``notifier``, also post the alerts they deserve. Only slot-level alerts can come
    from here (``held``): job-level ones are the leader's, through the Agent's observers."""
    slot = str(array_slot.context.array_task_id) if array_slot is not None else ""
    alert = notify.observer(notifier, lambda: False) if notifier is not None else None

    def emit(kind: Kind, **details: object) -> None:
        spec.job_dir.mkdir(parents=True, exist_ok=True)
        event = replace(events.Event(kind=kind, job=run_id, slot=slot), details=dict(details))
        events.append(spec.events_file, event)
        if alert is not None:
            alert(event)

    return emit


# --- the health preflight ------------------------------------------------------------------


class BadNodeMemory:
    """The user's bad-node book in ZooKeeper, opened for each call (``health.BadNodeStore``):
    the preflight reads it once and writes at most once, so a held connection buys nothing."""

    def __init__(self, zk: str, secret_file: Path) -> None:
        self._zk = zk
        self._secret_file = secret_file.expanduser()
        self._user = getpass.getuser()

    def _secret(self) -> str:
        from hpc_elastic.rendezvous.secret import user_secret  # noqa: PLC0415

        self._secret_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return user_secret(self._secret_file)

    def remember(self, record: BadNode) -> None:
        from hpc_elastic.rendezvous import zookeeper  # noqa: PLC0415 (kazoo: only here)

        zookeeper.remember_bad_node(self._zk, self._user, self._secret(), record)

    def records(self) -> list[BadNode]:
        """The user's bad nodes not yet expired; expired records are deleted on the way."""
        from hpc_elastic.rendezvous import zookeeper  # noqa: PLC0415 (kazoo: only here)

        with zookeeper.bad_node_book(self._zk, self._user, self._secret()) as book:
            return badnodes.listing(book, time.time())


def _default_checks(spec: AgentSpec, zk: str, expected_gpus: int | None) -> dict[str, Check]:
    from hpc_elastic.agent import health  # noqa: PLC0415 (NVML and kazoo: only when asked)

    directories = [spec.job_dir, spec.checkpoint_dir]
    return health.default_checks(
        directories, None if local_store.is_local(zk) else zk, expected_gpus
    )


def check_before_joining(
    checks: Mapping[str, Check],
    *,
    node: str,
    run_id: str,
    array_slot: ElasticSlot | None,
    book: BadNodeStore | None,
    ttl: float,
    emit: Callable[..., None],
    run: Callable[[Callable[[], Preflight]], Preflight] | None = None,
) -> int | None:
    """Run the preflight; None for a healthy node, else the agent's exit code.

    An unhealthy node never joins: in a Slurm array its slot is requeued away from it and
    from every bad node the user's memory holds (exit 75); elsewhere there is nowhere to
    move, so the agent fails with one sentence (exit 1). The ``health`` event says why.
    ``run`` runs the checks (the agent command: on a thread that a stop signal gives up on).
    """
    from hpc_elastic.agent import health  # noqa: PLC0415 (NVML and kazoo: only when asked)

    def checks_now() -> Preflight:
        return health.preflight(
            checks, node=node, job=run_id, now=time.time(), book=book, ttl=ttl, emit=emit
        )

    checked = checks_now() if run is None else run(checks_now)
    if array_slot is not None:  # Every later requeue of the slot keeps away from them too.
        array_slot.remembered_bad = tuple(host for host in checked.exclude.split(",") if host)
    if checked.healthy:
        return None
    if array_slot is None:
        click.echo(
            f"hpc-elastic agent: node '{node}' failed its health check, so it does not join "
            f"job '{run_id}': {checked.reason} Fix the node or run the job elsewhere.",
            err=True,
        )
        return 1
    # `scontrol requeue` signals every process of the step, this agent too, and it has no
    # handler yet: without this it dies before it sets ExcNodeList and says so (seen on the
    # dev cluster: the slot came back to a bad node). It exits right after, so Slurm's
    # KillWait is never reached.
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        return array_slot.move_away("unhealthy", emit, reason=checked.reason)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _leave_drained(array_slot: ElasticSlot, drained: NodeDrain, emit: Callable[..., None]) -> int:
    """A node Slurm drained between granting it and this agent's start: leave before joining.
    ``scontrol requeue`` signals the whole step, this agent too (as in the preflight's move)."""
    click.echo(
        f"hpc-elastic agent: node '{drained.node}' is {drained.state} ({drained.reason}); "
        "requeueing this slot elsewhere before it joins.",
        err=True,
    )
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        return array_slot.leave_drained(drained, emit)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _arrive(array_slot: ElasticSlot, spec: AgentSpec, run_id: str) -> None:
    """Record this incarnation; one that died with its node counts against that node, one
    that Slurm killed while it drained for preemption or its time limit does not."""
    spec.job_dir.mkdir(parents=True, exist_ok=True)
    emit = _emitter(spec, run_id, array_slot)
    if array_slot.problem is not None:
        click.echo(f"hpc-elastic agent: {array_slot.problem}", err=True)
        emit(Kind.WARNING, message=array_slot.problem)
    arrival = array_slot.arrive()
    if arrival.node_failure is not None:
        emit(Kind.NODE_FAILURE, node=arrival.node_failure)
    elif arrival.killed_leaving is not None:
        emit(Kind.KILLED_LEAVING, node=arrival.crashed_on, cause=arrival.killed_leaving.value)


def _node_name(array_slot: ElasticSlot | None, environ: Mapping[str, str]) -> str:
    """The name Slurm knows this node by (what ``ExcNodeList`` takes), else the host's."""
    if array_slot is not None:
        return array_slot.node
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def default_slot(environ: Mapping[str, str]) -> str:
    """The array task id for elastic jobs, else the Slurm node name, else nothing."""
    return environ.get("SLURM_ARRAY_TASK_ID") or environ.get("SLURMD_NODENAME") or ""


def default_host(environ: Mapping[str, str]) -> str:
    """What other nodes dial: ``$HPC_ELASTIC_HOST``, else this host's name resolved."""
    if environ.get(HOST_ENV):
        return environ[HOST_ENV]
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def _slurm_node_count() -> int | None:
    """Nodes in this allocation: a round that has them all need not wait for the last call.

    Not for job arrays, where each task is its own one-node allocation.
    """
    count = os.environ.get("SLURM_JOB_NUM_NODES", "")
    if os.environ.get("SLURM_ARRAY_TASK_ID") or not count.isdigit():
        return None
    return int(count)
