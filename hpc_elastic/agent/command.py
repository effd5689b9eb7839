"""``hpc-elastic agent``: what each Slurm step runs through ``srun``, one per node.

Parses the flags the sbatch template passes, connects to the job's rendezvous, installs
the signal handlers and runs the ``Agent``; its exit code is the agent's (see ``ExitCode``).
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from hpc_elastic import events
from hpc_elastic.agent.agent import Agent
from hpc_elastic.agent.api import AgentSpec, parse_signal
from hpc_elastic.rendezvous import local_store
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.secret import read_secret_file
from hpc_elastic.slurm.elastic import ElasticSlot, SlotLimits
from hpc_elastic.spec import NodeRange

HOST_ENV = "HPC_ELASTIC_HOST"

CONTEXT = {"allow_interspersed_args": False}
"""Everything after ``--`` (or after the first positional argument) is the worker command."""


def agent(  # noqa: PLR0917 (Typer maps each parameter to a flag)
    command: Annotated[
        list[str],
        typer.Argument(metavar="COMMAND", help="The worker command, e.g. python -u train.py."),
    ],
    run_id: Annotated[str, typer.Option(help="The job's rendezvous id, shared by its agents.")],
    job_dir: Annotated[
        Path, typer.Option(help="The job directory: logs, checkpoints, events.jsonl.")
    ],
    zk: Annotated[
        str, typer.Option(help="ZooKeeper hosts 'h1:p1,h2:p2[/chroot]', or local:SOCKET.")
    ],
    nodes: Annotated[
        NodeRange,
        typer.Option(parser=NodeRange.parse, metavar="MIN:MAX", help="Node count or range."),
    ],
    nproc_per_node: Annotated[int, typer.Option(help="Workers on this node.")] = 1,
    zk_auth_file: Annotated[
        Path | None, typer.Option(help="File holding the job's ZooKeeper secret (mode 0600).")
    ] = None,
    max_restarts: Annotated[
        int, typer.Option(help="Worker-failure restarts for the whole job.")
    ] = 3,
    preempt_signal: Annotated[
        str, typer.Option(metavar="USR1|USR2", help="Signal that announces preemption.")
    ] = "USR2",
    grace: Annotated[
        float, typer.Option(help="Seconds workers get to save after a stop signal.")
    ] = 30.0,
    hang_timeout: Annotated[
        float | None, typer.Option(help="Kill a rank whose heartbeat is this many seconds old.")
    ] = None,
    last_call: Annotated[
        float, typer.Option(help="Seconds a round waits for more nodes once MIN are in.")
    ] = 2.0,
    session_timeout: Annotated[
        float, typer.Option(help="ZooKeeper session timeout: how fast a dead node is noticed.")
    ] = 6.0,
    min_wait: Annotated[
        float, typer.Option(help="Seconds the job may stay below MIN nodes before failing.")
    ] = 600.0,
    max_preemptions: Annotated[
        int, typer.Option(help="Requeues of this slot after preemption before it gives up.")
    ] = 100,
    max_time_limits: Annotated[
        int, typer.Option(help="Requeues of this slot after its time limit before it gives up.")
    ] = 10,
    exclude_after: Annotated[
        int, typer.Option(help="Failures of this slot on one node before it avoids that node.")
    ] = 2,
    slot: Annotated[
        str | None, typer.Option(help="This node's slot name (default: from Slurm).")
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(help=f"Address other nodes reach this one at (default: ${HOST_ENV}, DNS)."),
    ] = None,
    prewarm: Annotated[
        list[str] | None,
        typer.Option(
            metavar="MODULE",
            help="Keep standby workers that imported MODULE (e.g. torch): faster restarts.",
        ),
    ] = None,
    tee: Annotated[
        bool, typer.Option(help="Also copy the workers' output to the console.")
    ] = False,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port (0: any free one).")
    ] = None,
    metrics_textfile: Annotated[
        Path | None, typer.Option(help="Write Prometheus metrics here for node_exporter.")
    ] = None,
) -> None:
    """Run this node's workers in the job's rendezvous; restart them as nodes come and go."""
    spec = AgentSpec(
        job_dir=job_dir.absolute(),
        command=tuple(command),
        nproc_per_node=nproc_per_node,
        preempt_signal=parse_signal(preempt_signal),
        grace=grace,
        hang_timeout=hang_timeout,
        tee=tee,
        prewarm=tuple(prewarm or ()),
    )
    settings = RendezvousSettings(
        run_id=run_id,
        nodes=nodes,
        last_call=last_call,
        session_timeout=session_timeout,
        min_wait=min_wait,
        max_restarts=max_restarts,
    )
    slot = slot if slot is not None else default_slot(os.environ)
    node = NodeInfo(
        node_id=f"{slot or socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        host=host or default_host(os.environ),
        nproc=nproc_per_node,
        slot=slot,
    )
    secret = read_secret_file(zk_auth_file) if zk_auth_file is not None else None
    limits = SlotLimits(max_preemptions, max_time_limits, exclude_after)
    array_slot = ElasticSlot.from_env(os.environ, spec.job_dir, limits)
    expected = array_slot.expected_nodes() if array_slot is not None else _slurm_node_count

    if local_store.is_local(zk):
        rdzv = local_store.connect(zk, settings, node, expected_nodes=expected)
    else:
        from hpc_elastic.rendezvous.zookeeper import connect  # noqa: PLC0415 (kazoo: only here)

        rdzv = connect(zk, settings, node, secret=secret, expected_nodes=expected)
    observers: list[Callable[[events.Event], None]] = []
    exporter = None
    if metrics_port is not None or metrics_textfile is not None:
        from hpc_elastic import metrics  # noqa: PLC0415 (prometheus_client: only when asked)

        gauges = metrics.AgentMetrics(run_id, slot, spec.events_file)
        observers.append(gauges.observe)
        runner = Agent(spec, rdzv, on_event=_fan_out(observers))
        exporter = metrics.MetricsExporter(
            gauges, runner.step, port=metrics_port, textfile=metrics_textfile
        )
        if exporter.port is not None:
            typer.echo(f"hpc-elastic agent: metrics on port {exporter.port}", err=True)
    else:
        runner = Agent(spec, rdzv, on_event=_fan_out(observers))
    if array_slot is not None:
        observers.append(_bad_node_watch(array_slot, runner, spec.preempt_signal))
        _arrive(array_slot, spec, run_id)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        runner.request_stop(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, spec.preempt_signal):
        signal.signal(signum, on_signal)
    try:
        code = int(runner.run())
    finally:
        if exporter is not None:
            exporter.stop()
    if array_slot is not None:
        code = array_slot.settle(code, spec.grace, _emitter(spec, run_id, array_slot))
    raise typer.Exit(code)


def _fan_out(observers: list[Callable[[events.Event], None]]) -> Callable[[events.Event], None]:
    def observe(event: events.Event) -> None:
        for observer in observers:
            observer(event)

    return observe


def _bad_node_watch(
    array_slot: ElasticSlot, runner: Agent, preempt_signal: signal.Signals
) -> Callable[[events.Event], None]:
    """Count this slot's worker failures on its node; at the limit, stop and move elsewhere."""

    def observe(event: events.Event) -> None:
        if event.kind == "failure" and array_slot.count_failure():
            runner.request_stop(preempt_signal)

    return observe


def _emitter(spec: AgentSpec, run_id: str, array_slot: ElasticSlot) -> Callable[..., None]:
    def emit(kind: str, **details: object) -> None:
        event = events.Event(kind=kind, job=run_id, slot=str(array_slot.context.array_task_id))
        events.append(spec.events_file, replace(event, details=dict(details)))

    return emit


def _arrive(array_slot: ElasticSlot, spec: AgentSpec, run_id: str) -> None:
    """Record this incarnation; one that died with its node counts against that node."""
    spec.job_dir.mkdir(parents=True, exist_ok=True)
    crashed_on = array_slot.arrive()
    if crashed_on is not None:
        _emitter(spec, run_id, array_slot)("node_failure", node=crashed_on)


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
