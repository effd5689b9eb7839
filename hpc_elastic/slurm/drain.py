"""Drained nodes under a running job: asked once per job per interval, left at a checkpoint.

Slurm drains a node (``scontrol update state=drain``: an admin's maintenance, a site health
check) or marks it failing (``state=fail``: expected to fail soon). No new job starts there; the
running ones run on until they end, which for an elastic job may be days. So a slot whose node
is drained leaves at the next checkpoint the job commits (nothing is redone: the stop signal's
own save is then one step after it), and its task requeues elsewhere; one on a failing node,
which may die any moment, leaves at once. The ``drain`` event gives the reason Slurm gives.

**One query per job per interval.** Asking Slurm from every agent would grow slurmctld's load
with the job's size. So one agent of the job asks: the lowest running slot, the same one that
releases held tasks (``queue.reports_held``), chosen from the squeue answers every agent
already has; it runs one ``sinfo -t drain,fail`` (whose answer lists the drained nodes of the
cluster, not its every node) at most every ``POLL_S`` and publishes it in the job directory
(``slots/drained.json``, ``JobDir.drained``). Every agent reads that file instead. Two agents
that briefly both think they are the lowest (squeue answers a second apart) make two queries
for that interval, never more; an agent that dies is replaced at the next squeue answer. A
board older than ``BOARD_MAX_AGE`` is not read: better to miss a drain for a while than to
leave a node its admin has resumed.

Everything here but ``DrainWatch`` is a pure rule or a file; ``DrainWatch`` is the thread that
acts on them.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path

from hpc_elastic import events
from hpc_elastic.errors import SlurmError
from hpc_elastic.events import CHECKPOINTS, Event, Kind
from hpc_elastic.slurm.commands import NodeDrain
from hpc_elastic.slurm.queue import publish

log = logging.getLogger(__name__)

POLL_S = 10.0
"""Seconds between two looks at the board by every agent, and two sinfo calls of the job."""
BOARD_MAX_AGE = 5 * POLL_S
"""A board older than this is stale: its writer is gone and no other agent took over yet."""
MIN_PATIENCE = 60.0
MAX_PATIENCE = 1800.0
"""How long a slot on a draining node waits for the next checkpoint: twice the job's recent
checkpoint interval, within these bounds (``patience``); then it leaves anyway, and the stop
signal's own save keeps the work."""
URGENT_STATES = ("fail", "failing")
"""States in which the node may die any moment: the slot leaves at once, without waiting."""


@dataclass(frozen=True)
class Board:
    """What the job's polling agent last heard from Slurm."""

    at: float
    """Wall-clock time of the sinfo answer."""
    drained: Mapping[str, NodeDrain]


def write_board(path: Path, drained: Mapping[str, NodeDrain], now: float) -> None:
    """Publish ``drained`` for the job's other agents (``queue.publish``)."""
    publish(path, {"at": now, "drained": {node: asdict(drain) for node, drain in drained.items()}})


def read_board(path: Path) -> Board | None:
    """The published board, or None: none yet, or not one this module writes (any process of
    the job's user may write the job directory; nothing in it is trusted)."""
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("drained"), dict):
        return None
    at = raw.get("at")
    if not isinstance(at, int | float) or isinstance(at, bool):
        return None
    drained: dict[str, NodeDrain] = {}
    for node, fields in raw["drained"].items():
        names = ("node", "state", "since", "by", "reason")
        if not isinstance(fields, dict) or not all(isinstance(fields.get(n), str) for n in names):
            return None
        drained[str(node)] = NodeDrain(*(str(fields[name]) for name in names))
    return Board(float(at), drained)


def drain_of(board: Board | None, node: str, now: float) -> NodeDrain | None:
    """The drain of ``node`` that a fresh board shows, or None."""
    if board is None or now - board.at > BOARD_MAX_AGE:
        return None
    return board.drained.get(node)


def urgent(drain: NodeDrain) -> bool:
    """A failing node may die any moment: leave now rather than at the next checkpoint."""
    return drain.state.rstrip("*~#!%$@^-+").startswith(URGENT_STATES)


def patience(checkpoint_times: Iterable[float]) -> float:
    """How long to wait for the next checkpoint: twice the median gap between the job's last
    checkpoints, between ``MIN_PATIENCE`` and ``MAX_PATIENCE`` (the longest without two)."""
    times = sorted(checkpoint_times)[-11:]
    gaps = [later - earlier for earlier, later in pairwise(times)]
    if not gaps:
        return MAX_PATIENCE
    return min(MAX_PATIENCE, max(MIN_PATIENCE, 2 * statistics.median(gaps)))


