"""Slurm's side of an elastic job's slots (array tasks): who is coming, who leaves and why.

An elastic job is one array of MAX one-node tasks (docs/design.md). This module answers, for
the agent of one task: how many slots run or are about to (so a round need not wait for
slots Slurm cannot start now), why this slot was asked to stop (preemption, time limit or by
hand), whether to requeue it and away from which nodes, and which pending slots to cancel
once the job is over. The per-slot counts live in ``<job dir>/slots/<slot>.json``; only one
incarnation of a slot runs at a time, so the file has a single writer.
"""

from __future__ import annotations

import enum
import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hpc_elastic.errors import SlurmError
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.slurm.env import SlurmContext
from hpc_elastic.train.exitcodes import PREEMPTED_EXIT_CODE

SQUEUE_INTERVAL = 2.0
"""Seconds between two squeue calls of one agent: the rendezvous asks on every change."""
_STARTING = frozenset({"RUNNING", "CONFIGURING"})
_NOT_STARTED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD"})
"""Task states the end of the job cancels; REQUEUE_HOLD is a task Slurm requeued too often."""
_TIME_LIMIT_MARGIN = 60.0
"""Slurm may send ``--signal=SIG@N`` up to about 30 s before N (field notes); allow double."""


class Departure(enum.Enum):
    """Why a slot's agent got the warning signal."""

    PREEMPTION = "preemption"
    TIME_LIMIT = "time_limit"
    BAD_NODE = "bad_node"
    BY_HAND = "by_hand"
    CANCELLED = "cancelled"
    """scancel, or Slurm no longer runs the job: nothing to requeue."""


@dataclass(frozen=True)
class SlotLimits:
    """How often one slot may be requeued for each cause before it gives up."""

    max_preemptions: int = 100
    max_time_limits: int = 10
    exclude_after: int = 2
    """Failures of this slot on one node after which the node is excluded for the slot."""


# --- pure parts ----------------------------------------------------------------------------


def task_indices(text: str) -> list[int]:
    """Array task ids from squeue's %K: ``3``, ``0-3``, ``1,3-5`` or ``0-3%2`` (a throttle)."""
    indices: list[int] = []
    for part in text.split("%", maxsplit=1)[0].split(","):
        low, _, high = part.partition("-")
        if not low.strip().isdigit() or (high and not high.strip().isdigit()):
            raise SlurmError(
                f"squeue printed the array tasks '{text}', which are not ids like '0-3,5'; "
                "check that `squeue` is Slurm's and not a wrapper."
            )
        indices.extend(range(int(low), int(high or low) + 1))
    return indices


def coming_slots(statuses: Sequence[JobStatus]) -> int:
    """Slots that run or will start at once; those waiting for resources, priority or a
    requeue delay (``BeginTime``) are not counted, so a round does not wait for them."""
    count = 0
    for status in statuses:
        if status.array_task is None:
            continue
        soon = status.state in _STARTING or (status.state == "PENDING" and status.reason == "None")
        if soon:
            count += len(task_indices(status.array_task))
    return count


def pending_tasks(statuses: Sequence[JobStatus]) -> list[int]:
    return sorted(
        index
        for status in statuses
        if status.state in _NOT_STARTED and status.array_task is not None
        for index in task_indices(status.array_task)
    )


