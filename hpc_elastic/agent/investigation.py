"""One agent's part in a hang's investigation: gather, share, wait, agree (docs/unattended.md).

The rules are ``agent/hangs.py``; this module acts on them. Every agent of the round takes part
as soon as one of them opens an investigation (its ranks passed their deadline) or sees one
opened by another, and all follow the same two stages, so that no rank is touched before
every node has looked at its own:

1. **Look without touching.** Each rank's ``/proc`` state, collective marker and time without
   progress are read, then the rank is frozen (SIGSTOP), so that none moves on, or dies of a
   peer's death, while the others are still looked at. The evidence is shared; once every
   member's is in (or ``EVIDENCE_WAIT`` has passed), ``hangs.first_look`` says whether the job
   is in fact still moving. That answer is agreed once for the job: when dismissed, every
   agent thaws its ranks (SIGCONT) and training goes on.
2. **Stacks.** Each agent asks its ranks for their stacks (SIGABRT, then SIGCONT: faulthandler
   prints every thread into the rank's log, and the rank dies), reads where each main thread
   was, shares again, and once every member's is in the verdict (``hangs.attribute``) is
   agreed once for the job: every agent acts on the same culprit, or on "ambiguous".

Each answer is proposed by the first member in the round's order, as soon as every member's
evidence is in; every other one waits for it up to ``EVIDENCE_WAIT`` and its own turn
(``handler.turn``: a tenth of a second a place, in case those before it are gone) and then
reads the one answer. Every member reading every member's evidence to propose its own was N²
reads: 16.7 million at 4,096 nodes, at the same moment. Only the first member follows who
shared (``Rendezvous.sharers``); the others watch for the answer's topic alone, so a burst of
evidence is listed by one connection, not by every connection of the job.

Keys in the rendezvous' notes: ``hang-<round>-<n>.look`` and ``.stacks`` (each node's
evidence), ``.first`` and ``.verdict`` (the agreed answers).

Every request to the store goes ``through`` the agent's interruptible wait
(``Agent._interruptibly``): kazoo holds a request until the connection comes back, for ever
with a dead ensemble, and an investigation that made its requests on the agent's own thread
kept a stop signal and the outage limit (``--zk-outage-limit``) from ending the agent. A
signal or the limit ends the investigation with the wait's own exception; no rank is left
frozen.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol, TypeVar

from hpc_elastic.agent import hangs, proc, rootcause
from hpc_elastic.agent.watchdog import Hung
from hpc_elastic.agent.workers import Worker, WorkerGroup
from hpc_elastic.protocol import heartbeat
from hpc_elastic.rendezvous.api import Rendezvous, Round
from hpc_elastic.rendezvous.handler import turn

log = logging.getLogger(__name__)

T = TypeVar("T")


class Through(Protocol):
    """How a store request is waited for: ``Agent._interruptibly``, which runs it on a helper
    thread and raises on a stop signal or past the outage limit."""

    def __call__(self, call: Callable[[], T], /) -> T: ...


def directly(call: Callable[[], T]) -> T:
    """A request made on the caller's thread: for tests of the rules without an agent."""
    return call()


EVIDENCE_WAIT = 30.0
"""Seconds an agent waits, at each stage, for every other member's evidence. A live agent
answers within a poll or two; one that does not (gone, cut off) is reported as "did not
answer" and its ranks are never blamed for it: waiting longer only delays the restart."""

STACK_DUMP_DEADLINE = 5.0
"""Seconds a rank gets to print its stacks after the SIGABRT: faulthandler takes milliseconds,
but a rank that also writes a core file would hold the restart up."""

DUMP_PATIENCE = 30.0
"""The most a rank that waits for a CPU (it queued since the signal: the machine is busy) gets
to print its stacks, before it counts as silent: a busy machine must not make a rank that
answers look like one that cannot."""

MESSAGE_BOUND = 2000
"""Characters of a hang's failure message kept in the rendezvous state (as for any failure)."""

LOOK, FIRST, STACKS, VERDICT = "look", "first", "stacks", "verdict"
GO_ON = b"stacks"
"""The agreed answer of stage 1 when nothing was dismissed: go on to the stacks."""


