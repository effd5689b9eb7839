"""Who hung: the rank that stopped, never a rank that waits for it (docs/unattended.md).

When one rank stops, every other rank of the job soon waits for it in a collective, on every
node, and every agent sees its ranks make no progress: the first agent whose deadline passes
is as likely to hold a waiting rank as the stopped one. So no agent blames a rank on its
deadline alone. Each agent that takes part in a hang's investigation shares what it saw of
its own ranks (``NodeEvidence``) through the rendezvous, and the verdict is a pure function
of every node's evidence (``attribute``), agreed once for the whole job.

What one rank's evidence says, read before the agent touches the rank:

* its state in ``/proc`` (``T``: stopped, ``D``: uninterruptible sleep): such a rank cannot
  answer, and is the culprit;
* its collective marker (``train/heartbeat.py``): inside a collective, or out of any;
* its stack, from the faulthandler dump the agent asks for: the main thread in
  ``torch.distributed`` or in ``backward`` (DDP's gradient all-reduce) waits for its peers; a
  rank that does not answer the dump signal at all is the culprit;
* how long it made no progress, with the time it waited for a CPU discounted (``age``).

Nothing here reads a clock, a file or a process: the investigation (``agent/investigation``)
gathers the evidence, these rules decide, so every case is a unit test.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hpc_elastic.decoding import (
    Check,
    JsonRecord,
    flag,
    mapping_of,
    one_of,
    optional,
    record,
    seconds,
    text,
    tuple_of,
    whole,
)
from hpc_elastic.errors import AgentError

logger = logging.getLogger(__name__)

PROGRESS_SHARE = 0.5
"""A rank outside any collective that made progress within this share of its deadline is
still moving (slow, on a busy machine), and the investigation is dismissed: the others wait
for a rank that will come. A rank frozen in a collective's lockstep stopped beating at most a
step before the others, far less than half a deadline (at least five steps)."""

SPIN_STEPS = 5.0
SPIN_FLOOR = 0.5
"""A rank that used more than ``SPIN_STEPS`` times the CPU of its costliest steps, and at
least ``SPIN_FLOOR`` CPU seconds, without a step spins (``RankEvidence.spinning``)."""

EXCUSES = 2.0
"""A stalled rank is waited for at most this many deadlines (its wait counted as against the
deadline) before its stack is asked for: one investigation may be dismissed for a slow rank,
not every one."""

BLOCKING = ("futex", "poll", "select", "sk_wait", "recv", "wait_woken", "unix_stream", "pipe")
"""Kernel functions (``/proc/PID/wchan``) a thread sleeps in until an event comes."""

STOPPED = "T"
TRACED = "t"
DISK = "D"
EXITED = "exited"
"""The process had ended when its agent looked (its exit code says how)."""
FINISHED = "finished"
"""Its training loop said it is over (``heartbeat.FINISHED``): not timed, never blamed."""
UNKNOWN = "?"

SAVE_PHASE = "checkpoint"
"""``watchdog.Phase.CHECKPOINT``'s value, as a suspicion carries it (a plain string here: the
rules never import the watchdog)."""


@dataclass(frozen=True)
class RankEvidence:
    """What one rank's agent saw of it."""

    rank: int
    state: str = UNKNOWN
    """The ``/proc`` state letter before the agent froze the rank (R, S, D, T, ...), or
    ``EXITED``, ``FINISHED``, ``UNKNOWN``."""
    age: float = 0.0
    """Seconds since it last made progress (its heartbeat), less the time it waited for a CPU
    and the time its agent was not scheduled: what the deadline is compared with."""
    waited: float = 0.0
    """Wall seconds since it last made progress."""
    cpu: float | None = None
    """CPU seconds it used since it last made progress."""
    cpu_per_step: float | None = None
    """The most CPU seconds one of its steps took so far (99th percentile)."""
    wchan: str | None = None
    """The kernel function its main thread slept in (``/proc/PID/wchan``), None if running."""
    deadline: float = 0.0
    phase: str = "step"
    marker: str | None = None
    """Its collective marker: "in all_reduce #12" or "out all_reduce #12"; None when it never
    marked one (a script that uses neither the training helpers nor ``collective``)."""
    inside: bool | None = None
    """The marker's word: in a collective (True), out of any (False), or no marker (None)."""
    stack: str | None = None
    """Where its main thread was in the dump it printed: "train.py:42 in step"."""
    waits_in: str | None = None
    """The collective its stack waits in ("all_reduce", "backward"); None when the stack is
    the rank's own code, or unknown."""
    dumped: bool | None = None
    """None: not asked for its stack yet; True: it printed a dump or died of the signal;
    False: still alive, printing nothing, after the dump deadline (it cannot answer)."""
    exit_code: int | None = None
    echo: bool = False
    """It exited because a peer vanished (``rootcause.is_echo``): it was in a collective."""

    @property
    def in_collective(self) -> bool | None:
        """Whether it waits in a collective; None when nothing tells.

        A marker that says "in" is the rank's own word. One that says "out" only says that no
        *marked* collective is under way: DDP's gradient all-reduce runs unmarked inside
        ``backward()``, so the stack, once there is one, has the last word."""
        if self.state == EXITED:
            return True if self.echo else None
        if self.inside:
            return True
        if self.dumped and self.stack is not None:
            return self.waits_in is not None
        return self.inside

    @property
    def collective(self) -> str:
        """The collective it waits in, for a sentence: its marker's, else its stack's."""
        if self.inside and self.marker:
            return self.marker.removeprefix("in ")
        return self.waits_in or "a collective"

    @property
    def stuck(self) -> str | None:
        """Why it cannot answer (stopped, in uninterruptible sleep, silent to the dump
        signal), or None."""
        if self.state in (STOPPED, TRACED):
            return f"stopped (state {self.state})"
        if self.state == DISK:
            return "in uninterruptible sleep (state D)"
        if self.dumped is False:
            return "silent to the stack-dump signal"
        return None

    @property
    def blocked_on_an_event(self) -> bool:
        """Asleep in the kernel until something happens (a lock, a socket): as a rank waiting
        in a collective is, and unlike one in ``sleep`` or one that runs. Its marker may still
        say "out": DDP's gradient all-reduce is waited for, unmarked, in ``backward()``."""
        return self.state == "S" and any(word in (self.wchan or "") for word in BLOCKING)

    @property
    def timed(self) -> bool:
        """Whether it was still at work (not finished, not exited cleanly)."""
        return self.state != FINISHED and not (self.state == EXITED and self.exit_code == 0)

    @property
    def spinning(self) -> bool:
        """It used many steps' worth of CPU (``SPIN_STEPS``, at least ``SPIN_FLOOR`` s) since
        it last made progress: a loop that never ends, however little CPU a busy machine
        gives it. A slow rank on that machine uses a step's CPU, then beats."""
        if self.cpu is None or self.cpu_per_step is None:
            return False
        return self.cpu > max(SPIN_STEPS * self.cpu_per_step, SPIN_FLOOR)

    @property
    def moving(self) -> bool:
        """Still making progress: outside any collective (as far as is known), able to
        answer, not spinning, and beaten within ``PROGRESS_SHARE`` of its deadline (its wait
        counted without the time it waited for a CPU)."""
        return (
            self.timed
            and self.state not in (EXITED, UNKNOWN)
            and self.stuck is None
            and self.in_collective is not True
            and not self.spinning
            and self.age < self.deadline * PROGRESS_SHARE
        )


