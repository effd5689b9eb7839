"""The job's timeline: JSON lines appended by every agent and worker, read back across requeues.

Each event is one ``write`` on a file opened with O_APPEND, so lines from many processes on a
shared filesystem interleave whole instead of tearing.
"""

from __future__ import annotations

import enum
import json
import os
import socket
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from hpc_elastic import contract
from hpc_elastic.decoding import (
    Check,
    MalformedError,
    flag,
    mapping_of,
    optional,
    record,
    text,
    tuple_of,
    whole,
)
from hpc_elastic.errors import EventsError, one_line

EVENTS_FILE_ENV = contract.EVENTS_FILE_ENV
"""Kept here too, where workers and helpers imported it before ``contract`` existed."""

_MAX_LINE = 4000
"""The longest line appended whole; a longer one loses its details (``append``)."""
NAMES_IN_A_LINE = 2000
"""Characters of names (slots or node ids, JSON-encoded) one event lists at most, so that with
its other fields its line stays under ``_MAX_LINE``. A round of 400 members once overflowed
it, and its event lost every detail: ``status`` showed world size 0."""
NAMES_SHOWN = 32
"""Members' slots a round's event lists, and a line of ``status`` or the timeline shows, before
saying how many more there are. Every agent writes a round's event every round: 4,096 of
them listing 150 slots each was 8 MB of the shared events file a round."""
_LATEST_TIME = 2.0**34
"""Seconds since 1970 in the year 2514: later times cannot be shown as dates, so a line
carrying one was not written by a clock."""


class Kind(enum.StrEnum):
    """Every kind of event the toolkit writes. Producers must pass one of these, so a misspelt
    kind fails type checking instead of silently dropping a line from ``status``."""

    JOIN = "join"
    """An agent entered the rendezvous (details: host, nproc)."""
    ROUND = "round"
    """A round formed (``RoundDetails``)."""
    START = "start"
    """This agent's workers started (details: ranks)."""
    RESTART = "restart"
    """This agent's workers stopped for a new round (details: reason)."""
    FAILURE = "failure"
    """A worker failed (``FailureDetails``)."""
    FAILED = "failed"
    """The job failed (``FailedDetails``)."""
    DONE = "done"
    """Every worker of the job finished."""
    LEAVE = "leave"
    """An agent left (details: exit_code or reason)."""
    PREEMPT = "preempt"
    """An agent stopped its workers for preemption and waits for the requeue."""
    REQUEUE = "requeue"
    """Slurm requeues a slot (written by slurm/elastic.py)."""
    ERROR = "error"
    """The agent cannot go on (details: reason, exit_code)."""
    SPARE = "spare"
    """An agent waits beside a full round as a hot spare (``submit --spares``; details:
    standbys, whether it keeps prewarmed standby workers); its next ``round`` is the one in
    which it replaces a lost member."""
    NODE_LOST = "node_lost"
    NODE_ARRIVED = "node_arrived"
    """Membership changes between two rounds (details: nodes)."""
    DEPARTED = "departed"
    """A member's agent process exited, told by the end of its link (agent/links.py), and is
    marked gone before its session expires (details: node, departed: its id, cause)."""
    ROUND_ENDED = "round_ended"
    """The restart timeline (``ops/phases.py``): this agent saw its round end (details: outcome)."""
    FAILURE_REPORTED = "failure_reported"
    """The restart timeline: the failure report is in the store (details: rank)."""
    WORKERS_STOPPED = "workers_stopped"
    """The restart timeline: this agent's old workers are gone."""
    WORKERS_KEPT = "workers_kept"
    """The restart timeline, in-place mode: this agent handed its surviving workers the new
    round instead of stopping them (details: ranks, the survivors' new ranks)."""
    STORE_CONNECTED = "store_connected"
    """The restart timeline: every local rank holds a connection to the round's TCPStore, as
    the agent sees it in ``/proc`` (agent/sockets.py; details: ranks, port)."""
    FIRST_HEARTBEAT = "first_heartbeat"
    """The restart timeline: every local rank of the round beat its heartbeat."""
    WORKER_READY = "worker_ready"
    """The restart timeline: a rank reached its first ``should_stop()`` (in the group)."""
    FIRST_STEP = "first_step"
    """The restart timeline: a rank's first ``should_stop()`` collective returned."""
    CHECKPOINT = "checkpoint"
    """A checkpoint was committed (``CheckpointDetails``)."""
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    """An asynchronous save was skipped: the previous commit was still in flight."""
    CHECKPOINT_LOADED = "checkpoint_loaded"
    """A restart resumed from a checkpoint (``LoadedDetails``)."""
    TRAINING = "training"
    """A round's workers began training (read by ops/goodput.py)."""
    STRAGGLER = "straggler"
    """A rank steps much slower than the median (details: rank, score)."""
    HANG = "hang"
    """One agent's part in a hang's investigation: what it saw of its ranks, and the verdict
    agreed for the whole job (``HangDetails``); the root cause itself is one ``failure``."""
    USER_ERROR = "user_error"
    BREAKER = "breaker"
    """A failure no restart fixes (a user error; restarts without a new checkpoint): the
    job is failed at once (details: reason)."""
    HEALTH = "health"
    """The node's health checks before the agent joins (details: healthy, reason, checks)."""
    HELD = "held"
    """Slurm holds a requeued task (REQUEUE_HOLD; details: task, slurm_job, reason)."""
    RELEASED = "released"
    """A running slot released a sibling that Slurm held for too many requeues
    (``JobHoldMaxRequeue``; details: task, slurm_job, releases, progress)."""
    FENCED = "fenced"
    """A worker stopped itself because the agent's lease went stale."""
    EXCLUDE = "exclude"
    CANCEL_PENDING = "cancel_pending"
    CANCELLED = "cancelled"
    NODE_FAILURE = "node_failure"
    KILLED_LEAVING = "killed_leaving"
    WARNING = "warning"
    """An elastic slot's decisions (slurm/elastic.py, slurm/ending.py, agent/command.py): a
    node excluded, pending slots cancelled, the job found cancelled, the last incarnation's end
    judged."""
    CANCEL = "cancel"
    """``hpc-elastic cancel`` stopped the job."""
    DRAIN = "drain"
    """Slurm drains (or fails) the node under a running slot, which leaves at the next
    committed checkpoint and requeues elsewhere (slurm/drain.py; details: node, state,
    reason, since, by, action)."""
    GRACE = "grace"
    """A checkpoint save no longer fits the time Slurm leaves after its warning signal or
    preemption (slurm/grace.py; details: the figures, the verdict, the action taken)."""
    CHURN = "churn"
    """Local mode's simulated churn (``ChurnDetails``)."""


