"""Slurm's side of an elastic job's slots (array tasks): who is coming, who leaves and why.

An elastic job is one array of MAX one-node tasks (docs/design.md). This module answers, for
the agent of one task: how many slots run or are about to (so a round need not wait for
slots Slurm cannot start now), why this slot was asked to stop (preemption, time limit or by
hand), whether to requeue it and away from which nodes, and which pending slots to cancel
once the job is over. The per-slot counts live in ``<job dir>/slots/<slot>.json``; only one
incarnation of a slot runs at a time, so the file has a single writer. What squeue's listing
says (which tasks run, start, pend or are held, and the cached slot count) is read in
``slurm/queue.py``, which the operator's commands share; the actions on it are here.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import cast

from hpc_elastic import contract, events
from hpc_elastic.contract import PREEMPTED_EXIT_CODE
from hpc_elastic.decoding import (
    Check,
    mapping_of,
    one_of,
    optional,
    record,
    text,
    tuple_of,
    whole,
)
from hpc_elastic.errors import HpcElasticError, SlurmError
from hpc_elastic.events import CheckpointDetails, Event, Kind
from hpc_elastic.jobdir import JobDir, JobRecord, write_private
from hpc_elastic.slurm import commands, drain, grace
from hpc_elastic.slurm.commands import JobStatus, NodeDrain
from hpc_elastic.slurm.env import SlurmContext
from hpc_elastic.slurm.queue import (
    CHURN_HOLD,
    ENDED,
    LIVE,
    ComingSlots,
    churn_held_tasks,
    held_reasons,
    poll,
    reports_held,
    running_tasks,
    task_arrays,
    task_indices,
)

log = logging.getLogger(__name__)

SQUEUE_TIMEOUT = 10.0
"""Seconds one background squeue may take; the rendezvous does without the count meanwhile."""
SCONTROL_TIMEOUT = 10.0
"""Seconds the agent waits for ``scontrol show job`` when it asks why it is being stopped."""
SCONTROL_TRIES = 3
SCONTROL_PAUSE = 0.5
"""Tries of that ``scontrol``, and seconds between two (well inside any GraceTime)."""
END_MARGIN_S = 60.0
"""Seconds a sibling's agent is given, beyond its workers' ``--grace``, to finish its own
clean exit once the job is over, before the end of the job cancels its task: on a busy
machine an agent's way out (the exit barrier's last read, its workers' drain, its events and
ledger) can take tens of seconds, and a task cancelled meanwhile ends CANCELLED instead of
COMPLETED, or loses the save its workers were making."""
END_POLL_S = 2.0
"""Seconds between two looks (squeue and the siblings' ledgers) while the end of the job
waits for siblings that may still be on their way out."""
HELD_POLL_S = 30.0
"""Seconds between two looks for held siblings when nothing else makes the agent ask squeue:
a hold happens after the slot has left, when the rendezvous may see no change for hours."""
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
    DRAIN = "drain"
    """Slurm drains the node (slurm/drain.py): the slot left it at a checkpoint. No budget
    counts it: the node's admin decided, and Slurm starts nothing on a drained node."""
    BACKFILL_END = "backfill_end"
    """The time limit of a task submitted with ``--time-min`` (``--grow-time-min``): backfill
    gave it a hole that has ended. It leaves as at any time limit and requeues for the next
    hole; no budget counts it, since that is what such a slot is for."""


@dataclass(frozen=True)
class SlotLimits:
    """How often one slot may be requeued for each cause before it gives up."""

    max_preemptions: int = contract.DEFAULT_MAX_PREEMPTIONS
    max_time_limits: int = contract.DEFAULT_MAX_TIME_LIMITS
    exclude_after: int = contract.DEFAULT_EXCLUDE_AFTER
    """Failures of this slot on one node after which the node is excluded for the slot."""


# --- pure parts ----------------------------------------------------------------------------


class Sibling(enum.Enum):
    """What the end of the job does with one sibling task (``sibling_at_end``)."""

    GONE = "gone"
    """Slurm ended the task or is ending it: nothing to do."""
    WAITING = "waiting"
    """No agent runs in it (pending, requeued, held, configuring, ...): cancelled at once."""
    LOST = "lost"
    """Slurm shows it running, but the rendezvous dropped its agent (its session expired) and
    it wrote nothing since: the task of a crashed node that Slurm has not noticed yet (on
    22.05 that can take until the node's next registration, minutes). Cancelled at once."""
    LEFT = "left"
    """Its agent left cleanly (its ledger says so) or a new agent is starting in it, which
    finds the job over and exits by itself: never cancelled."""
    FINISHING = "finishing"
    """Its agent may still be on its clean way out (saving, its last barrier read, closing the
    job): given its ``--grace`` plus END_MARGIN_S to leave, then cancelled."""


def sibling_at_end(status: JobStatus, ledger: SlotLedger | None, lost: bool) -> Sibling:
    """The end of the job's rule for one sibling task.

    ``ledger``: the slot's ledger (None: unreadable); ``lost``: the job's timeline says the
    rendezvous dropped the slot's agent and heard nothing from it since (``lost_slots``).
    A clean exit clears the ledger's ``running_on`` before it cancels anything, so a sibling
    that did is never cancelled; a ledger that names another node than Slurm's is the last
    incarnation's, and the task Slurm shows is a new one that has not arrived yet.
    """
    if status.state in ENDED:
        return Sibling.GONE
    if status.state not in LIVE:
        return Sibling.WAITING
    if ledger is not None and (
        ledger.running_on is None or (status.nodes and ledger.running_on != status.nodes)
    ):
        return Sibling.LEFT
    return Sibling.LOST if lost else Sibling.FINISHING


def lost_slots(timeline: Iterable[Event]) -> set[str]:
    """Slots whose agent the rendezvous dropped (named by a ``node_lost`` event) and that
    wrote no event since: their agent's session expired, so it is gone, or cut off and fenced,
    with nothing left to save. A slot that came back (a new incarnation, or the same agent
    healed and rejoined) writes events again (its ``round``, ``join``) and is not lost."""
    dropped: dict[str, float] = {}
    heard: dict[str, float] = {}
    for event in timeline:
        if event.slot:
            heard[event.slot] = max(heard.get(event.slot, event.time), event.time)
        nodes = event.details.get("nodes") if event.kind == Kind.NODE_LOST else None
        for slot in nodes if isinstance(nodes, list) else ():
            dropped[str(slot)] = max(dropped.get(str(slot), event.time), event.time)
    return {slot for slot, at in dropped.items() if slot not in heard or heard[slot] < at}


def job_over(exit_code: int, timeline: Iterable[Event]) -> bool:
    """Whether the job is over for good, so that no sibling may start or go on.

    An agent exits 0 only when every member of the final round succeeded or the job was
    closed; it exits 1 when the job failed (then a ``failed`` event is in the timeline,
    written before the exit), but also when it gave up on its own (an ``error`` event: a bug,
    a rendezvous it may not read), and then the job goes on without it: nothing is cancelled.
    """
    if exit_code == 0:
        return True
    return exit_code == 1 and any(event.kind == Kind.FAILED for event in timeline)


@dataclass(frozen=True)
class EndPlan:
    """The end of the job's decision over every sibling, from one squeue answer."""

    cancel: tuple[int, ...]
    """Tasks to cancel now (``WAITING`` and ``LOST``)."""
    lost: tuple[int, ...]
    """Those of ``cancel`` that Slurm showed running (``LOST``)."""
    finishing: tuple[int, ...]
    """Tasks whose agent may still be on its way out (``FINISHING``)."""


def end_plan(
    statuses: Sequence[JobStatus],
    me: int,
    ledger_of: Callable[[int], SlotLedger | None],
    lost: set[str],
) -> EndPlan:
    """Sort every sibling task of the array but ``me`` by ``sibling_at_end``."""
    verdicts = {
        task: sibling_at_end(status, ledger_of(task), str(task) in lost)
        for status in statuses
        if status.array_task is not None
        for task in task_indices(status.array_task)
        if task != me
    }

    def tasks(*kinds: Sibling) -> tuple[int, ...]:
        return tuple(sorted(task for task, verdict in verdicts.items() if verdict in kinds))

    return EndPlan(
        tasks(Sibling.WAITING, Sibling.LOST), tasks(Sibling.LOST), tasks(Sibling.FINISHING)
    )


def will_be_held(restart_count: int, limit: int) -> bool:
    """Whether the requeue this slot is about to ask for gets it held: Slurm holds a batch job
    requeued more than ``MaxBatchRequeue`` times, and this requeue is number restart_count + 1."""
    return restart_count + 1 > limit


@dataclass(frozen=True)
class HoldRecord:
    """How often one slot was released from a ``JobHoldMaxRequeue`` hold, across agents."""

    releases: int = 0
    released_at: int | None = None
    """The job's progress (newest committed checkpoint step) at the last release."""
    ended: int = 0
    """Holds that ended otherwise (someone ran ``scontrol release``): seen gone, not released."""

    @property
    def hold(self) -> int:
        """The number of the slot's current (or next) hold: each ended hold starts a new one,
        so a task released and held again is reported again."""
        return self.releases + self.ended


def may_release(record: HoldRecord, progress: int | None) -> bool:
    """The no-progress breaker for releases: the first hold of a slot is released; a later
    one only if the job committed a newer checkpoint since the last release. A slot that
    crashes in a loop is then held for good (and reported) instead of revived forever."""
    if record.releases == 0:
        return True
    if progress is None:
        return False
    return record.released_at is None or progress > record.released_at


def newest_checkpoint_step(timeline: Iterable[Event]) -> int | None:
    """The job's progress: the step of its newest committed checkpoint (None: none yet)."""
    steps = [
        CheckpointDetails.from_details(event.details).step
        for event in timeline
        if event.kind == Kind.CHECKPOINT
    ]
    known = [step for step in steps if step is not None]
    return max(known) if known else None


HOLD_RECORD_FIELDS: dict[str, Check] = {
    "releases": whole(0),
    "released_at": optional(whole(0)),
    "ended": whole(0),
}
"""``HoldRecord``'s fields (``decoding``): counts, and the checkpoint step of the last release;
a field missing (an older record) takes its default."""
_HOLD_RECORD = record(HoldRecord, HOLD_RECORD_FIELDS, defaults=True)


def decode_hold_record(data: bytes, where: str) -> HoldRecord:
    """The hold record in ``data`` (read from ``where``), each field of its type, or one
    ``SlurmError`` sentence naming the field and its value."""
    try:
        return cast(HoldRecord, _HOLD_RECORD(json.loads(data), ""))
    except (ValueError, RecursionError) as error:  # MalformedError and JSON's errors
        raise SlurmError(
            f"'{where}' is not a hold record hpc-elastic writes ({error}); delete it if this "
            "keeps happening."
        ) from error


def load_hold_record(path: Path) -> HoldRecord:
    """A slot's release record; missing or unreadable reads as never released (at worst one
    more release, which the next hold's breaker then bounds)."""
    try:
        return decode_hold_record(path.read_bytes(), str(path))
    except FileNotFoundError:
        return HoldRecord()
    except (OSError, SlurmError) as error:
        log.warning("%s It starts afresh.", error)
        return HoldRecord()


def claim(path: Path) -> bool:
    """Create ``path`` if nobody has: True for the one process (of any agent, on any node of
    the shared job directory) that created it. O_EXCL makes the check and the creation one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_private(path, "", exclusive=True)
    except FileExistsError:
        return False
    return True


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
"""What ``departure`` reads; kept in the requeue event so a surprising cause can be checked
(and ``TimeMin``, for a task that has one: ``--grow-time-min``)."""


def _evidence(job: Mapping[str, str]) -> dict[str, str]:
    found = {key: job.get(key, "") for key in _DEPARTURE_FIELDS}
    if job.get("TimeMin", "N/A") not in ("N/A", "None", "", "0"):
        found["TimeMin"] = job["TimeMin"]
    return found


_STILL_RUNNING = ("RUNNING", "SIGNALING")
"""Job states of a task that was signalled but not cancelled."""


def departure(job: Mapping[str, str], warning_s: float) -> Departure:
    """Tell preemption from time limit from a signal sent by hand, from ``scontrol show job``.

    Slurm sets ``PreemptTime`` when it starts preempting a job, and may show it ``SIGNALING``
    while the preemption's signal is delivered (seen on 22.05 in the 30-min soak: read as a
    cancel, the slot left for good, since a task that exits by itself before GraceTime is not
    requeued by Slurm). So ``PreemptTime`` is read first. The time limit is near when what is
    left of ``TimeLimit`` is within the ``--signal`` warning.
    """
    if job.get("PreemptTime", "None") not in ("None", "Unknown", ""):
        return Departure.PREEMPTION
    if job.get("JobState") not in _STILL_RUNNING:
        return Departure.CANCELLED
    limit = parse_duration(job.get("TimeLimit", "UNLIMITED"))
    elapsed = parse_duration(job.get("RunTime", "00:00"))
    left = None if limit is None or elapsed is None else limit - elapsed
    if left is not None and left <= warning_s + _TIME_LIMIT_MARGIN:
        backfilled = job.get("TimeMin", "N/A") not in ("N/A", "None", "", "0")
        return Departure.BACKFILL_END if backfilled else Departure.TIME_LIMIT
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
    leaving_for: str | None = None
    """The ``Departure`` value of a stop signal the incarnation was draining for: Slurm
    SIGKILLs a slot that is still saving after GraceTime, which is no fault of its node."""

    def failed_on(self, node: str) -> SlotLedger:
        failures = {**self.node_failures, node: self.node_failures.get(node, 0) + 1}
        return replace(self, node_failures=failures)

    def is_bad(self, node: str, limits: SlotLimits) -> bool:
        return self.node_failures.get(node, 0) >= limits.exclude_after

    def exclude(self, node: str) -> SlotLedger:
        return replace(self, excluded=tuple(sorted({*self.excluded, node})))

    def arrived(self, node: str) -> tuple[SlotLedger, Arrival]:
        """A new incarnation starts on ``node``: judge how the previous one ended.

        One that left cleanly cleared ``running_on``. One still marked running died uncleanly:
        if it was draining for preemption or its time limit, Slurm killed it after GraceTime
        (it counts as that requeue); otherwise it died with its node, a failure there.
        """
        arrival = Arrival(self.running_on, _known_departure(self.leaving_for))
        ledger = self
        if arrival.killed_leaving is not None:
            ledger = ledger.requeued(arrival.killed_leaving)
        elif arrival.crashed_on is not None:
            ledger = ledger.failed_on(arrival.crashed_on)
        return replace(ledger, running_on=node, leaving_for=None), arrival

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


@dataclass(frozen=True)
class Arrival:
    """How the slot's previous incarnation ended, judged when the next one starts."""

    crashed_on: str | None = None
    """The node it still ran on when it died uncleanly (None: it left cleanly, or never ran)."""
    killed_leaving: Departure | None = None
    """Set when it died while draining for this cause: Slurm's SIGKILL after GraceTime."""

    @property
    def node_failure(self) -> str | None:
        """The node to blame: only a death that no stop signal explains."""
        return self.crashed_on if self.killed_leaving is None else None