@dataclass(frozen=True)
class Suspicion:
    """The local hang that made an agent open (or join) the investigation."""

    rank: int
    phase: str
    waited: float
    """Wall seconds since the rank's last progress."""
    deadline: float
    overridden: bool = False
    """The deadline is ``--hang-timeout``, not learned."""

    def clause(self) -> str:
        if self.phase == SAVE_PHASE:
            # A save that hangs has its own words: what to look at is the storage, not a step.
            how = "--hang-timeout" if self.overridden else "learned save deadline"
            return (
                f"the job hung in a checkpoint save: no progress for {self.waited:.1f} s while "
                f"saving ({how} {self.deadline:.1f} s)"
            )
        how = "--hang-timeout" if self.overridden else "learned deadline"
        return (
            f"the job made no progress for {self.waited:.1f} s in {self.phase} "
            f"({how} {self.deadline:.1f} s)"
        )


@dataclass(frozen=True)
class NodeEvidence:
    """What one agent shares of a hang: its ranks' evidence, and its own suspicion."""

    node_id: str
    slot: str
    ranks: tuple[RankEvidence, ...] = ()
    stage: int = 1
    """1: read without touching the ranks (states, markers, ages); 2: stacks too."""
    suspicion: Suspicion | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> NodeEvidence:
        """The evidence in ``data``, each field of its type (``EVIDENCE_FIELDS``), or one
        ``AgentError`` sentence naming the field and its value."""
        return _EVIDENCE.decode(data)

    @classmethod
    def decode(cls, data: bytes, where: str = "a hang note") -> NodeEvidence | None:
        """``parse``, or None for a note that is not evidence of this version: one warning,
        and the note is left out (its node counts as not answering), never a crash of the
        investigation, nor a rule run on a value of the wrong type."""
        try:
            return cls.parse(data)
        except AgentError as error:
            _warn_once(data, where, error)
            return None


