"""``hpc-elastic status``: the job's events, its live rendezvous and Slurm's view, in one place."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hpc_elastic.errors import HpcElasticError, one_line
from hpc_elastic.events import NAMES_SHOWN, ChurnDetails, Event, Kind, LoadedDetails, UnknownKind
from hpc_elastic.jobdir import CodeSnapshot
from hpc_elastic.ops import goodput as lost_time
from hpc_elastic.ops import timeline
from hpc_elastic.ops.jobs import JobRecord, runner_alive
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.slurm.queue import every_task_held

SlurmQuery = Callable[[Sequence[str]], list[JobStatus]]
"""What ``squeue`` answers for some job ids: ``commands.squeue`` unless a caller gives its own."""


@dataclass(frozen=True)
class Slot:
    """One node slot: Slurm's word on it (array task) and what its agent last said."""

    slot: str
    slurm_state: str = "-"
    node: str = "-"
    agent: str = "-"
    """The agent's last event kind: join, round, start, restart, leave, preempt, ..."""
    partition: str = "-"
    qos: str = "-"
    """Where the slot's array task was submitted (``JobRecord.placement``): the slots above
    MIN of a job that grows elsewhere run on ``--grow-partition``/``--grow-qos``; ``-`` is
    Slurm's default."""


@dataclass(frozen=True)
class JobView:
    run_id: str
    job_id: str | None
    job_dir: str
    mode: str
    nodes: str
    nproc_per_node: int
    state: str
    """pending, running, held, succeeded, failed, stopped or unknown."""
    round: int | None
    world_size: int | None
    members: list[str]
    """Every member's slot from the live rendezvous; from the events, the first ones."""
    member_count: int
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
    restores: list[str] = field(default_factory=list)
    """Which checkpoint tier each restart loaded from (``restore_tiers``), oldest first."""
    code: CodeSnapshot | None = None
    """The code snapshot the job runs (commit, dirty); None without one."""
    goodput: lost_time.Goodput = field(default_factory=lost_time.Goodput)
    """Productive time over wall time and the time lost by cause, from the events."""
    grow_job_id: str | None = None
    """The growth slots' array job (``--grow-partition``/``--grow-qos``), if any."""
    backfill_node_hours: float | None = None
    """Node-hours the growth slots ran in backfill holes (``--grow-time-min``); None for a job
    without them."""
    saves: str | None = None
    """The agents' warning that a checkpoint save no longer fits what Slurm leaves after its
    signal (the ``grace`` event, slurm/grace.py), with the figures and the advice; None: none."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["code"] = None if self.code is None else self.code.to_json()
        data["goodput"] = self.goodput.as_dict()
        return data


def gather(record: JobRecord, squeue: SlurmQuery = commands.squeue) -> JobView:
    """Combine the events with Slurm's queue and the live rendezvous; never raises for them.
    Slurm is asked first, the events read after (``job_states`` says why)."""
    warnings: list[str] = []
    slurm: list[JobStatus] = []
    if record.job_id is not None:
        try:
            slurm = squeue(list(record.job_ids))
        except HpcElasticError as error:
            warnings.append(str(error))
    history = record.events()
    summary = timeline.summarize(history)
    live = _live(record, summary, slurm)
    overall = job_state(record, summary, slurm)
    round_number, world, members = summary.round, summary.world_size, list(summary.members)
    member_count = summary.member_count
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
                member_count = len(members)
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
        state=overall,
        round=round_number,
        world_size=world,
        members=members,
        member_count=member_count,
        restarts_used=restarts_used,
        max_restarts=record.max_restarts,
        restarts=summary.restarts,
        preemptions=summary.preemptions,
        requeues=summary.requeues,
        last_checkpoint_step=summary.last_checkpoint_step,
        last_checkpoint_time=summary.last_checkpoint_time,
        last_failure=failure,
        slots=_placed(record, _slots(history, slurm, finished=summary.outcome != "running")),
        warnings=warnings,
        restores=restore_tiers(history),
        code=record.snapshot,
        grow_job_id=record.grow_job_id,
        saves=save_warning(history),
        backfill_node_hours=backfilled(
            record, history, time.time() if overall == "running" else None
        ),
        # Only a job still at work counts its wall time up to now; a stopped one ended at its
        # last event, however long ago that was.
        goodput=lost_time.goodput(history, now=time.time() if overall == "running" else None),
    )


_ARRIVES = frozenset({Kind.JOIN})
_DEPARTS = frozenset({Kind.REQUEUE, Kind.LEAVE, Kind.DONE, Kind.FAILED, Kind.CANCELLED, Kind.ERROR})


def node_hours(history: list[Event], slots: set[str], now: float | None) -> float:
    """Node-hours the agents of ``slots`` spent in the job: from each agent's arrival
    (``join``) to its departure (its ``requeue``, ``leave``, ``done``, ...), or to ``now`` (to
    the job's last event when ``now`` is None) for one still there."""
    since: dict[str, float] = {}
    total = 0.0
    for event in history:
        if event.slot not in slots:
            continue
        if event.kind in _ARRIVES and event.slot not in since:
            since[event.slot] = event.time
        elif event.kind in _DEPARTS and event.slot in since:
            total += event.time - since.pop(event.slot)
    end = now if now is not None else max((event.time for event in history), default=0.0)
    total += sum(max(0.0, end - start) for start in since.values())
    return total / 3600.0


def backfilled(record: JobRecord, history: list[Event], now: float | None) -> float | None:
    """The node-hours the job gained from its backfill slots (``--grow-time-min``)."""
    if record.grow_time_min is None:
        return None
    slots = {event.slot for event in history if event.slot.isdigit()}
    return node_hours(history, {s for s in slots if record.growth_slot(int(s))}, now)


def save_warning(history: list[Event]) -> str | None:
    """The first ``grace`` warning of the job (one per job), with its advice and, when the
    agents moved their time-limit signal or sent a stop's save to the local tier, what they
    did."""
    warnings = [event for event in history if event.kind == Kind.GRACE]
    first = next((event for event in warnings if "advice" in event.details), None)
    if first is None:
        return None
    message, advice = first.details.get("message"), first.details.get("advice")
    text = f"{message} (said {timeline.clock(first.time)})"
    if isinstance(advice, str) and advice:
        text += f"; {advice}"
    if first.details.get("action") == "lead":
        text += "; the slots stop early enough before their time limit (--grace-action lead)"
    if first.details.get("action") == "local":
        text += (
            "; a stop's save goes to the node-local tier only, and to the shared tier at the "
            "next start (--grace-action local)"
        )
    return text


def restore_tiers(history: list[Event]) -> list[str]:
    """Where each restart read its checkpoint, oldest first, from the ``checkpoint_loaded``
    events (owned by train: one from rank 0 when every rank read one tier, else one per rank):
    ``round 3: step 30 from local``, or ``round 4: step 40 from local (3 ranks), peer (1 rank)``.
    """
    restores: dict[tuple[str, int | None, int | None], dict[str, int]] = {}
    for event in history:
        if event.kind != Kind.CHECKPOINT_LOADED:
            continue
        loaded = LoadedDetails.from_details(event.details)
        tiers = restores.setdefault((event.job, event.round, loaded.step), {})
        tiers[loaded.tier or "unknown"] = tiers.get(loaded.tier or "unknown", 0) + 1
    lines = []
    for (_, round_number, step), tiers in restores.items():
        where = f"round {round_number}" if round_number is not None else "a restart"
        if len(tiers) == 1:
            source = next(iter(tiers))
        else:
            ranked = sorted(tiers.items(), key=lambda item: (-item[1], item[0]))
            source = ", ".join(f"{tier} ({_count(count, 'rank')})" for tier, count in ranked)
        lines.append(f"{where}: step {step} from {source}")
    return lines


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


def job_state(record: JobRecord, summary: timeline.Summary, slurm: list[JobStatus]) -> str:
    """pending, running, held, succeeded, failed, stopped or unknown: the one rule that
    ``list``, ``status`` and the Python API share, so they never disagree about a job.
    ``slurm`` is Slurm's queue lines of this job (``of_job``); a job the agents say is running
    but that Slurm no longer lists (cancelled, killed) and whose local runner is gone is
    stopped; one whose every task Slurm holds (by its reason, ``queue.held_reason``) is
    held: it waits for an ``scontrol release``."""
    if summary.outcome != "running":
        return summary.outcome
    if every_task_held(slurm):
        return "held"
    if slurm and all(status.state == "PENDING" for status in slurm):
        return "pending"
    if _live(record, summary, slurm):
        return "running"
    return "stopped" if summary.first_time is not None else "unknown"


def _live(record: JobRecord, summary: timeline.Summary, slurm: list[JobStatus]) -> bool:
    return summary.outcome == "running" and (bool(slurm) or runner_alive(record))


def of_job(record: JobRecord, queue: Sequence[JobStatus]) -> list[JobStatus]:
    """The lines of one ``squeue`` answer that belong to ``record``'s Slurm job."""
    return [status for status in queue if str(status.job_id) in record.job_ids]


def job_states(
    records: Sequence[JobRecord], squeue: SlurmQuery = commands.squeue
) -> tuple[list[timeline.Summary], list[str], list[str]]:
    """What each job's events say and its ``job_state``, asking Slurm once for all of them,
    and the warnings.

    Slurm is asked first and the events read after: a job's agents write their last event
    (``done``, ``failed``) before they exit and Slurm lets the job go. Read the other way
    round, a job that ended between the two reads was taken for stopped (its events still
    running, Slurm no longer listing it), and ``wait()`` returned that for a job that had
    succeeded."""
    ids = [job_id for record in records for job_id in record.job_ids]
    queue: list[JobStatus] = []
    warnings: list[str] = []
    if ids:
        try:
            queue = squeue(ids)
        except HpcElasticError as error:
            warnings.append(str(error))
    summaries = [timeline.summarize(record.events()) for record in records]
    states = [
        job_state(record, summary, of_job(record, queue))
        for record, summary in zip(records, summaries, strict=True)
    ]
    return summaries, states, warnings


_AGENT_WORDS: dict[str, str] = {
    Kind.JOIN: "joining",
    Kind.ROUND: "starting",
    Kind.START: "training",
    Kind.RESTART: "rejoining",
    Kind.FAILURE: "reporting a failure",
    Kind.HANG: "looked into a hang",
    Kind.LEAVE: "left",
    Kind.PREEMPT: "preempted",
    Kind.SPARE: "hot spare",
    Kind.DONE: "done",
    Kind.FAILED: "failed",
}


WAITING = frozenset({Kind.JOIN, Kind.RESTART, Kind.SPARE})
"""Last events of an agent waiting for a round; once the job has finished, it has exited."""


def _slots(history: list[Event], slurm: list[JobStatus], *, finished: bool) -> list[Slot]:
    last: dict[str, Event] = {}
    for event in history:
        if event.slot and "node_id" in event.details:
            last[event.slot] = event
        elif event.kind == Kind.CHURN:
            churn = ChurnDetails.from_details(event.details)
            if churn.action == "kill" and churn.target in last:
                shown = UnknownKind("killed (churn)")  # a word for the table, not a kind written
                last[churn.target] = Event(kind=shown, node=last[churn.target].node)
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


_TASK = re.compile(r"^\[?(\d+)")
"""An array slot's (first) task: ``3``, or ``[2-3]`` for tasks that pend together."""


def _placed(record: JobRecord, slots: list[Slot]) -> list[Slot]:
    """Each array slot with the partition and QoS its task was submitted with."""
    placed = []
    for slot in slots:
        task = _TASK.match(slot.slot)
        if task is None or record.local:
            placed.append(slot)
            continue
        partition, qos = record.placement(int(task.group(1)))
        placed.append(replace(slot, partition=partition or "-", qos=qos or "-"))
    return placed


def placed_apart(slots: Sequence[Slot]) -> bool:
    """Whether the slots run in more than one place (a job that grows elsewhere): then the
    slot table says where each one runs."""
    return len({(slot.partition, slot.qos) for slot in slots if _TASK.match(slot.slot)}) > 1


def render(view: JobView) -> None:
    """A rich summary and slot table on stdout.

    Every value from the job's files goes through ``_shown``: a slot name or failure message
    holding ``[/bold]`` would otherwise be read as rich markup, and escape codes would reach
    the terminal.
    """
    from rich import box  # noqa: PLC0415 (rich: only for the human view)
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(highlight=False)
    where = "local run" if view.mode == "local" else f"Slurm job {_shown(view.job_id or '?')}"
    if view.grow_job_id is not None:
        where = f"Slurm jobs {_shown(view.job_id or '?')} and {_shown(view.grow_job_id)}"
    console.print(
        f"[bold]{_shown(view.run_id)}[/bold] ({where}, nodes {_shown(view.nodes)}, "
        f"{view.nproc_per_node} per node): [bold]{_shown(view.state.upper())}[/bold]"
    )
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="dim")
    facts.add_column()
    members = timeline.listed(view.members, view.member_count)
    if view.round is not None:
        facts.add_row("Round", _shown(f"{view.round}, world size {view.world_size} ({members})"))
    else:
        facts.add_row("Round", "none yet")
    facts.add_row(
        "Restarts",
        _shown(
            f"{view.restarts_used}/{view.max_restarts} of the failure budget used; "
            f"{_count(view.restarts, 'group restart')} in all, node changes included"
        ),
    )
    facts.add_row(
        "Preemptions",
        f"{_count(view.preemptions, 'preemption')}, {_count(view.requeues, 'requeue')}",
    )
    if view.last_checkpoint_step is not None and view.last_checkpoint_time is not None:
        age = time.time() - view.last_checkpoint_time
        facts.add_row(
            "Checkpoint",
            _shown(
                f"step {view.last_checkpoint_step}, written "
                f"{timeline.clock(view.last_checkpoint_time)} ({_ago(age)} ago)"
            ),
        )
    else:
        facts.add_row("Checkpoint", "none yet")
    shown = "; ".join(view.restores[-3:]) or "no restore yet"
    if len(view.restores) > 3:
        shown += f" (the last 3 of {len(view.restores)})"
    facts.add_row("Restored", _shown(shown))
    facts.add_row("Last failure", _shown(view.last_failure or "none"))
    facts.add_row("Goodput", _shown(lost_time.breakdown(view.goodput)))
    if view.saves is not None:
        facts.add_row("Saves", _shown(view.saves))
    if view.backfill_node_hours is not None:
        gained = f"{view.backfill_node_hours:.2f} node-hours gained by the slots above MIN"
        facts.add_row("Backfill", _shown(f"{gained} in holes backfill found for them"))
    facts.add_row("Code", _shown(describe_code(view.code)))
    facts.add_row("Directory", _shown(view.job_dir))
    console.print(facts)
    if view.slots:
        apart = placed_apart(view.slots)
        table = Table(box=box.SIMPLE_HEAD)
        for column in ("Slot", "Slurm state", "Node", "Agent"):
            table.add_column(column)
        if apart:
            table.add_column("Partition")
            table.add_column("QoS")
        for slot in slot_rows(view.slots):
            cells = [slot.slot, slot.slurm_state, slot.node, slot.agent]
            cells += [slot.partition, slot.qos] if apart else []
            table.add_row(*(_shown(cell) for cell in cells))
        console.print(table)