TOPICS = "hang-"
"""What every investigation's topic starts with: ``hang-<round>-<n>.<part>``."""


def topic_prefix(round_number: int) -> str:
    return f"{TOPICS}{round_number}-"


def topic(round_number: int, number: int, part: str) -> str:
    return f"{topic_prefix(round_number)}{number}.{part}"


def members_of(rdzv_round: Round) -> list[hangs.Member]:
    """The round's nodes in node-rank order, with their ranks."""
    members = []
    for member in rdzv_round.members:
        first = rdzv_round.first_rank(member.node_id)
        members.append(hangs.Member(member.node_id, member.slot, first, member.nproc))
    return members


def unanswered(
    rdzv: Rendezvous, round_number: int, answered: set[int], through: Through = directly
) -> int | None:
    """An investigation of this round that another agent opened and this one has not taken
    part in, and that is not over; None if there is none. From the notes the store pushed (no
    request), but for an investigation whose first answer is in (asked ``through``): a
    dismissed one is over, and is added to ``answered``."""
    topics = rdzv.topics(topic_prefix(round_number))
    for number in sorted(_numbers(topics, round_number) - answered):
        if topic(round_number, number, VERDICT) in topics:
            continue  # over: the round ends with it
        first_topic = topic(round_number, number, FIRST)
        first = through(partial(rdzv.agreed, first_topic)) if first_topic in topics else None
        where = f"the first answer agreed on '{first_topic}'"
        verdict = hangs.Verdict.decode(first, where) if first not in (None, GO_ON) else None
        if verdict is not None and verdict.kind == hangs.DISMISSED:
            answered.add(number)
            continue
        return number
    return None


def _numbers(topics: Iterable[str], round_number: int) -> set[int]:
    numbers = set()
    for name in topics:
        number, _, _ = name.removeprefix(topic_prefix(round_number)).partition(".")
        if number.isascii() and number.isdigit():
            numbers.add(int(number))
    return numbers


def next_number(rdzv: Rendezvous, round_number: int) -> int:
    """The number a new investigation of this round takes: one past the highest seen."""
    return max(_numbers(rdzv.topics(topic_prefix(round_number)), round_number), default=0) + 1


def past_topics(rdzv: Rendezvous, rdzv_round: Round) -> list[str]:
    """The topics of the investigations of rounds before the last one, when this node is the
    round's first member (group rank 0), which alone forgets them (``Rendezvous.forget``):
    an investigation holds every member's evidence twice (about 20 MB at 4,096 nodes), which
    would otherwise stay on the ensemble until the job closes, and a week of hourly hangs
    would outgrow its heap. The last round's are kept: an agent leaving it may still read
    its verdict. From the topics the store pushed: no request."""
    if rdzv_round.group_rank(rdzv.node.node_id) != 0:
        return []
    return sorted(
        name
        for name in rdzv.topics(TOPICS)
        if (number := _round_of(name)) is not None and number < rdzv_round.number - 1
    )


def _round_of(name: str) -> int | None:
    number, dash, _ = name.removeprefix(TOPICS).partition("-")
    return int(number) if dash and number.isascii() and number.isdigit() else None


@dataclass(frozen=True)
class Finding:
    """How an investigation ended for this agent."""

    verdict: hangs.Verdict
    evidence: hangs.NodeEvidence
    """This node's, at the last stage it reached."""
    number: int