def leave_reason(
    drain: NodeDrain, step_then: int | None, newest: int | None, waited: float, limit: float
) -> str | None:
    """Why a slot on drained node ``drain`` leaves now, or None to wait for the next checkpoint.

    ``step_then``: the newest committed checkpoint step when the drain was seen (None: none
    yet); ``newest``: now; ``waited``: seconds since the drain was seen; ``limit``: ``patience``.
    """
    if urgent(drain):
        return f"node {drain.node} is {drain.state}"
    if newest is None:
        return "the job has committed no checkpoint to wait for"
    if step_then is None or newest > step_then:
        return f"checkpoint step {newest} is committed"
    if waited >= limit:
        return f"no checkpoint within {limit:.0f} s"
    return None


@dataclass
class Progress:
    """The job's committed checkpoints, read from its events file as it grows."""

    path: Path
    offset: int = 0
    newest: int | None = None
    times: list[float] = field(default_factory=list)

    def update(self) -> None:
        new, self.offset = events.read_new(self.path, self.offset, CHECKPOINTS)
        for event in new:
            if event.kind != Kind.CHECKPOINT or event.details.get("tier") == "local":
                continue  # a rank's local-tier save is not the job's commit
            step = event.details.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                self.newest = step if self.newest is None else max(self.newest, step)
                self.times.append(event.time)


class DrainWatch:
    """One agent's watch for a drain of its node, on a daemon thread.

    Every ``POLL_S``: when ``elected()`` (this is the job's lowest running slot), ask Slurm
    (``query``) and publish the answer at ``board``; then read the board, and once it shows
    this node drained, say so (``emit``: a ``drain`` event) and wait for the next checkpoint
    (``leave_reason``), then call ``leave(drain, why)`` once.
    """

    def __init__(
        self,
        node: str,
        board: Path,
        events_file: Path,
        *,
        elected: Callable[[], bool],
        query: Callable[[], Mapping[str, NodeDrain]],
        leave: Callable[[NodeDrain, str], None],
        emit: Callable[..., None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self._board = board
        self._progress = Progress(events_file)
        self._elected = elected
        self._query = query
        self._leave = leave
        self._emit = emit
        self._clock = clock
        self._asked_at: float | None = None
        self._seen: tuple[NodeDrain, float, int | None] | None = None
        """The drain, when it was seen, and the newest checkpoint step then."""
        self.left = False
        self._stop = threading.Event()

    def start(self) -> DrainWatch:
        threading.Thread(target=self._run, name="hpc-elastic-drain", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # A thread of its own: say so, and look again next time.
                log.exception("the drain watch of %s failed this time", self.node)

    def poll(self) -> None:
        """One look: publish when elected, read the board, act on a drain of this node."""
        now = self._clock()
        if self._elected() and (self._asked_at is None or now - self._asked_at >= POLL_S):
            self._asked_at = now
            self._publish(now)
        if self.left:
            return
        first = self._seen is None
        if self._seen is None:
            drain = drain_of(read_board(self._board), self.node, now)
            if drain is None:
                return
            self._progress.update()
            self._seen = (drain, now, self._progress.newest)
            log.debug("node %s is drained (%s); the slot leaves at a checkpoint", self.node, drain)
        drain, seen_at, step_then = self._seen
        self._progress.update()
        limit = patience(self._progress.times)
        why = leave_reason(drain, step_then, self._progress.newest, now - seen_at, limit)
        if first:
            action = f"leaving now: {why}" if why else "leaving at the next checkpoint"
            self._emit(Kind.DRAIN, **asdict(drain), action=action)
        if why is not None:
            self.left = True
            log.debug("slot on %s leaves its drained node: %s", self.node, why)
            self._leave(drain, why)

    def _publish(self, now: float) -> None:
        try:
            drained = self._query()
        except SlurmError as error:
            log.debug("no drained nodes from Slurm this time: %s", error)
            return
        write_board(self._board, drained, now)
        log.debug("published the drained nodes: %s", sorted(drained))


def drained_now(board: Path, now: float | None = None) -> list[str]:
    """The nodes a fresh board shows drained, for a requeue's ``ExcNodeList``."""
    found = read_board(board)
    when = time.time() if now is None else now
    if found is None or when - found.at > BOARD_MAX_AGE:
        return []
    return sorted(found.drained)


def timeline_drains(timeline: Iterable[Event]) -> list[Event]:
    """The job's ``drain`` events, for ``status``."""
    return [event for event in timeline if event.kind == Kind.DRAIN]