_KILLED_LEAVING_IS_EXPECTED = frozenset(
    {Departure.PREEMPTION, Departure.TIME_LIMIT, Departure.BACKFILL_END}
)
"""Causes whose stop Slurm itself ends with SIGKILL after GraceTime (or at the time limit)."""


def _known_departure(value: str | None) -> Departure | None:
    known = {why.value: why for why in _KILLED_LEAVING_IS_EXPECTED}
    return known.get(value) if value is not None else None


LEDGER_FIELDS: dict[str, Check] = {
    "preemptions": whole(0),
    "time_limits": whole(0),
    "node_failures": mapping_of(whole(0)),
    "excluded": tuple_of(text(empty=False)),
    "running_on": optional(text()),
    "leaving_for": optional(one_of([why.value for why in Departure])),
}
"""``SlotLedger``'s fields (``decoding``): a node name is text (a list there once made the next
start crash, unhashable, and ``str()`` of it named no node), a count a whole number (never
``true`` or ``2.9``); a field missing (an older ledger) takes its default."""
_LEDGER = record(SlotLedger, LEDGER_FIELDS, defaults=True)


def decode_ledger(data: bytes, where: str) -> SlotLedger:
    """The slot ledger in ``data`` (read from ``where``), each field of its type, or one
    ``SlurmError`` sentence naming the field and its value."""
    try:
        return cast(SlotLedger, _LEDGER(json.loads(data), ""))
    except (ValueError, RecursionError) as error:  # MalformedError and JSON's errors
        raise SlurmError(
            f"'{where}' is not a readable slot record ({error}); "
            "its counts start afresh, delete it if this keeps happening."
        ) from error