def parse_duration(text: str) -> float | None:
    """Slurm's ``[D-]HH:MM:SS``, ``MM:SS`` or ``UNLIMITED`` in seconds (None: no limit)."""
    if text in ("UNLIMITED", "INFINITE", "Partition_Limit", "NONE"):
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if match is None:
        raise SlurmError(
            f"scontrol printed the duration '{text}', which is not [D-]HH:MM:SS; "
            "check that `scontrol` is Slurm's and not a wrapper."
        )
    days, hours, minutes, seconds = (int(group or 0) for group in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


_DEPARTURE_FIELDS = ("JobState", "PreemptTime", "RunTime", "TimeLimit")
"""What ``departure`` reads; kept in the requeue event so a surprising cause can be checked."""


def departure(job: Mapping[str, str], warning_s: float) -> Departure:
    """Tell preemption from time limit from a signal sent by hand, from ``scontrol show job``.

    Slurm sets ``PreemptTime`` when it starts preempting a job; the time limit is near when
    what is left of ``TimeLimit`` is within the ``--signal`` warning.
    """
    if job.get("JobState") != "RUNNING":
        return Departure.CANCELLED
    if job.get("PreemptTime", "None") not in ("None", "Unknown", ""):
        return Departure.PREEMPTION
    limit = parse_duration(job.get("TimeLimit", "UNLIMITED"))
    elapsed = parse_duration(job.get("RunTime", "00:00"))
    left = None if limit is None or elapsed is None else limit - elapsed
    if left is not None and left <= warning_s + _TIME_LIMIT_MARGIN:
        return Departure.TIME_LIMIT
    return Departure.BY_HAND


@dataclass(frozen=True)
class SlotLedger:
    """What one slot has been through, across its incarnations."""

    preemptions: int = 0
    time_limits: int = 0
    node_failures: dict[str, int] = field(default_factory=dict)
    excluded: tuple[str, ...] = ()
    running_on: str | None = None
    """Set while an incarnation runs; still set at the next start means it died uncleanly."""

    def failed_on(self, node: str) -> SlotLedger:
        failures = {**self.node_failures, node: self.node_failures.get(node, 0) + 1}
        return replace(self, node_failures=failures)

    def is_bad(self, node: str, limits: SlotLimits) -> bool:
        return self.node_failures.get(node, 0) >= limits.exclude_after

    def exclude(self, node: str) -> SlotLedger:
        return replace(self, excluded=tuple(sorted({*self.excluded, node})))

    def requeued(self, why: Departure) -> SlotLedger:
        if why is Departure.TIME_LIMIT:
            return replace(self, time_limits=self.time_limits + 1)
        if why in (Departure.PREEMPTION, Departure.BY_HAND):
            return replace(self, preemptions=self.preemptions + 1)
        return self

    def over_limit(self, limits: SlotLimits) -> str | None:
        """The sentence that says which requeue budget is spent, or None."""
        if self.preemptions > limits.max_preemptions:
            return (
                f"it was preempted {self.preemptions} times "
                f"(--max-preemptions {limits.max_preemptions})"
            )
        if self.time_limits > limits.max_time_limits:
            return (
                f"it hit the time limit {self.time_limits} times "
                f"(--max-time-limits {limits.max_time_limits})"
            )
        return None


def load_ledger(path: Path) -> SlotLedger:
    try:
        raw = json.loads(path.read_text())
        return SlotLedger(
            preemptions=int(raw.get("preemptions", 0)),
            time_limits=int(raw.get("time_limits", 0)),
            node_failures={str(k): int(v) for k, v in raw.get("node_failures", {}).items()},
            excluded=tuple(str(node) for node in raw.get("excluded", ())),
            running_on=raw.get("running_on"),
        )
    except FileNotFoundError:
        return SlotLedger()
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise SlurmError(
            f"'{path}' is not a readable slot record; delete it to start the slot's counts afresh."
        ) from error


def save_ledger(path: Path, ledger: SlotLedger) -> None:
    """Write to a temporary file and rename, so a killed agent never leaves half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(asdict(ledger), sort_keys=True))
    scratch.replace(path)


# --- talking to Slurm ------------------------------------------------------------------------


class ComingSlots:
    """The rendezvous' ``expected_nodes``: slots of this array that run or start at once.

    Rate-limited (one squeue per ``interval``); when squeue fails it answers None, and the
    rendezvous falls back to waiting the last call.
    """

    def __init__(
        self,
        array_job_id: str,
        squeue: Callable[[Sequence[str]], list[JobStatus]] = commands.squeue,
        interval: float = SQUEUE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._array_job_id = array_job_id
        self._squeue = squeue
        self._interval = interval
        self._clock = clock
        self._asked_at: float | None = None
        self._answer: int | None = None

    def __call__(self) -> int | None:
        now = self._clock()
        if self._asked_at is None or now - self._asked_at >= self._interval:
            self._asked_at = now
            try:
                self._answer = coming_slots(self._squeue([self._array_job_id])) or None
            except SlurmError:
                self._answer = None
        return self._answer


def cancel_pending(
    array_job_id: str, env: Mapping[str, str] | None = None, *, keep: int | None = None
) -> list[int]:
    """Cancel the array's pending tasks (all but ``keep``): the job is over, none may start."""
    pending = [i for i in pending_tasks(commands.squeue([array_job_id], env)) if i != keep]
    if pending:
        commands.cancel(f"{array_job_id}_[{','.join(map(str, pending))}]", env=env)
    return pending


def requeue(job_id: str, exclude: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
    """Requeue a running task, away from ``exclude``.

    Right after ``scontrol requeue`` the task is PENDING (still completing), so its
    ``ExcNodeList`` can be set by the very agent that is about to exit (checked on 22.05).
    """
    commands.requeue(job_id, env)
    if exclude:
        commands.update_job(job_id, env, ExcNodeList=",".join(exclude))


@dataclass
class ElasticSlot:
    """One array task's dealings with Slurm, for the agent that runs in it."""

    context: SlurmContext
    job_dir: Path
    limits: SlotLimits = SlotLimits()
    env: Mapping[str, str] | None = None
    _ledger: SlotLedger = field(init=False)

    def __post_init__(self) -> None:
        self._ledger = load_ledger(self.ledger_path)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], job_dir: Path, limits: SlotLimits
    ) -> ElasticSlot | None:
        """None unless this process runs in a task of a job array (an elastic job)."""
        context = SlurmContext.from_env(environ)
        if context is None or context.array_job_id is None or context.array_task_id is None:
            return None
        return cls(context, job_dir, limits)

    @property
    def ledger_path(self) -> Path:
        return self.job_dir / "slots" / f"{self.context.array_task_id}.json"

    @property
    def job_id(self) -> str:
        return f"{self.context.array_job_id}_{self.context.array_task_id}"

    @property
    def node(self) -> str:
        return self.context.node_name

    @property
    def ledger(self) -> SlotLedger:
        return self._ledger

    def arrive(self) -> str | None:
        """Record the start on this node; a previous incarnation that never said goodbye
        died with its node, which counts as a failure there. Returns that node, if any."""
        crashed_on = self._ledger.running_on
        ledger = self._ledger.failed_on(crashed_on) if crashed_on else self._ledger
        self._save(replace(ledger, running_on=self.node))
        return crashed_on

    def count_failure(self) -> bool:
        """A worker of this slot failed on this node; True once the node is bad for the slot."""
        self._save(self._ledger.failed_on(self.node))
        return self._ledger.is_bad(self.node, self.limits)

    def placed_badly(self) -> bool:
        return self._ledger.is_bad(self.node, self.limits) or self.node in self._ledger.excluded

    def expected_nodes(self) -> ComingSlots:
        assert self.context.array_job_id is not None
        return ComingSlots(self.context.array_job_id, lambda ids: commands.squeue(ids, self.env))

    def why_stopping(self, warning_s: float) -> tuple[Departure, dict[str, str]]:
        """Workers stopped to be requeued (exit 75): why, and the Slurm fields that said so.
        A Slurm that cannot say is treated as a cancel, since it could not requeue us either."""
        try:
            record = commands.scontrol_show_job(self.job_id, self.env)
        except SlurmError:
            return Departure.CANCELLED, {}
        evidence = {key: record.get(key, "") for key in _DEPARTURE_FIELDS}
        why = departure(record, warning_s)
        if why is not Departure.CANCELLED and self.placed_badly():
            return Departure.BAD_NODE, evidence
        return why, evidence

    def requeue(self, why: Departure) -> str | None:
        """Requeue this task (away from its bad nodes); returns why it may not, if so."""
        ledger = self._ledger.requeued(why)
        if why is Departure.BAD_NODE:
            ledger = ledger.exclude(self.node)
        refused = ledger.over_limit(self.limits)
        self._save(replace(ledger, running_on=None))
        if refused is not None:
            return refused
        try:
            requeue(self.job_id, ledger.excluded, self.env)
        except SlurmError as error:
            return str(error)
        return None

    def leave(self) -> None:
        """A clean exit: the next incarnation must not count this one as a crash."""
        self._save(replace(self._ledger, running_on=None))

    def settle(self, exit_code: int, warning_s: float, emit: Callable[..., None]) -> int:
        """After the agent: requeue a slot that stopped to be moved, or, once the job is over
        (0: done, 1: failed), cancel the array's pending tasks. Returns the slot's exit code."""
        why, evidence = (
            self.why_stopping(warning_s) if exit_code == PREEMPTED_EXIT_CODE else (None, {})
        )
        if why is not None and why is not Departure.CANCELLED:
            if why is Departure.BAD_NODE:
                emit("exclude", node=self.node, failures=self._ledger.node_failures.get(self.node))
            refused = self.requeue(why)
            if refused is None:
                emit(
                    "requeue",
                    cause=why.value,
                    slurm=evidence,
                    slurm_job=self.job_id,
                    excluded=list(self._ledger.excluded),
                )
                return exit_code
            emit("leave", reason=f"slot {self.context.array_task_id} is not requeued: {refused}")
            return 1
        self.leave()
        if exit_code in (0, 1):
            try:
                cancelled = self.cancel_pending()
            except SlurmError:
                cancelled = []  # Another slot's agent got there first: they are gone.
            if cancelled:
                emit("cancel_pending", tasks=cancelled)
        return exit_code

    def cancel_pending(self) -> list[int]:
        """The job is over (done or failed): no pending task of the array may start."""
        assert self.context.array_job_id is not None
        return cancel_pending(self.context.array_job_id, self.env, keep=self.context.array_task_id)

    def _save(self, ledger: SlotLedger) -> None:
        self._ledger = ledger
        save_ledger(self.ledger_path, ledger)