class UnknownKind(str):
    """A kind read from a file that this version does not know (a newer writer, a stranger),
    kept as text so that ``events`` still shows the line. A subclass of ``str`` rather than
    ``str`` itself, so that ``Event(kind="rond")`` fails type checking."""

    __slots__ = ()


def kind_of(text: str) -> Kind | UnknownKind:
    """The ``Kind`` that ``text`` names, or the text kept as an ``UnknownKind``."""
    try:
        return Kind(text)
    except ValueError:
        return UnknownKind(text)


@dataclass(frozen=True)
class Event:
    kind: Kind | UnknownKind
    """One of ``Kind``; an ``UnknownKind`` only when read from a file."""
    job: str = ""
    slot: str = ""
    node: str = field(default_factory=socket.gethostname)
    round: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


def append(path: Path | str, event: Event) -> None:
    """Append one event; a line too long for an atomic append loses its details, not its kind."""
    line = json.dumps(asdict(event), sort_keys=True, default=str)
    if len(line) > _MAX_LINE:
        line = json.dumps(asdict(Event(**{**asdict(event), "details": {"truncated": True}})))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def emit(kind: Kind, **details: Any) -> None:
    """Append to the events file the agent named in the environment; a no-op outside a job."""
    path = os.environ.get(EVENTS_FILE_ENV)
    if path:
        append(
            path,
            Event(
                kind=kind,
                job=os.environ.get("TORCHELASTIC_RUN_ID", ""),
                slot=os.environ.get(contract.SLOT_ENV, ""),
                round=_int_or_none(os.environ.get(contract.ROUND_ENV)),
                details=details,
            ),
        )


CHECKPOINTS = frozenset({Kind.CHECKPOINT})
"""What a reader that follows the job's progress reads (``read``'s ``kinds``)."""