def load_ledger(path: Path) -> SlotLedger:
    """The slot's record; a missing file is an empty one, an unreadable one a SlurmError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return SlotLedger()
    except OSError as error:
        raise SlurmError(
            f"'{path}' is not a readable slot record ({error.strerror}); "
            "its counts start afresh, delete it if this keeps happening."
        ) from error
    return decode_ledger(data, str(path))


def save_ledger(path: Path, ledger: SlotLedger) -> None:
    save_json(path, asdict(ledger))


def save_json(path: Path, record: Mapping[str, object]) -> None:
    """Write a temporary file, fsync it, rename it over the record and fsync the directory:
    a killed agent never leaves half a record, and a crashed node never loses the rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with scratch.open("w") as out:
        out.write(json.dumps(record, sort_keys=True))
        out.flush()
        os.fsync(out.fileno())
    os.replace(scratch, path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# --- talking to Slurm ------------------------------------------------------------------------


def cancel_tasks(array_job_id: str, tasks: Sequence[int], env: Mapping[str, str] | None) -> None:
    """One ``scancel`` for ``tasks`` of the array (none: no call)."""
    if tasks:
        commands.cancel(f"{array_job_id}_[{','.join(map(str, tasks))}]", env=env)


def requeue(
    job_id: str,
    exclude: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    restarts: int = 0,
) -> str | None:
    """Requeue a running task, away from ``exclude``; ``restarts`` is its restart count now.

    The requeue ends the task at once: Slurm signals every process of its step, and the
    ``scontrol requeue`` that the agent runs is one of them, so it may die before it can say
    that it worked (seen on 22.05: exit by signal, nothing on stderr, and the task requeued).
    A failed call therefore counts as done when the task's ``Restarts`` has moved on.
    Right after the requeue the task is PENDING (still completing), so its ``ExcNodeList``
    can be set by the very agent that is about to exit (checked on 22.05).
    Returns a warning when the task is requeued but its ``ExcNodeList`` could not be set.
    """
    try:
        commands.requeue(job_id, env)
    except SlurmError:
        if not requeued_since(job_id, restarts, env):
            raise
        log.debug("scontrol requeue %s died, but Slurm requeued the task", job_id)
    if not exclude:
        return None
    try:
        _set_excluded(job_id, exclude, env)
    except SlurmError as error:
        # Requeued all the same: the task comes back, maybe on a bad node, whose checks and
        # failure counts then move it again. Leaving instead would lose the slot for good.
        return f"slot {job_id} is requeued without keeping away from {','.join(exclude)}: {error}"
    return None


def _set_excluded(job_id: str, exclude: Sequence[str], env: Mapping[str, str] | None) -> None:
    """Set a just-requeued task's ``ExcNodeList``. The ``scontrol update`` can die like the
    requeue's own (the completing task's processes are still being signalled: seen in the
    30-min soak as "failed: no error message"), so it is tried again, and a failed try counts
    as done once Slurm shows the list."""
    wanted = ",".join(exclude)
    failed = SlurmError(f"scontrol update was not run for {job_id}.")
    for attempt in range(SCONTROL_TRIES):
        if attempt:
            time.sleep(SCONTROL_PAUSE)
        try:
            commands.update_job(job_id, env, ExcNodeList=wanted)
            return
        except SlurmError as error:
            log.debug(
                "scontrol update %s ExcNodeList=%s, try %d: %s", job_id, wanted, attempt + 1, error
            )
            failed = error
        if _excludes(job_id, exclude, env):
            return
    raise failed


def _excludes(job_id: str, exclude: Sequence[str], env: Mapping[str, str] | None) -> bool:
    """Whether Slurm shows every node of ``exclude`` in the task's ``ExcNodeList``."""
    try:
        record = commands.scontrol_show_job(job_id, env, timeout=SCONTROL_TIMEOUT)
    except SlurmError:
        return False
    shown = record.get("ExcNodeList", "")
    return all(node in shown.split(",") for node in exclude)


def requeued_since(job_id: str, restarts: int, env: Mapping[str, str] | None = None) -> bool:
    """Whether Slurm requeued the task since it had ``restarts`` restarts."""
    try:
        record = commands.scontrol_show_job(job_id, env, timeout=SCONTROL_TIMEOUT)
    except SlurmError:
        return False
    count = record.get("Restarts", "")
    return count.isdigit() and int(count) > restarts


class DepartureWatch:
    """Asks Slurm why this slot is being stopped at the moment the stop signal arrives.

    Asked after the workers have drained (up to ``--grace`` later), Slurm describes the task
    as it is then: already requeued by Slurm after GraceTime, or completing, which reads as
    "cancelled", and a slurmctld busy with the preemption may not answer at all. So the signal
    handler only hands the signal to a thread that was
    started beforehand (``SimpleQueue.put`` is safe in a signal handler, starting a thread is
    not: the handler may interrupt the main thread while it holds a lock of ``threading``);
    that thread runs ``scontrol`` and keeps the answer for ``ElasticSlot.settle``.
    """

    def __init__(self, ask: Callable[[], tuple[Departure, dict[str, str]] | None]) -> None:
        self._ask = ask
        self._signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._signalled = False
        self._answered = threading.Event()
        self._answer: tuple[Departure, dict[str, str]] | None = None
        threading.Thread(target=self._watch, name="hpc-elastic-departure", daemon=True).start()

    def signalled(self, signum: int) -> None:
        """Called from the signal handler: sets a flag and queues the signal, never blocks."""
        self._signalled = True
        self._signals.put(signum)

    def answer(self, timeout: float) -> tuple[Departure, dict[str, str]] | None:
        """What Slurm said when the first signal came; None if no signal came, or no answer
        within ``timeout``."""
        if not self._signalled:
            return None
        self._answered.wait(timeout)
        return self._answer

    def _watch(self) -> None:
        signum = self._signals.get()
        log.debug("signal %d: asking Slurm why this slot is being stopped", signum)
        try:
            self._answer = self._ask()
            log.debug("Slurm says why the slot is stopped: %s", self._answer)
        except Exception:  # A thread of its own: say so, and let settle ask again.
            log.exception("could not record why this slot is being stopped")
        finally:
            self._answered.set()


@dataclass
class ElasticSlot:
    """One array task's dealings with Slurm, for the agent that runs in it."""

    context: SlurmContext
    job_dir: Path
    limits: SlotLimits = SlotLimits()
    env: Mapping[str, str] | None = None
    problem: str | None = field(init=False, default=None)
    """Why the ledger could not be read (its counts then start afresh), for a warning event."""
    _ledger: SlotLedger = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    """The departure watch writes the ledger from its own thread."""
    _watch: DepartureWatch | None = field(init=False, default=None)
    _requeue_limit: int | None = field(init=False, default=None)
    remembered_bad: tuple[str, ...] = field(init=False, default=())
    """The user's bad nodes remembered across jobs (the health preflight read them): every
    requeue of this slot keeps away from them too, not only from the slot's own bad nodes."""
    _others: tuple[str, ...] | None = field(init=False, default=None)
    """The job's other arrays, once ``job.json`` names them all (``other_arrays``)."""
    _task_arrays: dict[int, str] = field(init=False, default_factory=dict)
    """Each sibling task's array job, from the last squeue answer (``task_arrays``)."""
    _statuses: Sequence[JobStatus] = field(init=False, default=())
    """The last squeue answer: who is the job's lowest running slot (``elected``)."""
    _drained: NodeDrain | None = field(init=False, default=None)
    """The drain this slot left its node for (``watch_drains``), for ``why_stopping``."""
    moved_lead: float | None = field(init=False, default=None)
    """The time-limit lead this slot moved itself to (``--grace-action lead``): a stop that
    comes within it of the time limit is the time limit's (``why_stopping``)."""

    def __post_init__(self) -> None:
        try:
            self._ledger = load_ledger(self.ledger_path)
        except SlurmError as error:
            log.warning("%s", error)
            self.problem, self._ledger = str(error), SlotLedger()

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
        return JobDir(self.job_dir).slot_ledger(str(self.context.array_task_id))

    @property
    def job_id(self) -> str:
        return f"{self.context.array_job_id}_{self.context.array_task_id}"

    @property
    def node(self) -> str:
        return self.context.node_name

    @property
    def ledger(self) -> SlotLedger:
        return self._ledger

    def arrive(self) -> Arrival:
        """Record the start on this node, and how the previous incarnation ended: one that
        died with its node counts as a failure there (``Arrival.node_failure``)."""
        with self._lock:
            ledger, arrival = self._ledger.arrived(self.node)
            self._save(ledger)
        log.debug("slot %s arrives on %s after %s", self.job_id, self.node, arrival)
        return arrival

    def count_failure(self) -> bool:
        """A worker of this slot failed on this node; True once the node is bad for the slot."""
        with self._lock:
            self._save(self._ledger.failed_on(self.node))
        return self._ledger.is_bad(self.node, self.limits)

    def placed_badly(self) -> bool:
        return self._ledger.is_bad(self.node, self.limits) or self.node in self._ledger.excluded

    def expected_nodes(self, emit: Callable[..., None] | None = None) -> ComingSlots:
        """The slot count for the rendezvous, already asking Slurm: the first answer is
        likely in by the time the first round is decided. With ``emit``, the same squeue
        answers also report tasks Slurm holds (``watch_held``)."""
        assert self.context.array_job_id is not None
        coming = ComingSlots(
            self.context.array_job_id,
            lambda ids: commands.squeue(ids, self.env, timeout=SQUEUE_TIMEOUT),
            on_statuses=self.watch_held(emit) if emit is not None else None,
            also=self.other_arrays,
        )
        coming()
        if emit is not None:
            poll(coming, HELD_POLL_S)
        return coming

    def watch_held(self, emit: Callable[..., None]) -> Callable[[Sequence[JobStatus]], None]:
        """What the lowest running slot (``reports_held``) does with each task Slurm holds:
        release a hold that churn caused, under the no-progress breaker (``release_held``),
        else raise one ``held`` alert per hold (``report_held``)."""
        me = self.context.array_task_id
        assert me is not None

        still_held: set[int] = set()
        """Tasks this process saw held and did not release: gone from the list, their hold ended."""

        def observe(statuses: Sequence[JobStatus]) -> None:
            self._task_arrays.update(task_arrays(statuses))
            self._statuses = statuses
            held = held_reasons(statuses)
            for task in sorted(still_held - set(held)):
                self._hold_ended(task)
            still_held.intersection_update(held)
            if not reports_held(statuses, me):
                return
            churn = set(churn_held_tasks(statuses))
            for task, reason in sorted(held.items()):
                if task in churn and self.release_held(task, emit):
                    still_held.discard(task)  # Our release ended it: counted as a release.
                    continue
                if task not in still_held:
                    log.debug("slot %s sees task %s held by Slurm (%s)", self.job_id, task, reason)
                    self.report_held(task, reason, emit)
                    still_held.add(task)

        return observe

    def _task_job_id(self, task: int) -> str:
        return f"{self._task_arrays.get(task, self.context.array_job_id)}_{task}"

    def other_arrays(self) -> tuple[str, ...]:
        """The job's arrays besides this task's own: the growth slots' (or, from a growth
        slot, the guaranteed ones'), from ``job.json``. ``submit`` writes the second job id
        once sbatch has answered, which a slot of the first array may start before: until
        then the answer is read again at every call."""
        if self._others is not None:
            return self._others
        try:
            record = JobRecord.load(self.job_dir)
        except HpcElasticError as error:
            log.debug("no job record to find the other arrays in: %s", error)
            return ()
        others = tuple(job for job in record.job_ids if job != self.context.array_job_id)
        if record.job_id is not None and (record.grow_job_id is not None or not record.grows):
            self._others = others
            log.debug("slot %s: the job's other arrays are %s", self.job_id, others)
        return others

    def arrays(self) -> list[str]:
        """Every array of the job, this task's own first: what squeue is asked about."""
        assert self.context.array_job_id is not None
        return [self.context.array_job_id, *self.other_arrays()]

    def _squeue_job(self, *, bounded: bool = True) -> list[JobStatus]:
        """squeue for every array of the job; notes which array each task is in. Unbounded
        (squeue's own timeout) at the end of the job, which has the time and may need it on a
        busy slurmctld; else within SQUEUE_TIMEOUT."""
        arrays = self.arrays()
        if bounded:
            statuses = commands.squeue(arrays, self.env, timeout=SQUEUE_TIMEOUT)
        else:
            statuses = commands.squeue(arrays, self.env)
        self._task_arrays.update(task_arrays(statuses))
        return statuses

    def _hold_ended(self, task: int) -> None:
        path = JobDir(self.job_dir).hold_record(task)
        record = load_hold_record(path)
        save_json(path, asdict(replace(record, ended=record.ended + 1)))
        log.debug("the hold of task %s ended (released by someone else)", task)

    def release_held(self, task: int, emit: Callable[..., None]) -> bool:
        """Release task ``task`` from a churn hold unless the breaker says no; True once done.

        The progress figure is the newest committed checkpoint step in the job's events
        file: it lives in the job directory that every agent shares, survives requeues, needs
        no torch (the agent never imports it) and is what the restart breaker already trusts.
        """
        paths = JobDir(self.job_dir)
        record = load_hold_record(paths.hold_record(task))
        progress = newest_checkpoint_step(events.read(paths.events))
        if not may_release(record, progress):
            log.debug("task %s stays held: no progress (%s) since %s", task, progress, record)
            return False
        try:
            commands.release(self._task_job_id(task), self.env)
        except SlurmError as error:
            log.warning("could not release task %s: %s", task, error)
            return False
        record = replace(record, releases=record.releases + 1, released_at=progress)
        save_json(paths.hold_record(task), asdict(record))
        log.debug("slot %s released task %s (%s)", self.job_id, task, record)
        emit(
            Kind.RELEASED,
            task=task,
            slurm_job=self._task_job_id(task),
            releases=record.releases,
            progress=progress,
        )
        return True

    def report_held(
        self, task: int, reason: str, emit: Callable[..., None], **details: object
    ) -> bool:
        """One ``held`` event per hold, across every agent process: the first to claim the
        hold's marker in the job directory writes it. A hold is numbered by the task's
        ended holds so far (``HoldRecord.hold``): released and held again, it is reported again."""
        paths = JobDir(self.job_dir)
        hold = load_hold_record(paths.hold_record(task)).hold
        if not claim(paths.hold_alert(task, hold)):
            log.debug("hold %d of task %s was already reported", hold, task)
            return False
        emit(Kind.HELD, task=task, slurm_job=self._task_job_id(task), reason=reason, **details)
        return True

    def requeue_limit(self) -> int:
        """The site's ``MaxBatchRequeue``, asked once per agent (Slurm's default if it cannot
        say: the alert may then come early, never late)."""
        if self._requeue_limit is None:
            try:
                self._requeue_limit = commands.max_batch_requeue(commands.show_config(self.env))
            except SlurmError as error:
                log.debug("no MaxBatchRequeue from Slurm, assuming the default: %s", error)
                self._requeue_limit = commands.DEFAULT_MAX_BATCH_REQUEUE
        return self._requeue_limit

    def announce_own_hold(self, emit: Callable[..., None]) -> bool:
        """Right after this slot's own requeue: when Slurm answered it with a hold for too
        many requeues and no other slot runs to release or report it, raise the ``held``
        alert now, since after this slot leaves nobody may. True when announced.

        Slurm is asked only once the restart count (``SLURM_RESTART_COUNT``) has reached the
        site's ``MaxBatchRequeue``; the count alone would cry wolf, since Slurm 22.05 counts
        only node-failure requeues towards the hold, never an ``scontrol requeue``. So what
        Slurm says of the task right after the requeue decides (the agent is still alive
        then: it sets the task's ``ExcNodeList`` at that moment too).
        """
        if self.context.restart_count == 0:
            # A first requeue is held only where MaxBatchRequeue is 0, a site on which no
            # elastic job can live; not asking spares slurmctld a call on every first requeue.
            return False
        limit = self.requeue_limit()
        if not will_be_held(self.context.restart_count, limit):
            return False
        record = self._read_job()
        if isinstance(record, SlurmError) or record.get("Reason") != CHURN_HOLD:
            log.debug("slot %s reached %d restarts but is not held", self.job_id, limit)
            return False
        me = self.context.array_task_id
        assert me is not None
        try:
            statuses = self._squeue_job()
        except SlurmError:
            statuses = []  # Nobody known to be running: announce rather than stay silent.
        if [task for task in running_tasks(statuses) if task != me]:
            log.debug("slot %s is held; a running sibling will see it", self.job_id)
            return False
        return self.report_held(
            me, CHURN_HOLD, emit, restarts=self.context.restart_count + 1, limit=limit, last=True
        )

    def watch_departure(self, warning_s: float) -> DepartureWatch:
        """Start the thread that asks Slurm why, as soon as a stop signal arrives; its answer
        is also noted in the ledger, in case Slurm SIGKILLs the slot before it leaves. When
        Slurm cannot answer then, there is no answer, and ``settle`` asks again."""

        def ask() -> tuple[Departure, dict[str, str]] | None:
            record = self._read_job()
            if isinstance(record, SlurmError):
                log.warning("Slurm did not say why slot %s stops: %s", self.job_id, record)
                return None
            why, evidence = departure(record, warning_s), _evidence(record)
            if why in _KILLED_LEAVING_IS_EXPECTED:
                with self._lock:
                    self._save(replace(self._ledger, leaving_for=why.value))
            return why, evidence

        self._watch = DepartureWatch(ask)
        return self._watch

    def ask_slurm_why(self, warning_s: float) -> tuple[Departure, dict[str, str]]:
        """Why Slurm stops this task now, and the fields that said so. A Slurm that cannot
        say is treated as a cancel, since it could not requeue us either."""
        record = self._read_job()
        if isinstance(record, SlurmError):
            return Departure.CANCELLED, {"error": str(record)}
        return departure(record, warning_s), _evidence(record)

    def _read_job(self) -> dict[str, str] | SlurmError:
        """``scontrol show job`` for this task, tried a few times: a slurmctld busy with the
        very preemption that signalled us may drop a first request."""
        error = SlurmError(f"scontrol was not asked about {self.job_id}.")
        for attempt in range(SCONTROL_TRIES):
            if attempt:
                time.sleep(SCONTROL_PAUSE)
            try:
                return commands.scontrol_show_job(self.job_id, self.env, timeout=SCONTROL_TIMEOUT)
            except SlurmError as failed:
                log.debug("scontrol show job %s, try %d: %s", self.job_id, attempt + 1, failed)
                error = failed
        return error

    def why_stopping(self, warning_s: float) -> tuple[Departure, dict[str, str]]:
        """Workers stopped to be requeued (exit 75): why. The answer Slurm gave when the stop
        signal arrived, if one did (see ``DepartureWatch``); else Slurm is asked now, as when
        the bad-node watch or the workers themselves stopped the slot."""
        deadline = SCONTROL_TRIES * (SCONTROL_TIMEOUT + SCONTROL_PAUSE)
        recorded = self._watch.answer(deadline) if self._watch is not None else None
        warning_s = max(warning_s, self.moved_lead or 0.0)
        why, evidence = recorded if recorded is not None else self.ask_slurm_why(warning_s)
        evidence = {**evidence, "asked": "at the signal" if recorded else "after the drain"}
        if why is not Departure.CANCELLED and self.placed_badly():
            return Departure.BAD_NODE, evidence
        if why is Departure.BY_HAND and self._drained is not None:
            # Nothing else from Slurm (no preemption, no time limit): we left for the drain.
            drain = self._drained
            return Departure.DRAIN, {**evidence, "state": drain.state, "reason": drain.reason}
        return why, evidence

    def requeue(self, why: Departure, emit: Callable[..., None] | None = None) -> str | None:
        """Requeue this task (away from its bad nodes); returns why it may not, if so. With
        ``emit``, a requeue that Slurm answered with a hold is announced (``announce_own_hold``)."""
        with self._lock:
            ledger = self._ledger.requeued(why)
            if why is Departure.BAD_NODE:
                ledger = ledger.exclude(self.node)
            refused = ledger.over_limit(self.limits)
            self._save(replace(ledger, running_on=None, leaving_for=None))
        if refused is not None:
            return refused
        try:
            warning = requeue(
                self.job_id, self.excluded(), self.env, restarts=self.context.restart_count
            )
        except SlurmError as error:
            return str(error)
        if warning is not None:
            log.warning("%s", warning)
        if emit is not None:
            if warning is not None:
                emit(Kind.WARNING, message=warning)
            self.announce_own_hold(emit)
        return None

    def excluded(self) -> list[str]:
        """The requeue's ``ExcNodeList``: the slot's own bad nodes and the user's, and the
        nodes Slurm drains now (``drain.drained_now``): a node resumed while the task pends is
        avoided until its next requeue, the price of never landing on one drained meanwhile."""
        drained = drain.drained_now(JobDir(self.job_dir).drained)
        return sorted({*self._ledger.excluded, *self.remembered_bad, *drained})

    def elected(self) -> bool:
        """Whether this slot asks Slurm for the whole job (the drained nodes): the lowest
        running slot of the last squeue answer, as for held tasks (``reports_held``)."""
        me = self.context.array_task_id
        return me is not None and reports_held(self._statuses, me)

    def watch_drains(self, stop: Callable[[], None], emit: Callable[..., None]) -> drain.DrainWatch:
        """Start the thread that leaves this node once Slurm drains it (slurm/drain.py): at
        the next committed checkpoint it calls ``stop`` (the agent's stop, as for a
        preemption); ``settle`` then requeues the slot for ``Departure.DRAIN``."""
        paths = JobDir(self.job_dir)

        def leave(found: NodeDrain, why: str) -> None:
            self._drained = found
            log.debug("slot %s leaves drained node %s: %s", self.job_id, found.node, why)
            stop()

        watch = drain.DrainWatch(
            self.node,
            paths.drained,
            paths.events,
            elected=self.elected,
            query=lambda: commands.drained_nodes(self.env, timeout=SQUEUE_TIMEOUT),
            leave=leave,
            emit=emit,
        )
        return watch.start()

    def grace_limits(self, lead_s: float) -> grace.Limits | None:
        """What Slurm leaves this slot to save in (``grace.limits_from``), or None if Slurm
        cannot say now (asked again after the next save)."""
        try:
            job = commands.scontrol_show_job(self.job_id, self.env, timeout=SCONTROL_TIMEOUT)
            config = commands.show_config(self.env)
            partition = commands.partition_record(job.get("Partition") or None, self.env) or {}
            table = {}
            if config.get("PreemptType") == "preempt/qos":
                rows = commands.qos_table(self.env, timeout=SCONTROL_TIMEOUT)
                table = {name: grace.QosRow(name, *row) for name, row in rows.items()}
        except SlurmError as error:
            log.debug("no grace limits from Slurm now: %s", error)
            return None
        return grace.limits_from(lead_s, job, config, partition, table)

    def watch_grace(
        self,
        run_dir: Path,
        lead_s: float,
        action: str,
        stop: Callable[[], None],
        emit: Callable[..., None],
    ) -> grace.GraceWatch:
        """Start the thread that times this node's saves (slurm/grace.py): when a save and a
        step no longer fit what Slurm leaves, the job's timeline gets one ``grace`` event
        (the first agent to claim ``slots/grace-warned``), with ``action`` ``lead`` this
        slot stops itself (``stop``) early enough before its own time limit, and with
        ``local`` every stop's save goes to the node-local tier first (``slots/local-first``,
        which the workers read when their loop stops)."""
        paths = JobDir(self.job_dir)

        def warn(fit: grace.Fit) -> None:
            if action == "local" and claim(paths.local_first):
                log.debug("slot %s: the job's stop saves go to the local tier first", self.job_id)
            if claim(paths.slots / "grace-warned"):
                emit(
                    Kind.GRACE,
                    message=fit.sentence(),
                    advice=fit.advice(),
                    save_s=round(fit.save_s, 2),
                    step_s=round(fit.step_s, 2),
                    lead_s=fit.limits.lead_s,
                    grace_s=fit.limits.grace_s,
                    where=fit.limits.where,
                    preempt_mode=fit.limits.preempt_mode,
                    action=action,
                )
            log.warning("slot %s: %s", self.job_id, fit.sentence())

        def stop_at(lead: float) -> None:
            self.moved_lead = lead
            threading.Thread(
                target=self._stop_before_the_end,
                args=(lead, stop, emit),
                name="hpc-elastic-lead",
                daemon=True,
            ).start()

        watch = grace.GraceWatch(
            run_dir,
            limits=lambda: self.grace_limits(lead_s),
            warn=warn,
            stop_at=stop_at if action == "lead" else None,
        )
        return watch.start()

    def _stop_before_the_end(
        self, lead: float, stop: Callable[[], None], emit: Callable[..., None]
    ) -> None:
        """``--grace-action lead``: sleep until ``lead`` seconds before this task's end (asked
        again before acting, in case its time limit changed), then stop the slot, which the
        time-limit path requeues (``moved_lead``)."""
        while True:
            try:
                job = commands.scontrol_show_job(self.job_id, self.env, timeout=SCONTROL_TIMEOUT)
            except SlurmError as error:
                log.debug("no end time from Slurm, trying again: %s", error)
                time.sleep(grace.LEAD_MARGIN_S)
                continue
            end = grace.parse_end_time(job.get("EndTime", ""))
            if end is None or job.get("TimeLimit") in ("UNLIMITED", "Partition_Limit"):
                log.debug("slot %s has no end time: the lead is not moved", self.job_id)
                return
            wait = end - lead - time.time()
            if wait <= 0:
                log.debug("slot %s stops %.0f s before its end (moved lead)", self.job_id, lead)
                emit(
                    Kind.GRACE,
                    message=f"stopping {lead:.0f} s before the time limit",
                    action="lead",
                )
                stop()
                return
            time.sleep(min(wait, 60.0))

    def drained_here(self) -> NodeDrain | None:
        """Whether the job's board shows this node drained already, when the slot arrives: a
        task granted the node just before its drain leaves before it joins."""
        return drain.drain_of(
            drain.read_board(JobDir(self.job_dir).drained), self.node, time.time()
        )

    def leave_drained(self, found: NodeDrain, emit: Callable[..., None]) -> int:
        """Requeue the slot off a node drained before it joined; the exit code (75, or 1 if
        Slurm refused)."""
        emit(Kind.DRAIN, **asdict(found), action="leaving before joining")
        self._drained = found
        refused = self.requeue(Departure.DRAIN, emit)
        if refused is not None:
            emit(Kind.LEAVE, reason=f"slot {self.context.array_task_id} is not requeued: {refused}")
            return 1
        emit(
            Kind.REQUEUE,
            cause=Departure.DRAIN.value,
            slurm_job=self.job_id,
            excluded=self.excluded(),
        )
        return PREEMPTED_EXIT_CODE

    def move_away(self, cause: str, emit: Callable[..., None], **details: object) -> int:
        """Leave this node for good and requeue the slot elsewhere, before or instead of
        running: the health preflight failed here (``cause`` "unhealthy"), or a rank here
        straggles. Returns the slot's exit code: 75 once requeued, 1 if Slurm refused."""
        emit("exclude", node=self.node, cause=cause, **details)
        refused = self.requeue(Departure.BAD_NODE, emit)
        if refused is not None:
            emit("leave", reason=f"slot {self.context.array_task_id} is not requeued: {refused}")
            return 1
        emit("requeue", cause=cause, slurm_job=self.job_id, excluded=self.excluded())
        log.debug(
            "slot %s leaves %s (%s), excluding %s", self.job_id, self.node, cause, self.excluded()
        )
        return PREEMPTED_EXIT_CODE

    def mark_bad(self) -> None:
        """This node must not host the slot again (a straggler here): the next settle sees
        ``placed_badly`` and requeues the slot away from it, as after repeated failures."""
        with self._lock:
            self._save(self._ledger.exclude(self.node))

    def leave(self) -> None:
        """A clean exit: the next incarnation must not count this one as a crash."""
        with self._lock:
            self._save(replace(self._ledger, running_on=None, leaving_for=None))

    def settle(self, exit_code: int, warning_s: float, emit: Callable[..., None]) -> int:
        """After the agent: requeue a slot that stopped to be moved, or, once the job is over
        (0: done, 1: failed), cancel the array's pending tasks. Returns the slot's exit code."""
        why, evidence = (
            self.why_stopping(warning_s) if exit_code == PREEMPTED_EXIT_CODE else (None, {})
        )
        if why is not None and why is not Departure.CANCELLED:
            if why is Departure.BAD_NODE:
                emit(
                    Kind.EXCLUDE, node=self.node, failures=self._ledger.node_failures.get(self.node)
                )
            refused = self.requeue(why, emit)
            if refused is None:
                emit(
                    Kind.REQUEUE,
                    cause=why.value,
                    slurm=evidence,
                    slurm_job=self.job_id,
                    excluded=self.excluded(),
                )
                return exit_code
            emit(Kind.LEAVE, reason=f"slot {self.context.array_task_id} is not requeued: {refused}")
            return 1
        if why is Departure.CANCELLED:
            emit(Kind.CANCELLED, slurm=evidence, slurm_job=self.job_id)
        self.leave()  # First: a sibling ending the job reads it, and never cancels this task.
        if exit_code in (0, 1):
            self.end_siblings(exit_code, warning_s, emit)
        return exit_code

    def end_siblings(self, exit_code: int, grace: float, emit: Callable[..., None]) -> list[int]:
        """The job is over (done or failed): no other task of the array may start or go on.
        Returns the tasks cancelled.

        Tasks in which no agent runs are cancelled at once, and so is a task that Slurm shows
        running although the rendezvous dropped its agent: a crashed node's, which Slurm may
        not notice for minutes (until the node registers again). A task whose agent may
        still be on its way out is never cut short: by the time this agent gets here the
        job is failed, closed, or every member of its last round has succeeded (and the
        last of them closes it), so every live agent is leaving by itself. It is given
        ``grace`` (its workers' save) plus END_MARGIN_S, and cancelled only if Slurm still
        shows it running and its ledger still does not say it left. Nothing is cancelled
        when this agent exits 1 for a reason of its own: the job goes on without it.
        """
        timeline = list(events.read(JobDir(self.job_dir).events))
        if not job_over(exit_code, timeline):
            log.debug(
                "slot %s exits %d, the job goes on: nothing cancelled", self.job_id, exit_code
            )
            return []
        lost = lost_slots(timeline)
        deadline = time.monotonic() + grace + END_MARGIN_S
        tried: set[int] = set()
        cancelled: list[int] = []
        answered = False
        while True:
            plan = self._end_plan(lost)
            overdue = time.monotonic() >= deadline
            if plan is not None:
                answered = True
                due = set(plan.cancel) - tried
                if overdue:
                    due |= set(plan.finishing)
                if due:
                    tried |= due
                    running = due & {*plan.lost, *plan.finishing}
                    cancelled += self._cancel(sorted(due), sorted(running), emit)
                if overdue or not plan.finishing:
                    return cancelled
            elif overdue or not answered:
                return cancelled  # Slurm did not answer: nothing is known to be left to cancel
            log.debug("slot %s waits for its siblings to leave", self.job_id)
            time.sleep(END_POLL_S)

    def _end_plan(self, lost: set[str]) -> EndPlan | None:
        """``end_plan`` over squeue's answer now and the siblings' ledgers; None if squeue
        failed."""
        me = self.context.array_task_id
        assert me is not None
        try:
            statuses = self._squeue_job(bounded=False)
        except SlurmError as error:
            log.debug("no squeue answer at the end of the job: %s", error)
            return None
        return end_plan(statuses, me, self._sibling_ledger, lost)

    def _sibling_ledger(self, task: int) -> SlotLedger | None:
        try:
            return load_ledger(JobDir(self.job_dir).slot_ledger(str(task)))
        except SlurmError:
            return None

    def _cancel(self, tasks: list[int], running: list[int], emit: Callable[..., None]) -> list[int]:
        """Cancel ``tasks`` (``running``: those Slurm showed running), one scancel per array
        of the job; the event says which."""
        assert self.context.array_job_id is not None
        by_array: dict[str, list[int]] = {}
        for task in tasks:
            array = self._task_arrays.get(task, self.context.array_job_id)
            by_array.setdefault(array, []).append(task)
        cancelled: list[int] = []
        for array, group in sorted(by_array.items()):
            try:
                cancel_tasks(array, group, self.env)
            except SlurmError as error:
                # Another slot's agent got there first (scancel fails for a task already ended).
                log.debug("scancel of tasks %s of %s: %s", group, array, error)
                continue
            cancelled += group
        if not cancelled:
            return []
        shown = [task for task in running if task in cancelled]
        log.debug("slot %s cancelled tasks %s (running: %s)", self.job_id, cancelled, shown)
        emit(Kind.CANCEL_PENDING, tasks=cancelled, running=shown)
        return cancelled

    def _save(self, ledger: SlotLedger) -> None:
        self._ledger = ledger
        save_ledger(self.ledger_path, ledger)