@dataclass
class Investigation:
    """This agent's part in investigation ``number`` of the round (see the module docstring)."""

    rdzv: Rendezvous
    rdzv_round: Round
    group: WorkerGroup
    number: int
    waits: Mapping[int, Hung]
    """``RankWatch``'s wait of every timed local rank."""
    suspicion: hangs.Suspicion | None
    poll_interval: float
    interrupted: Callable[[], bool]
    """A stop signal came: give up (the ranks are thawed by the drain that follows)."""
    say: Callable[[str], None] = log.info
    keep_alive: Callable[[], None] = lambda: None
    """Called at every poll while waiting: the agent renews its workers' lease, or a rank
    thawed after a dismissal would fence itself at its next step (its lease gone stale)."""
    through: Through = directly
    """How each store request is waited for (see the module docstring)."""
    _frozen: list[Worker] = field(default_factory=list)

    @property
    def members(self) -> list[hangs.Member]:
        return members_of(self.rdzv_round)

    def run(self) -> Finding | None:
        """Both stages; None when the investigation was given up before any rank was harmed
        (a stop signal, or the round changed under it): the caller's next poll acts on that.
        A request given up on (``through``'s exception) thaws the ranks and is raised."""
        try:
            return self._run()
        except BaseException:
            self._thaw()  # the agent's drain signals them next: they must be able to save
            raise

    def _run(self) -> Finding | None:
        node = self.rdzv.node
        look = hangs.NodeEvidence(node.node_id, node.slot, tuple(self._look()), 1, self.suspicion)
        self._freeze()
        self._share(LOOK, look)
        log.debug("%s: hang %d: looked at %d rank(s)", node.node_id, self.number, len(look.ranks))
        if not self._wait_for(LOOK, FIRST, give_up_on_change=True):
            self._thaw()
            return None
        dismissed = self._first_look(look)
        if dismissed is not None:
            self._thaw()
            return Finding(dismissed, look, self.number)
        stacks = hangs.with_stage(look, self._stacks(look), 2)
        self._share(STACKS, stacks)
        self._wait_for(STACKS, VERDICT, give_up_on_change=False)
        return Finding(self._verdict(stacks), stacks, self.number)

    def _topic(self, part: str) -> str:
        return topic(self.rdzv_round.number, self.number, part)

    def _share(self, part: str, evidence: hangs.NodeEvidence) -> None:
        name, data = self._topic(part), evidence.encode()
        self.through(lambda: self.rdzv.share(name, data))

    def _agreed(self, part: str) -> bytes | None:
        name = self._topic(part)
        return self.through(lambda: self.rdzv.agreed(name))

    def _awaited(self, part: str) -> bytes | None:
        """The answer agreed on ``part``, waited for up to this node's turn to propose it
        (None: nobody before it proposed). The wait makes no request: the store pushes the
        topics, and the answer is read once its topic is there."""
        agreed, place = self._topic(part), self.rdzv_round.group_rank(self.rdzv.node.node_id)
        ends = time.monotonic() + turn(place)
        while agreed not in self.rdzv.topics(self._topic("")):
            if time.monotonic() >= ends or self.interrupted():
                break
            self.rdzv.check_reach()
            self.keep_alive()
            time.sleep(self.poll_interval)
        return self._agreed(part)

    def _agree(self, part: str, proposal: bytes) -> bytes:
        name = self._topic(part)
        return self.through(lambda: self.rdzv.agree(name, proposal))

    # --- stage 1 --------------------------------------------------------------------------

    def _look(self) -> list[hangs.RankEvidence]:
        """Every local rank, read before anything is done to it."""
        return [self._rank(worker) for worker in self.group.workers]

    def _rank(self, worker: Worker) -> hangs.RankEvidence:
        code = worker.returncode
        if code is not None:
            echo = code != 0 and rootcause.died_of_a_peer(worker.paths.error_file, worker.paths.log)
            return hangs.RankEvidence(worker.rank, hangs.EXITED, exit_code=code, echo=echo)
        if heartbeat.finished(worker.paths.heartbeat):
            return hangs.RankEvidence(worker.rank, hangs.FINISHED)
        wait = self.waits.get(worker.rank)
        marker = heartbeat.read_collective(heartbeat.collective_path(worker.paths.heartbeat))
        if marker is not None and marker.pid != worker.process.pid:
            marker = None  # left by an earlier worker of this rank
        return hangs.RankEvidence(
            worker.rank,
            state=proc.state(worker.process.pid) or hangs.UNKNOWN,
            age=0.0 if wait is None else (wait.waited if wait.counted is None else wait.counted),
            waited=0.0 if wait is None else wait.waited,
            cpu=None if wait is None else wait.cpu,
            cpu_per_step=None if wait is None else wait.cpu_per_step,
            wchan=proc.wchan(worker.process.pid),
            deadline=0.0 if wait is None else wait.deadline,
            phase="startup" if wait is None else wait.phase.value,
            marker=None if marker is None else _marker_words(marker),
            inside=None if marker is None else marker.inside,
        )

    def _freeze(self) -> None:
        """SIGSTOP every running rank (its leader only, as for the dump): nothing moves on,
        and nothing dies of a peer's dump, until every node has looked at its own ranks."""
        for worker in self.group.running():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                worker.process.send_signal(signal.SIGSTOP)
                self._frozen.append(worker)

    def _thaw(self) -> None:
        for worker in self._frozen:
            if worker.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    worker.process.send_signal(signal.SIGCONT)
        self._frozen.clear()

    def _first_look(self, look: hangs.NodeEvidence) -> hangs.Verdict | None:
        """Stage 1's agreed answer: a DISMISSED verdict, or None: go on to the stacks."""
        answer = self._awaited(FIRST)
        if answer is None:
            evidence = self._shared(LOOK)
            evidence.setdefault(look.node_id, look)
            dismissed = hangs.first_look(evidence, self.members)
            proposal = GO_ON if dismissed is None else dismissed.encode()
            answer = self._agree(FIRST, proposal)
        where = f"the first answer agreed on '{self._topic(FIRST)}'"
        verdict = hangs.Verdict.decode(answer, where) if answer != GO_ON else None
        return verdict if verdict is not None and verdict.kind == hangs.DISMISSED else None

    # --- stage 2 --------------------------------------------------------------------------

    def _stacks(self, look: hangs.NodeEvidence) -> list[hangs.RankEvidence]:
        """Ask every frozen rank for its stack (it dies of it), then read what each printed."""
        by_rank = {worker.rank: worker for worker in self.group.workers}
        offsets = {w.rank: _size(w.paths.log) for w in self._frozen if w.returncode is None}
        self.say(
            f"A hang was caught; asking every local rank for its stacks (up to "
            f"{STACK_DUMP_DEADLINE:g} s) before killing them."
        )
        answered = _dump(self.group, offsets, self.interrupted)
        self._frozen.clear()
        ranks = []
        for rank in look.ranks:
            if rank.rank not in offsets:
                ranks.append(rank)
                continue
            dump = rootcause.dump_after(by_rank[rank.rank].paths.log, offsets[rank.rank])
            ranks.append(
                replace(
                    rank,
                    dumped=answered[rank.rank],
                    stack=None if dump is None else dump.where,
                    waits_in=None if dump is None else dump.waits_in,
                )
            )
        return ranks

    def _verdict(self, stacks: hangs.NodeEvidence) -> hangs.Verdict:
        """Stage 2's agreed verdict, from every member's evidence that came in time."""
        answer = self._awaited(VERDICT)
        if answer is None:
            evidence = self._shared(STACKS)
            evidence.setdefault(stacks.node_id, stacks)
            verdict = hangs.attribute(evidence, self.members)
            answer = self._agree(VERDICT, verdict.encode())
        where = f"the verdict agreed on '{self._topic(VERDICT)}' (this node decides alone)"
        agreed = hangs.Verdict.decode(answer, where)
        if agreed is None:  # a verdict this version cannot read: decide alone (warned once)
            return hangs.attribute(self._shared(STACKS), self.members)
        return agreed

    # --- waiting for the others -----------------------------------------------------------

    def _wait_for(self, part: str, answer: str, *, give_up_on_change: bool) -> bool:
        """Until someone agreed on ``answer``, or ``EVIDENCE_WAIT`` passed, or, for the first
        member in the round's order (who proposes the answer), every member shared on
        ``part``; False when given up (a stop signal; with ``give_up_on_change``, the round
        changed: a member left, or the job was failed). Cut off past the outage limit,
        ``check_reach`` raises, as the agent's own waits do.

        Only the first member follows who shared (``sharers``): the others wait for its answer
        alone, a topic every connection is told of. Every member following the evidence
        made every connection list thousands of notes again after each burst of them."""
        wanted = {member.node_id for member in self.rdzv_round.members}
        first = self.rdzv_round.group_rank(self.rdzv.node.node_id) == 0
        shared, agreed = self._topic(part), self._topic(answer)
        deadline = time.monotonic() + EVIDENCE_WAIT
        while True:
            if self.interrupted() or (give_up_on_change and self.rdzv.changed.is_set()):
                log.debug("hang %d: given up at %s", self.number, part)
                return False
            self.rdzv.check_reach()
            self.keep_alive()
            if agreed in self.rdzv.topics(self._topic("")):
                return True
            seen = self.rdzv.sharers(shared) if first else frozenset()
            if first and wanted <= seen:
                return True
            if time.monotonic() >= deadline:
                if first:
                    missing = sorted(wanted - seen)
                    log.debug("hang %d: no %s evidence from %s in time", self.number, part, missing)
                else:
                    log.debug("hang %d: no answer on %s in time", self.number, answer)
                return True
            time.sleep(self.poll_interval)

    def _shared(self, part: str) -> dict[str, hangs.NodeEvidence]:
        found = {}
        name = self._topic(part)
        for node_id, data in self.through(lambda: self.rdzv.shared(name)).items():
            where = f"the hang evidence of node '{node_id}' on '{self._topic(part)}'"
            evidence = hangs.NodeEvidence.decode(data, where)
            if evidence is not None and evidence.node_id == node_id:
                found[node_id] = evidence
            elif evidence is not None:
                log.warning(
                    "Ignoring %s: it names node '%s', not its writer", where, evidence.node_id
                )
        return found


