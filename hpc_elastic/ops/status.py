"""``hpc-elastic status``: the job's events, its live rendezvous and Slurm's view, in one place."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.events import Event
from hpc_elastic.ops import timeline
from hpc_elastic.ops.jobs import JobRecord
from hpc_elastic.slurm.commands import JobStatus

SlurmQuery = Callable[[Sequence[str]], list[JobStatus]]


@dataclass(frozen=True)
class Slot:
    """One node slot: Slurm's word on it (array task) and what its agent last said."""

    slot: str
    slurm_state: str = "-"
    node: str = "-"
    agent: str = "-"
    """The agent's last event kind: join, round, start, restart, leave, preempt, ..."""


@dataclass(frozen=True)
class JobView:
    run_id: str
    job_id: str | None
    job_dir: str
    mode: str
    nodes: str
    nproc_per_node: int
    state: str
    """pending, running, succeeded, failed, stopped or unknown."""
    round: int | None
    world_size: int | None
    members: list[str]
    restarts_used: int
    max_restarts: int
    restarts: int
    preemptions: int
    requeues: int
    last_checkpoint_step: int | None
    last_checkpoint_time: float | None
    last_failure: str | None
    slots: list[Slot] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def gather(record: JobRecord, squeue: SlurmQuery) -> JobView:
    """Combine the events with Slurm's queue and the live rendezvous; never raises for them."""
    history = record.events()
    summary = timeline.summarize(history)
    warnings: list[str] = []
    slurm: list[JobStatus] = []
    if record.job_id is not None:
        try:
            slurm = squeue([record.job_id])
        except HpcElasticError as error:
            warnings.append(str(error))
    live = summary.outcome == "running" and (bool(slurm) or record.runner_alive())
    round_number, world, members = summary.round, summary.world_size, list(summary.members)
    restarts_used, failure = summary.restarts_used, summary.last_failure
    if live and record.zk:
        try:
            state = _rendezvous(record)
        except HpcElasticError as error:
            warnings.append(str(error))
        else:
            if state is not None:
                round_number, world = state.round, state.world_size
                members = [member.slot or member.host for member in state.members]
                restarts_used = state.restarts_used
                if state.last_failure is not None and failure is None:
                    failure = state.last_failure.message
    return JobView(
        run_id=record.run_id,
        job_id=record.job_id,
        job_dir=str(record.job_dir),
        mode="local" if record.local else "slurm",
        nodes=record.nodes,
        nproc_per_node=record.nproc_per_node,
        state=_state(summary.outcome, live, slurm, history),
        round=round_number,
        world_size=world,
        members=members,
        restarts_used=restarts_used,
        max_restarts=record.max_restarts,
        restarts=summary.restarts,
        preemptions=summary.preemptions,
        requeues=summary.requeues,
        last_checkpoint_step=summary.last_checkpoint_step,
        last_checkpoint_time=summary.last_checkpoint_time,
        last_failure=failure,
        slots=_slots(history, slurm, finished=summary.outcome != "running"),
        warnings=warnings,
    )


def _rendezvous(record: JobRecord) -> Any:
    """The live JobState, from the embedded store or ZooKeeper (kazoo imported only here)."""
    assert record.zk is not None
    if record.local:
        from hpc_elastic.rendezvous import local_store  # noqa: PLC0415

        return local_store.describe_job(record.zk, record.run_id)
    from hpc_elastic.rendezvous import zookeeper  # noqa: PLC0415 (kazoo: only when live)

    logging.getLogger("kazoo").addHandler(logging.NullHandler())  # its retries are not news
    from hpc_elastic.rendezvous.secret import read_secret_file  # noqa: PLC0415

    secret = read_secret_file(record.secret_file) if record.secret_file.exists() else None
    return zookeeper.describe_job(record.zk, record.run_id, secret)


def _state(outcome: str, live: bool, slurm: list[JobStatus], history: list[Event]) -> str:
    if outcome != "running":
        return outcome
    if slurm and all(status.state == "PENDING" for status in slurm):
        return "pending"
    if live:
        return "running"
    return "stopped" if history else "unknown"


_AGENT_WORDS = {
    "join": "joining",
    "round": "starting",
    "start": "training",
    "restart": "rejoining",
    "failure": "reporting a failure",
    "leave": "left",
    "preempt": "preempted",
    "done": "done",
    "failed": "failed",
}


WAITING = frozenset({"join", "restart"})
"""Last events of an agent waiting for a round; once the job has finished, it has exited."""


def _slots(history: list[Event], slurm: list[JobStatus], *, finished: bool) -> list[Slot]:
    last: dict[str, Event] = {}
    for event in history:
        if event.slot and "node_id" in event.details:
            last[event.slot] = event
        elif event.kind == "churn" and event.details.get("action") == "kill":
            killed = str(event.details.get("target", ""))
            if killed in last:
                last[killed] = Event(kind="killed (churn)", node=last[killed].node)
    slots: dict[str, Slot] = {}
    for status in slurm:
        name = status.array_task or status.job_id
        if status.array_task and not status.array_task.isdigit():
            name = f"[{status.array_task}]"
        slots[name] = Slot(name, status.state, status.nodes or status.reason)
    for name, event in last.items():
        known = slots.get(name, Slot(name))
        node = known.node if known.node != "-" else event.node
        word = "exited" if finished and event.kind in WAITING else _AGENT_WORDS.get(event.kind)
        slots[name] = Slot(name, known.slurm_state, node, word or event.kind)
    return [slots[name] for name in sorted(slots, key=lambda s: (len(s), s))]


def render(view: JobView) -> None:
    """A rich summary and slot table on stdout."""
    from rich import box  # noqa: PLC0415 (rich: only for the human view)
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(highlight=False)
    where = "local run" if view.mode == "local" else f"Slurm job {view.job_id or '?'}"
    console.print(
        f"[bold]{view.run_id}[/bold] ({where}, nodes {view.nodes}, "
        f"{view.nproc_per_node} per node): [bold]{view.state.upper()}[/bold]"
    )
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="dim")
    facts.add_column()
    members = ", ".join(view.members)
    if view.round is not None:
        facts.add_row("Round", f"{view.round}, world size {view.world_size} ({members})")
    else:
        facts.add_row("Round", "none yet")
    facts.add_row(
        "Restarts",
        f"{view.restarts_used}/{view.max_restarts} of the failure budget used; "
        f"{_count(view.restarts, 'group restart')} in all, node changes included",
    )
    facts.add_row(
        "Preemptions",
        f"{_count(view.preemptions, 'preemption')}, {_count(view.requeues, 'requeue')}",
    )
    if view.last_checkpoint_step is not None and view.last_checkpoint_time is not None:
        age = time.time() - view.last_checkpoint_time
        facts.add_row(
            "Checkpoint",
            f"step {view.last_checkpoint_step}, written {timeline.clock(view.last_checkpoint_time)}"
            f" ({_ago(age)} ago)",
        )
    else:
        facts.add_row("Checkpoint", "none yet")
    facts.add_row("Last failure", view.last_failure or "none")
    facts.add_row("Directory", view.job_dir)
    console.print(facts)
    if view.slots:
        table = Table(box=box.SIMPLE_HEAD)
        for column in ("Slot", "Slurm state", "Node", "Agent"):
            table.add_column(column)
        for slot in view.slots:
            table.add_row(slot.slot, slot.slurm_state, slot.node, slot.agent)
        console.print(table)


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