@dataclass(frozen=True)
class Member:
    """One node of the round, as the verdict needs it: its ranks and how to name it."""

    node_id: str
    slot: str
    first_rank: int
    nproc: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)


@dataclass(frozen=True)
class Verdict:
    """The investigation's answer, agreed once for the whole job."""

    kind: str
    """``CULPRIT``, ``AMBIGUOUS`` or ``DISMISSED``."""
    sentence: str
    reporter: str
    """The node whose agent records the failure: the culprit's, else the first member that
    answered; every other agent only rejoins."""
    rank: int | None = None
    node_id: str = ""
    slot: str = ""
    evidence: dict[str, str] = field(default_factory=dict)
    """One line per rank the verdict rests on, for ``events``."""

    @property
    def blames_a_node(self) -> bool:
        """Only a culprit counts against its node (bad-node memory, exclusion)."""
        return self.kind == CULPRIT

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> Verdict:
        """The verdict in ``data``, each field of its type (``VERDICT_FIELDS``), or one
        ``AgentError`` sentence naming the field and its value."""
        return _VERDICT.decode(data)

    @classmethod
    def decode(cls, data: bytes, where: str = "a hang verdict") -> Verdict | None:
        """``parse``, or None (with one warning) for a verdict this version cannot read."""
        try:
            return cls.parse(data)
        except AgentError as error:
            _warn_once(data, where, error)
            return None


CULPRIT = "culprit"
AMBIGUOUS = "ambiguous"
DISMISSED = "dismissed"

# --- decoding what other agents shared ---------------------------------------------------------

RANK_FIELDS: dict[str, Check] = {
    "rank": whole(0),
    "state": text(),
    "age": seconds,
    "waited": seconds,
    "cpu": optional(seconds),
    "cpu_per_step": optional(seconds),
    "wchan": optional(text()),
    "deadline": seconds,
    "phase": text(),
    "marker": optional(text()),
    "inside": optional(flag),
    "stack": optional(text()),
    "waits_in": optional(text()),
    "dumped": optional(flag),
    "exit_code": optional(whole(-255, 255)),
    "echo": flag,
}
"""``RankEvidence``'s fields (``hpc_elastic.decoding``): durations are finite and never
negative (a NaN age would make every comparison false: never moving, never past its
deadline), a flag is a JSON boolean (``"false"`` is true to Python), an exit code is a
``Popen`` return code (negative: the signal)."""

SUSPICION_FIELDS: dict[str, Check] = {
    "rank": whole(0),
    "phase": text(),
    "waited": seconds,
    "deadline": seconds,
    "overridden": flag,
}

EVIDENCE_FIELDS: dict[str, Check] = {
    "node_id": text(empty=False),
    "slot": text(),
    "ranks": tuple_of(record(RankEvidence, RANK_FIELDS, defaults=True)),
    "stage": whole(1, 2),
    "suspicion": optional(record(Suspicion, SUSPICION_FIELDS, defaults=True)),
}
"""``NodeEvidence``'s fields; a field a newer version added is refused (the note is left out),
one an older version did not write takes its default."""