def _marker_words(marker: heartbeat.Collective) -> str:
    return f"{'in' if marker.inside else 'out'} {marker.op} #{marker.seq}"


def _size(path: os.PathLike[str]) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _dump(
    group: WorkerGroup, offsets: Mapping[int, int], interrupted: Callable[[], bool] = lambda: False
) -> dict[int, bool]:
    """SIGABRT, then SIGCONT, each rank of ``offsets`` (its leader only: a DataLoader child's
    dump would bury the rank's), and wait until each died or began its dump: within
    ``STACK_DUMP_DEADLINE``, or ``DUMP_PATIENCE`` for a rank that waited for a CPU meanwhile.
    Then SIGKILL what is left. Which ranks answered (False: silent, alive and mute).

    A stop signal (``interrupted``) ends the waits at once: the ranks die of the dump anyway,
    and the agent leaves without a verdict, within its grace rather than after the patience."""
    asked = [worker for worker in group.workers if worker.rank in offsets]
    queued = {worker.rank: proc.queued(worker.process.pid) for worker in asked}
    for worker in asked:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            worker.process.send_signal(signal.SIGABRT)
            worker.process.send_signal(signal.SIGCONT)
    started = time.monotonic()
    answered: dict[int, bool] = {}
    while len(answered) < len(asked):
        if interrupted():
            for worker in asked:  # not judged: the investigation is given up
                answered.setdefault(worker.rank, worker.returncode is not None)
            break
        waited = time.monotonic() - started
        for worker in asked:
            if worker.rank in answered:
                continue
            if worker.returncode is not None or rootcause.printed_a_dump(
                worker.paths.log, offsets[worker.rank]
            ):
                answered[worker.rank] = True
            elif waited >= STACK_DUMP_DEADLINE and (
                waited >= DUMP_PATIENCE or not _queued_since(worker, queued[worker.rank])
            ):
                answered[worker.rank] = False
        time.sleep(0.02)
    # Those that began their dump get the rest of the deadline to finish it.
    deadline = started + STACK_DUMP_DEADLINE
    while any(w.returncode is None for w in asked if answered[w.rank]) and (
        time.monotonic() < deadline and not interrupted()
    ):
        time.sleep(0.02)
    log.debug(
        "hang dump: %s", {rank: "answered" if ok else "silent" for rank, ok in answered.items()}
    )
    group.stop(0.0, signal.SIGKILL)
    return answered


def _queued_since(worker: Worker, before: float | None) -> bool:
    """Whether the rank waited for a CPU since ``before`` was read: it is runnable, starved."""
    now = proc.queued(worker.process.pid)
    return before is not None and now is not None and now > before


def evidence_lines(evidence: hangs.NodeEvidence) -> dict[str, str]:
    """This node's ranks, one line each, for the ``hang`` event."""
    return {str(rank.rank): hangs.describe(rank)[:300] for rank in evidence.ranks}


def culprit_here(verdict: hangs.Verdict, node_id: str) -> bool:
    return verdict.kind == hangs.CULPRIT and verdict.node_id == node_id