def slot_rows(slots: Sequence[Slot]) -> list[Slot]:
    """The rows of the slot table: one a slot, or past ``NAMES_SHOWN`` slots, one for each
    run of slots in the same states and placement (``0-4094  RUNNING  4095 nodes  start``):
    a job of 4,096 slots is a few rows, and the slot in trouble stands out."""
    if len(slots) <= NAMES_SHOWN:
        return list(slots)
    rows: list[list[Slot]] = []
    for slot in slots:
        alike = rows and _same_row(rows[-1][-1], slot)
        if alike:
            rows[-1].append(slot)
        else:
            rows.append([slot])
    return [_row(run) for run in rows]


def _same_row(last: Slot, slot: Slot) -> bool:
    states = (last.slurm_state, last.agent, last.partition, last.qos)
    before, number = timeline.slot_number(last.slot), timeline.slot_number(slot.slot)
    follows = before is not None and number == before + 1
    return follows and states == (slot.slurm_state, slot.agent, slot.partition, slot.qos)


def _row(run: list[Slot]) -> Slot:
    first, last = run[0], run[-1]
    if len(run) == 1:
        return first
    nodes = {slot.node for slot in run}
    node = first.node if len(nodes) == 1 else f"{len(nodes)} nodes"
    return replace(first, slot=f"{first.slot}-{last.slot}", node=node)


def describe_code(code: CodeSnapshot | None) -> str:
    """One line on the code snapshot: which commit, whether it held uncommitted changes."""
    if code is None:
        return "not snapshotted: each slot runs the script as it is on disk when it starts"
    where = f"copied from {code.source}"
    if not code.git:
        return f"{where} (not a git work tree), {_count(code.files, 'file')}"
    return f"{code.version()}, {where}"


def _shown(value: object) -> str:
    """``value`` as plain text for rich: unprintables escaped, markup brackets escaped."""
    from rich.markup import escape  # noqa: PLC0415

    return escape(one_line(str(value)))


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