VERDICT_FIELDS: dict[str, Check] = {
    "kind": one_of((CULPRIT, AMBIGUOUS, DISMISSED)),
    "sentence": text(),
    "reporter": text(),
    "rank": optional(whole(0)),
    "node_id": text(),
    "slot": text(),
    "evidence": mapping_of(text()),
}

_EVIDENCE = JsonRecord(
    NodeEvidence,
    EVIDENCE_FIELDS,
    AgentError,
    "The hang evidence {subject} is not what this agent shares ({why}); run the same "
    "hpc-elastic version on every node.",
    defaults=True,
)
_VERDICT = JsonRecord(
    Verdict,
    VERDICT_FIELDS,
    AgentError,
    "The hang verdict {subject} is not one this agent agrees on ({why}); run the same "
    "hpc-elastic version on every node.",
    defaults=True,
)

WARNED_KEPT = 64
"""Malformed notes remembered, so each is warned about once: an agent reads the same note at
every poll of an investigation it has not joined yet, and again at each stage."""
_warned: OrderedDict[bytes, None] = OrderedDict()


def _warn_once(data: bytes, where: str, error: AgentError) -> None:
    """Warn that the note ``data`` (read from ``where``) is ignored, once per note: logging
    state only, no rule reads it."""
    key = hashlib.sha256(where.encode() + b"\0" + data).digest()
    if key in _warned:
        logger.debug("hangs: %s is still unreadable", where)
        return
    _warned[key] = None
    while len(_warned) > WARNED_KEPT:
        _warned.popitem(last=False)
    logger.warning("Ignoring %s: %s", where, error)


def first_look(evidence: Mapping[str, NodeEvidence], members: Sequence[Member]) -> Verdict | None:
    """After stage 1 (no rank touched yet): a ``DISMISSED`` verdict when the job is still
    moving, else None: the stacks are needed. It is moving when some rank still makes
    progress, and every rank that does not may be waiting for it: inside a collective by its
    marker, or blocked on an event in the kernel (``blocked_on_an_event``; a rank in ``sleep``
    or spinning in its own code is not), and none has stalled ``EXCUSES`` deadlines (one
    dismissal for a slow rank, not one per deadline for ever). A rank stalled outside any
    collective may be stuck on its own, whatever the others do (ranks that train without
    collectives): only its stack can tell."""
    ranks = _ranks(evidence)
    moving = [rank for rank in ranks if rank.moving]
    stalled = [rank for rank in ranks if rank.timed and not rank.moving]
    if not moving or not all(_may_wait(rank) for rank in stalled):
        return None
    slowest = moving[0]
    sentence = (
        f"No hang: rank {slowest.rank} still made progress {slowest.age:.1f} s ago (deadline "
        f"{slowest.deadline:.1f} s) while the others waited; the machine is busy."
    )
    return Verdict(DISMISSED, sentence, _first_answering(evidence, members), rank=slowest.rank)


def _may_wait(rank: RankEvidence) -> bool:
    """Whether a stalled rank may be waiting for a slow peer, and may be waited for more."""
    waiting = rank.in_collective is True or rank.blocked_on_an_event
    return waiting and rank.stuck is None and rank.age < EXCUSES * rank.deadline