def read(path: Path | str, kinds: Collection[Kind] | None = None) -> Iterator[Event]:
    """Events in time order, only those of ``kinds`` when given (``_parse``); a torn or
    foreign line is skipped rather than trusted."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return iter(())
    return iter(sorted(_parse(lines, kinds), key=lambda event: event.time))


def read_new(
    path: Path | str, offset: int, kinds: Collection[Kind] | None = None
) -> tuple[list[Event], int]:
    """Events appended after byte ``offset`` (whole lines only), in file order, only those
    of ``kinds`` when given, and the offset to read from next: for readers that follow the
    file as it grows."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            chunk = file.read()
    except FileNotFoundError:
        return [], offset
    complete = chunk[: chunk.rfind(b"\n") + 1]
    lines = complete.decode(errors="replace").splitlines()
    return _parse(lines, kinds), offset + len(complete)


def _parse(lines: list[str], kinds: Collection[Kind] | None = None) -> list[Event]:
    """The events of ``lines`` (of ``kinds`` only, when given). Trick: a line that does not
    hold the JSON string of one of ``kinds`` cannot be of that kind, and is skipped before it
    is decoded. Every agent appends to the one file every round, so a reader that wants the
    checkpoints and failures (the restart breaker, as a worker fails) decoded every line of
    every agent: 14.8 s for 4,096 agents of 50 rounds, 0.69 s now (bench/events_read.py)."""
    marks = None if kinds is None else tuple(json.dumps(str(kind)) for kind in kinds)
    events: list[Event] = []
    for line in lines:
        if marks is not None and not any(mark in line for mark in marks):
            continue
        try:
            raw = json.loads(line)
            event = Event(**raw)
        except (ValueError, TypeError, RecursionError):
            continue
        if well_typed(event) and details_problem(event) is None:
            event = replace(event, kind=kind_of(event.kind))
            if kinds is None or event.kind in kinds:
                events.append(event)
    return events


def well_typed(event: Event) -> bool:
    """Whether every field has its declared type: any process of the job's user may append
    to the file, and readers sort by ``time`` and look into ``details`` without asking."""
    texts = (event.kind, event.job, event.slot, event.node)
    return (
        all(isinstance(text, str) for text in texts)
        and (
            event.round is None
            or (isinstance(event.round, int) and not isinstance(event.round, bool))
        )
        and isinstance(event.details, dict)
        and isinstance(event.time, int | float)
        and not isinstance(event.time, bool)
        and 0 <= event.time < _LATEST_TIME
    )


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


# Typed details: what the readers (ops/timeline.py, ops/status.py, ops/plot.py, agent/metrics.py)
# look up in ``Event.details``. Writers spread a record's ``to_details()`` into the event;
# readers call ``from_details``. Every process of the job's user may append to the file, so no
# value in it is trusted (a ``restarts_used`` of "many" once made ``status`` raise): each kind's
# details are decoded by a table of checks (``hpc_elastic.decoding``, one entry per field), and
# ``read`` skips a line whose details are not of their types, as it skips one whose own fields
# are not. A field that is missing takes its default (an older writer, a line too long for its
# details); fields beyond the table (``node_id``, ``phase``, a tier) are left to other readers.


def decode_details(kind: str, details: object) -> object:
    """The typed details of an event of ``kind`` (``DETAILS``), or one ``EventsError``
    sentence naming the field and its value. A kind without a table has none: None."""
    table = DETAILS.get(kind)  # a Kind is its own text: "round" finds Kind.ROUND's table
    if table is None:
        return None
    try:
        return table(details, "")
    except MalformedError as error:
        raise EventsError(
            f"A '{one_line(kind)}' event's details are not of their types ({error}); the line "
            "is not one hpc-elastic writes, so it is skipped."
        ) from error


def details_problem(event: Event) -> str | None:
    """Why ``event``'s details cannot be read as its kind's, or None (for ``read``)."""
    try:
        decode_details(event.kind, event.details)
    except EventsError as error:
        return str(error)
    return None


def in_lines(names: Iterable[str]) -> list[tuple[str, ...]]:
    """``names`` in order, cut into runs that each fit one line (``NAMES_IN_A_LINE``): one
    event a run records every name of thousands, as ``lost_slots`` needs of the nodes lost."""
    return list(_runs(names))


def leading(names: Sequence[str]) -> tuple[str, ...]:
    """The first ``NAMES_SHOWN`` of ``names``, as many of them as fit one line: what a
    round's event lists of its members (every agent writes one every round)."""
    run = next(_runs(names[:NAMES_SHOWN]), ())
    return run if _size(run) <= NAMES_IN_A_LINE else ()


