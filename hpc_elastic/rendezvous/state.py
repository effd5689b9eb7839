"""The job's rendezvous state as one JSON document, and the pure steps that change it.

Every agent reads the state, computes the next one with a function from this module and
writes it back with a compare-and-set; whoever loses the race re-reads and decides again.
Nothing here does I/O or reads a clock, so every rule is unit-tested without ZooKeeper.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from functools import cached_property, lru_cache
from typing import Any

from hpc_elastic.errors import RendezvousError
from hpc_elastic.rendezvous.api import Failure, NodeInfo, Round
from hpc_elastic.spec import NodeRange

FORMAT = 2
"""Bumped when the JSON layout changes, so an old agent refuses a state it cannot read."""


@dataclass(frozen=True)
class JobState:
    """Everything the agents of one job agree on; membership itself lives in the store."""

    max_restarts: int
    round: int = 0
    """Number of the latest completed round; 0 before the first one."""
    members: tuple[NodeInfo, ...] = ()
    """Members of ``round`` in node-rank order."""
    master_port: int | None = None
    """Published by the round's rank-0 agent once it has picked a free port."""
    restarts_used: int = 0
    failed_round: int = 0
    """The latest round whose worker failure was recorded; that round is over."""
    last_failure: Failure | None = None
    succeeded: tuple[str, ...] = ()
    """Node ids of ``round`` whose workers all exited 0."""
    ready: tuple[str, ...] = ()
    """Node ids of ``round`` that are back in ``next_round``: for them the round is over,
    and only they (with newcomers) may form the next one. A member that is alive but not
    ready may be a dead node whose session has not expired yet."""
    failure_summary: str = ""
    """Non-empty once the job as a whole has failed."""
    closed: bool = False

    @property
    def failed(self) -> bool:
        return bool(self.failure_summary)

    @property
    def master_addr(self) -> str:
        return self.members[0].host if self.members else ""

    @property
    def world_size(self) -> int:
        return sum(member.nproc for member in self.members)

    @cached_property
    def member_ids(self) -> frozenset[str]:
        return frozenset(member.node_id for member in self.members)

    def to_round(self) -> Round:
        if self.master_port is None:
            raise RendezvousError(f"Round {self.round} has no master port yet; wait for rank 0.")
        return Round(
            number=self.round,
            members=self.members,
            master_addr=self.master_addr,
            master_port=self.master_port,
            restarts_used=self.restarts_used,
            max_restarts=self.max_restarts,
        )


def encode(state: JobState) -> bytes:
    """Without ``asdict``, whose deep copy dominated a 1024-member round's CPU time."""
    raw: dict[str, Any] = {field.name: getattr(state, field.name) for field in fields(state)}
    raw["members"] = [_record_fields(member) for member in state.members]
    raw["last_failure"] = _record_fields(state.last_failure) if state.last_failure else None
    return json.dumps({"format": FORMAT, **raw}, sort_keys=True).encode()


def _record_fields(record: NodeInfo | Failure) -> dict[str, Any]:
    return {field.name: getattr(record, field.name) for field in fields(record)}


@lru_cache(maxsize=8)
def decode(data: bytes) -> JobState:
    """Parse a state; cached because every agent sharing a connection reads the same bytes."""
    try:
        raw = json.loads(data)
        if raw.pop("format") != FORMAT:
            raise ValueError("unknown format")
        failure = raw.pop("last_failure")
        return JobState(
            **{
                **raw,
                "members": tuple(NodeInfo(**member) for member in raw.pop("members")),
                "succeeded": tuple(raw.pop("succeeded")),
                "ready": tuple(raw.pop("ready")),
                "last_failure": Failure(**failure) if failure is not None else None,
            }
        )
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as error:
        raise RendezvousError(
            f"The rendezvous state '{data[:80]!r}' is not a hpc-elastic state of format {FORMAT}; "
            "check that every agent runs the same hpc-elastic version."
        ) from error


def encode_node(node: NodeInfo) -> bytes:
    return json.dumps(_record_fields(node), sort_keys=True).encode()


@lru_cache(maxsize=4096)
def decode_node(data: bytes) -> NodeInfo:
    """Cached: a member's record never changes, and every proposal decodes all of them."""
    try:
        return NodeInfo(**json.loads(data))
    except (ValueError, TypeError, RecursionError) as error:
        raise RendezvousError(
            f"The member record '{data[:80]!r}' is not a hpc-elastic node; "
            "check that every agent runs the same hpc-elastic version."
        ) from error


def round_is_live(state: JobState, alive: frozenset[str], nodes: NodeRange) -> bool:
    """Whether the latest round may keep training: nobody left, failed, came back to
    rendezvous or is waiting to join.

    Once a member has succeeded the round is finishing: a newcomer waits for the job to
    close rather than restart the last steps, and only the loss of a member that has not
    finished still ends the round (the exit barrier then fails the job).
    """
    if state.round in (0, state.failed_round) or state.ready:
        return False
    members = state.member_ids
    if state.succeeded:
        return members - set(state.succeeded) <= alive
    if not members <= alive:
        return False
    return len(members) >= nodes.max or alive <= members