def attribute(evidence: Mapping[str, NodeEvidence], members: Sequence[Member]) -> Verdict:
    """The culprit, or ``AMBIGUOUS``: the rule of docs/unattended.md, "Who hung".

    1. A rank that cannot answer (stopped, in uninterruptible sleep, silent to the dump
       signal) is the culprit.
    2. Else, a rank out of every collective while others wait in one is the culprit: it
       never entered the collective they wait in.
    3. Else (everyone waits, or what would tell is missing) nobody can be blamed.

    Culprits on more than one node are ambiguous too: no single node is at fault.
    """
    ranks = _ranks(evidence)
    known = {rank.rank for rank in ranks}
    unanswered = [r for member in members for r in member.ranks if r not in known]
    waiting = [rank for rank in ranks if rank.timed and rank.in_collective is True]
    stuck = [rank for rank in ranks if rank.timed and rank.stuck is not None]
    caught = _caught(evidence, members)
    reporter = _first_answering(evidence, members)
    lines = {str(rank.rank): describe(rank) for rank in ranks}
    if stuck:
        return _blame(stuck, waiting, members, caught, lines, how="stuck", reporter=reporter)
    # A rank still moving (it beat within half its deadline) is slow, not stuck: never blamed.
    moving = [rank for rank in ranks if rank.moving]
    outside = [
        rank
        for rank in ranks
        if rank.timed and rank.in_collective is False and rank.state != EXITED and not rank.moving
    ]
    if outside and waiting:
        return _blame(outside, waiting, members, caught, lines, how="outside", reporter=reporter)
    if outside and not unanswered and not _unknown(ranks):
        # Nobody waits in a collective: the ranks are stuck in their own code.
        return _blame(outside, [], members, caught, lines, how="alone", reporter=reporter)
    sentence = _ambiguous(
        waiting, outside=outside, moving=moving, ranks=ranks, unanswered=unanswered, caught=caught
    )
    return Verdict(AMBIGUOUS, sentence, reporter, evidence=lines)


def _blame(
    culprits: list[RankEvidence],
    waiting: list[RankEvidence],
    members: Sequence[Member],
    caught: str,
    lines: dict[str, str],
    *,
    how: str,
    reporter: str,
) -> Verdict:
    # A rank stopped inside a collective waits there too, by its stack: it is not a waiter.
    blamed = {rank.rank for rank in culprits}
    waiting = [rank for rank in waiting if rank.rank not in blamed]
    nodes = {_member_of(rank.rank, members) for rank in culprits}
    if len(nodes) > 1 or None in nodes:
        named = _and([f"{rank.rank} ({_slot(rank.rank, members)})" for rank in culprits])
        sentence = (
            f"Ranks {named} on different nodes were each {_what(culprits[0], how)}, so no "
            f"single node can be blamed; {caught}."
        )
        return Verdict(AMBIGUOUS, sentence, reporter, evidence=lines)
    member = next(iter(nodes))
    assert member is not None
    first = culprits[0]
    also = culprits[1:]
    place = f"node '{member.slot or member.node_id}'"  # "on node '3'", not "on 3": a slot
    who = f"Rank {first.rank} on {place}"
    if also:
        who = f"Ranks {_and([str(rank.rank) for rank in culprits])} on {place}"
    sentence = f"{who} {'were' if also else 'was'} {_what(first, how)}"
    if waiting:
        sentence += f" while {_waiters(waiting)} for {'them' if also else 'it'}"
    where = f"; it hung in {first.stack}" if first.stack and how != "stuck" else ""
    sentence += f"{where}; {caught}."
    return Verdict(
        CULPRIT,
        sentence,
        member.node_id,
        rank=first.rank,
        node_id=member.node_id,
        slot=member.slot,
        evidence=lines,
    )


def _what(rank: RankEvidence, how: str) -> str:
    if how == "stuck":
        return rank.stuck or "stuck"
    if how == "outside":
        return "outside every collective"
    return "stuck in its own code, in no collective"


def _ambiguous(
    waiting: list[RankEvidence],
    *,
    outside: list[RankEvidence],
    moving: list[RankEvidence],
    ranks: list[RankEvidence],
    unanswered: list[int],
    caught: str,
) -> str:
    parts = []
    if waiting:
        parts.append(f"{_waiters(waiting)} for a rank that never arrived")
    silent = [rank.rank for rank in ranks if rank.timed and rank.in_collective is None]
    if unanswered:
        parts.append(f"{_ranks_word(unanswered)} did not answer")
    if silent:
        parts.append(f"{_ranks_word(silent)} left no marker and no stack to tell")
    if outside:
        parts.append(f"{_ranks_word([rank.rank for rank in outside])} made no progress either")
    if moving:
        ages = _and([f"{rank.rank} ({rank.age:.1f} s ago)" for rank in moving])
        parts.append(f"{'rank' if len(moving) == 1 else 'ranks'} {ages} still made progress")
    if waiting and not unanswered and not silent and not outside and not moving:
        parts = [f"every rank waited in a collective its peers never joined ({_waiters(waiting)})"]
    if not parts:
        parts.append("no rank could be told apart")
    text = "; ".join(parts)
    return f"{text[0].upper()}{text[1:]}; no rank can be blamed; {caught}."