def _runs(names: Iterable[str]) -> Iterator[tuple[str, ...]]:
    """Runs of ``names`` that fit a line; a name longer than a line is a run of its own."""
    run: list[str] = []
    used = 0
    for name in names:
        size = _size((name,))
        if run and used + size > NAMES_IN_A_LINE:
            yield tuple(run)
            run, used = [], 0
        run.append(name)
        used += size
    if run:
        yield tuple(run)


def _size(names: tuple[str, ...]) -> int:
    """Characters ``names`` take in a line: each encoded, and a separator."""
    return sum(len(json.dumps(name)) + 2 for name in names)


@dataclass(frozen=True)
class RoundDetails:
    """``Kind.ROUND``: the round every member agreed on."""

    world_size: int = 0
    members: tuple[str, ...] = ()
    """Slots (or node ids) of the members in rank order: the first ones (``leading``)."""
    restarts_used: int = 0
    member_count: int = 0
    """How many members the round has, listed or not; 0 where an agent before this field
    wrote the event (it listed every member then)."""

    @property
    def count(self) -> int:
        """How many members the round has."""
        return self.member_count or len(self.members)

    def to_details(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "members": list(self.members),
            "restarts_used": self.restarts_used,
            "member_count": self.member_count,
        }

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> RoundDetails:
        return cast(RoundDetails, decode_details(Kind.ROUND, details))


@dataclass(frozen=True)
class FailureDetails:
    """``Kind.FAILURE``: the root cause of one worker's failure."""

    rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    """The signal's name when a signal killed the worker, else None."""
    message: str = ""
    """The tail of the worker's error file or log."""
    hung: bool = False
    sentence: str = ""
    """The one sentence a person reads (a hang's verdict); empty: the message's last line."""
    node_fault: bool = True
    """Whether the failure counts against the node of the agent that wrote it (bad-node
    memory, exclusion): never for a hang whose culprit is elsewhere or unknown."""

    def to_details(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "message": self.message,
            "hung": self.hung,
            "sentence": self.sentence,
            "node_fault": self.node_fault,
        }

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> FailureDetails:
        return cast(FailureDetails, decode_details(Kind.FAILURE, details))


def charges_node(event: Event) -> bool:
    """Whether an agent's event counts against its node (the bad-node watch of
    ``agent/command.py``, and so ``ExcNodeList``): a worker failure, unless it is a hang
    whose culprit is on another node or unknown (``FailureDetails.node_fault``)."""
    return event.kind == Kind.FAILURE and FailureDetails.from_details(event.details).node_fault


@dataclass(frozen=True)
class HangDetails:
    """``Kind.HANG``: one agent's evidence of a hang and the verdict agreed for the job."""

    investigation: int = 0
    """Counts the round's investigations: one dismissed as a slow rank may be followed by
    another."""
    verdict: str = ""
    """culprit, ambiguous or dismissed (``agent/hangs.py``)."""
    rank: int | None = None
    """The culprit; None when there is none."""
    culprit_slot: str = ""
    sentence: str = ""
    evidence: dict[str, str] = field(default_factory=dict)
    """This agent's ranks, by rank: state, marker, stack, time without progress."""
    logs: dict[str, str] = field(default_factory=dict)
    """This agent's ranks' logs, by rank: the whole stack dumps are there."""

    def to_details(self) -> dict[str, Any]:
        return {
            "investigation": self.investigation,
            "verdict": self.verdict,
            "rank": self.rank,
            "culprit_slot": self.culprit_slot,
            "sentence": self.sentence,
            "evidence": dict(self.evidence),
            "logs": dict(self.logs),
        }

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> HangDetails:
        return cast(HangDetails, decode_details(Kind.HANG, details))