class Action(Enum):
    """What an agent waiting in ``next_round`` should do next, given what it sees."""

    RETURN = "return"
    """The latest round includes us and has its master port: start workers."""
    PUBLISH_PORT = "publish_port"
    """We are rank 0 of the latest round: pick a free port and publish it."""
    MARK_READY = "mark_ready"
    """We are a member of the latest round and back here: say so, which ends the round."""
    STRAGGLERS = "stragglers"
    """Members of the latest round are alive but not back yet: wait until they come back
    or their sessions expire, so that no round includes a node that has just died."""
    COMPLETE = "complete"
    """MAX nodes (or every node that can come) are here: complete a new round now."""
    LAST_CALL = "last_call"
    """At least MIN nodes are here: complete a new round once the last call ends."""
    BELOW_MIN = "below_min"
    """Too few nodes: wait for more, up to ``min_wait``."""
    WAIT = "wait"
    """Nothing to do until the state or the membership changes."""


def next_action(
    state: JobState,
    alive: frozenset[str],
    me: str,
    last_round: int,
    nodes: NodeRange,
    *,
    expected: int | None = None,
) -> Action:
    """Decide the next step of one waiting agent; ``last_round`` is the round it already ran.

    ``expected`` is how many nodes the job can expect soon (e.g. its Slurm allocation);
    once that many are here there is no point in waiting for the last call. Once a member
    has succeeded the job is finishing: no new round opens, the exit barrier decides.
    """
    if state.succeeded:
        return Action.WAIT
    if round_is_live(state, alive, nodes):
        if me in state.member_ids and state.round > last_round:
            if state.master_port is not None:
                return Action.RETURN
            return Action.PUBLISH_PORT if state.members[0].node_id == me else Action.WAIT
        if me not in state.member_ids and len(state.members) >= nodes.max:
            return Action.WAIT
    if me not in alive:
        return Action.WAIT
    if me in state.member_ids and me not in state.ready:
        return Action.MARK_READY
    if stragglers(state, alive):
        return Action.STRAGGLERS
    present = len(alive)  # Without stragglers every live node is a candidate.
    enough = min(nodes.max, expected) if expected is not None else nodes.max
    if present >= max(enough, nodes.min):
        return Action.COMPLETE
    if present >= nodes.min:
        return Action.LAST_CALL
    return Action.BELOW_MIN


def stragglers(state: JobState, alive: frozenset[str]) -> frozenset[str]:
    """Alive members of the latest round that have not come back to rendezvous yet."""
    return (state.member_ids & alive) - frozenset(state.ready)


def candidates(state: JobState, alive: frozenset[str]) -> frozenset[str]:
    """Who may form the next round: the members that came back, and newcomers."""
    return alive - stragglers(state, alive)


def mark_ready(state: JobState, node_id: str) -> JobState:
    if node_id not in state.member_ids or node_id in state.ready:
        return state
    return replace(state, ready=(*state.ready, node_id))


def complete_round(state: JobState, candidates: Sequence[NodeInfo], nodes: NodeRange) -> JobState:
    """Open the next round with stable ranks: survivors keep their order, so rank 0 stays
    on a surviving node; newcomers follow in the order given (their join order)."""
    by_id = {candidate.node_id: candidate for candidate in candidates}
    survivors = [member for member in state.members if member.node_id in by_id]
    kept = {member.node_id for member in survivors}
    newcomers = [candidate for candidate in candidates if candidate.node_id not in kept]
    return replace(
        state,
        round=state.round + 1,
        members=tuple([*survivors, *newcomers][: nodes.max]),
        master_port=None,
        succeeded=(),
        ready=(),
    )


def publish_master(state: JobState, round_number: int, port: int) -> JobState:
    if state.round != round_number or state.master_port is not None:
        return state
    return replace(state, master_port=port)


def record_failure(state: JobState, round_number: int, failure: Failure) -> JobState:
    """Spend one restart for ``round_number``; later reports of the same round change nothing."""
    if state.failed or state.closed or round_number != state.round:
        return state
    if state.failed_round == round_number:
        return state
    if state.restarts_used >= state.max_restarts:
        return replace(
            state,
            failed_round=round_number,
            last_failure=failure,
            failure_summary=(
                f"all {state.max_restarts} restarts are spent; the last failure was on node "
                f"'{failure.host}' (rank {failure.rank}, exit code {failure.exit_code}, "
                f"signal {failure.signal}): {failure.message}"
            ),
        )
    return replace(
        state,
        failed_round=round_number,
        last_failure=failure,
        restarts_used=state.restarts_used + 1,
    )


def record_success(state: JobState, round_number: int, node_id: str) -> JobState:
    if round_number != state.round or node_id in state.succeeded:
        return state
    return replace(state, succeeded=(*state.succeeded, node_id))


def all_succeeded(state: JobState) -> bool:
    return state.round > 0 and state.member_ids <= set(state.succeeded)


def fail(state: JobState, summary: str) -> JobState:
    return state if state.failed else replace(state, failure_summary=summary)


def close(state: JobState) -> JobState:
    return replace(state, closed=True)


def describe(state: JobState) -> dict[str, Any]:
    """A flat JSON-able summary for ``hpc-elastic status``."""
    return {
        "round": state.round,
        "members": [member.slot or member.host for member in state.members],
        "world_size": state.world_size,
        "restarts": f"{state.restarts_used}/{state.max_restarts}",
        "last_failure": asdict(state.last_failure) if state.last_failure else None,
        "failed": state.failure_summary or None,
        "closed": state.closed,
    }