def _waiters(waiting: list[RankEvidence]) -> str:
    """ "ranks 0 and 3 waited in all_reduce" or "rank 0 waited in all_reduce #5 and ranks 1
    and 2 in backward"."""
    by_collective: dict[str, list[int]] = {}
    for rank in waiting:
        by_collective.setdefault(rank.collective, []).append(rank.rank)
    groups = [f"{_ranks_word(ranks)} {{verb}}in {name}" for name, ranks in by_collective.items()]
    first, *rest = groups
    return _and([first.format(verb="waited "), *(group.format(verb="") for group in rest)])


def _caught(evidence: Mapping[str, NodeEvidence], members: Sequence[Member]) -> str:
    """What caught the hang: the first member's suspicion, in node order."""
    for member in members:
        node = evidence.get(member.node_id)
        if node is not None and node.suspicion is not None:
            return node.suspicion.clause()
    suspicions = [node.suspicion for node in evidence.values() if node.suspicion is not None]
    return suspicions[0].clause() if suspicions else "the job made no progress"


def _first_answering(evidence: Mapping[str, NodeEvidence], members: Sequence[Member]) -> str:
    for member in members:
        if member.node_id in evidence:
            return member.node_id
    return min(evidence, default="")


def _ranks(evidence: Mapping[str, NodeEvidence]) -> list[RankEvidence]:
    return sorted((rank for node in evidence.values() for rank in node.ranks), key=_rank_key)


def _rank_key(rank: RankEvidence) -> int:
    return rank.rank


def _unknown(ranks: Iterable[RankEvidence]) -> bool:
    return any(rank.timed and rank.in_collective is None for rank in ranks)


def _member_of(rank: int, members: Sequence[Member]) -> Member | None:
    return next((member for member in members if rank in member.ranks), None)


def _slot(rank: int, members: Sequence[Member]) -> str:
    member = _member_of(rank, members)
    return "an unknown node" if member is None else f"node '{member.slot or member.node_id}'"


def _ranks_word(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_and([str(r) for r in ranks])}"


def _and(words: Sequence[str]) -> str:
    if len(words) <= 1:
        return "".join(words)
    return f"{', '.join(words[:-1])} and {words[-1]}"


def describe(rank: RankEvidence) -> str:
    """One rank's evidence in a few words, for ``events``: "state T, marker in all_reduce #12,
    stack train.py:42 in step, no progress for 61.0 s"."""
    words = [f"state {rank.state}"]
    if rank.exit_code is not None:
        words.append(f"exit code {rank.exit_code}{' (a peer vanished)' if rank.echo else ''}")
    if rank.marker is not None:
        words.append(f"marker {rank.marker}")
    if rank.dumped is False:
        words.append("no answer to the dump signal")
    elif rank.stack is not None:
        waits = f" (waits in {rank.waits_in})" if rank.waits_in else ""
        words.append(f"stack {rank.stack}{waits}")
    elif rank.dumped:
        words.append("no stack dump")
    if rank.timed and rank.state != EXITED:
        counted = f"{rank.age:.1f} s counted"
        words.append(f"no progress for {rank.waited:.1f} s ({counted}) of {rank.deadline:.1f} s")
        if rank.cpu is not None:
            per_step = (
                "" if rank.cpu_per_step is None else f" (a step takes {rank.cpu_per_step:.3f} s)"
            )
            words.append(f"{rank.cpu:.2f} s of CPU since{per_step}")
    return ", ".join(words)


def with_stage(node: NodeEvidence, ranks: Iterable[RankEvidence], stage: int) -> NodeEvidence:
    """``node`` with new rank evidence, at ``stage``."""
    return replace(node, ranks=tuple(sorted(ranks, key=_rank_key)), stage=stage)


def as_json(value: Any) -> Any:
    """A verdict or evidence as plain JSON values, for an event's details."""
    return json.loads(json.dumps(asdict(value)))