@dataclass(frozen=True)
class FailedDetails:
    """``Kind.FAILED``: why the whole job failed."""

    reason: str = ""

    def to_details(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> FailedDetails:
        return cast(FailedDetails, decode_details(Kind.FAILED, details))


@dataclass(frozen=True)
class CheckpointDetails:
    """``Kind.CHECKPOINT``: a committed checkpoint."""

    step: int | None = None
    path: str = ""

    def to_details(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path}

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> CheckpointDetails:
        return cast(CheckpointDetails, decode_details(Kind.CHECKPOINT, details))


@dataclass(frozen=True)
class LoadedDetails:
    """``Kind.CHECKPOINT_LOADED``: which tier a restart read its checkpoint from."""

    step: int | None = None
    tier: str = ""
    """local, peer (a copy kept by another node), shared or remote (object storage)."""
    rank: int | None = None
    """The rank that read it; None: every rank read the same tier."""

    def to_details(self) -> dict[str, Any]:
        return {"step": self.step, "tier": self.tier, "rank": self.rank}

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> LoadedDetails:
        return cast(LoadedDetails, decode_details(Kind.CHECKPOINT_LOADED, details))


@dataclass(frozen=True)
class ChurnDetails:
    """``Kind.CHURN``: local mode killed (``kill``) or started (``add``) a node."""

    action: str = ""
    target: str = ""
    """The slot killed or added."""

    def to_details(self) -> dict[str, Any]:
        return {"action": self.action, "target": self.target}

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> ChurnDetails:
        return cast(ChurnDetails, decode_details(Kind.CHURN, details))


@dataclass(frozen=True)
class JoinDetails:
    """``Kind.JOIN``: an agent entered the rendezvous."""

    host: str = ""
    nproc: int = 0

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> JoinDetails:
        return cast(JoinDetails, decode_details(Kind.JOIN, details))


@dataclass(frozen=True)
class StartDetails:
    """``Kind.START``: this agent's workers started, with these ranks."""

    ranks: tuple[int, ...] = ()

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> StartDetails:
        return cast(StartDetails, decode_details(Kind.START, details))


@dataclass(frozen=True)
class StopDetails:
    """``Kind.RESTART``, ``Kind.LEAVE`` and ``Kind.ERROR``: why this agent's workers stopped,
    or why it left (and with which exit code)."""

    reason: str = ""
    exit_code: int | None = None

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> StopDetails:
        return cast(StopDetails, decode_details(Kind.LEAVE, details))


@dataclass(frozen=True)
class NodesDetails:
    """``Kind.NODE_LOST`` and ``Kind.NODE_ARRIVED``: the slots (or node ids) concerned."""

    nodes: tuple[str, ...] = ()

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> NodesDetails:
        return cast(NodesDetails, decode_details(Kind.NODE_LOST, details))


def _details(cls: type[Any], table: dict[str, Check]) -> Check:
    """A kind's details: the table's fields, each optional, others left alone."""
    return record(cls, table, defaults=True, others=True)


_RANK = optional(whole(0))
_STOP = _details(StopDetails, {"reason": text(), "exit_code": optional(whole(0))})
_NODES = _details(NodesDetails, {"nodes": tuple_of(text())})
DETAILS: dict[str, Check] = {
    Kind.ROUND: _details(
        RoundDetails,
        {
            "world_size": whole(0),
            "members": tuple_of(text()),
            "restarts_used": whole(0),
            "member_count": whole(0),
        },
    ),
    Kind.FAILURE: _details(
        FailureDetails,
        {
            "rank": _RANK,
            "exit_code": optional(whole(0)),
            "signal": optional(text()),
            "message": text(),
            "hung": flag,
            "sentence": text(),
            "node_fault": flag,
        },
    ),
    Kind.HANG: _details(
        HangDetails,
        {
            "investigation": whole(0),
            "verdict": text(),
            "rank": _RANK,
            "culprit_slot": text(),
            "sentence": text(),
            "evidence": mapping_of(text()),
            "logs": mapping_of(text()),
        },
    ),
    Kind.FAILED: _details(FailedDetails, {"reason": text()}),
    Kind.CHECKPOINT: _details(CheckpointDetails, {"step": _RANK, "path": text()}),
    Kind.CHECKPOINT_LOADED: _details(LoadedDetails, {"step": _RANK, "tier": text(), "rank": _RANK}),
    Kind.CHURN: _details(ChurnDetails, {"action": text(), "target": text()}),
    Kind.JOIN: _details(JoinDetails, {"host": text(), "nproc": whole(0)}),
    Kind.START: _details(StartDetails, {"ranks": tuple_of(whole(0))}),
    Kind.RESTART: _STOP,
    Kind.LEAVE: _STOP,
    Kind.ERROR: _STOP,
    Kind.NODE_LOST: _NODES,
    Kind.NODE_ARRIVED: _NODES,
}
"""Each kind whose details a reader looks into, and the table they are decoded by; the
details of other kinds are shown as they are (``ops/timeline.describe``)."""
