"""The job's rendezvous state as one small JSON document, and the pure steps that change it.

Every agent reads the state, computes the next one with a function from this module and
writes it back with a compare-and-set; whoever loses the race re-reads and decides again.
Two things are not in the document, so that its size does not grow with the job's:
- the members of the latest round are in that round's table beside it (``Store.put_table``),
  which the document names by its digest (``Document``); a connection reads a table once
  (``rendezvous/tables.py``), and a round's table never changes;
- who came back to rendezvous after a round: each member says so with a mark of its own
  (``backend.Mark.BACK``), and the handler adds those marks to the state it decides on
  (``with_back``).
Nothing here does I/O or reads a clock, so every rule is unit-tested without ZooKeeper.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from functools import cached_property, lru_cache
from typing import Any, cast

from hpc_elastic.decoding import (
    Check,
    MalformedError,
    flag,
    optional,
    record,
    seconds,
    shown,
    text,
    tuple_of,
    whole,
)
from hpc_elastic.errors import RendezvousError
from hpc_elastic.rendezvous.api import Failure, NodeInfo, RendezvousSettings, Round, member_ranks
from hpc_elastic.rendezvous.backend import table_digest
from hpc_elastic.rendezvous.once import Memo, computed_once
from hpc_elastic.spec import NodeRange

FORMAT = 7
"""Bumped when the layout changes, so an old agent refuses a state it cannot read (4:
``departed``, and a member's ``link_port``; 5: ``ready`` left the document for marks beside
it, and ``ended`` says that one was made; 6: the members left it for their round's table,
named by ``table`` and counted by ``size``; 7: ZooKeeper keeps the table compressed, which an
agent of format 6 would take for a damaged table)."""

MARGIN = 2.0
"""Seconds added to every derived deadline for scheduling and ZooKeeper tick granularity."""


_MEMBER_IDS: Memo[frozenset[str]] = Memo()
_MEMBERS_HERE: Memo[frozenset[str]] = Memo()
_PROPOSER: Memo[str | None] = Memo()
_SORTED: Memo[tuple[str, ...]] = Memo()
_WITH_DONE: Memo[JobState] = Memo()


@dataclass(frozen=True)
class JobState:
    """Everything the agents of one job agree on; membership itself lives in the store."""

    max_restarts: int
    round: int = 0
    """Number of the latest completed round; 0 before the first one."""
    members: tuple[NodeInfo, ...] = ()
    """Members of ``round`` in node-rank order.

    Not in the document: they are the round's table (``encode_table``), which the document
    names by its digest. A restart of N nodes rewrote and re-read an O(N) document at every
    change of the round (a port, a failure, its end); now each change is a few hundred bytes,
    and each connection reads a round's members once, when the round forms."""
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
    ready may be a dead node whose session has not expired yet.

    Never written into the document (``encode`` leaves it out): each member marks itself
    back with a ``Mark.BACK`` of its own, which races nobody, and whoever decides adds the
    marks it sees (``with_back``). One compare-and-set of the whole state per member made a
    restart of N nodes write N versions of an O(N) state, each read by every agent."""
    ended: bool = False
    """A member of ``round`` came back to rendezvous (its ``Mark.BACK``): the round is over.
    Written once, by the first member back in a round that had not ended otherwise, so that
    every agent learns the end from the state alone, without reading the marks."""
    failure_summary: str = ""
    """Non-empty once the job as a whole has failed."""
    closed: bool = False
    excluded: tuple[str, ...] = ()
    """Alive nodes left out of ``round`` because they did not come back to rendezvous within
    ``straggler_timeout``: their agents are stuck (e.g. on an unkillable worker). They count
    as absent until they come back to ``next_round``, so that a stuck node can neither stall
    the others nor make every round they form look superseded at once."""
    departed: tuple[str, ...] = ()
    """Members whose agent process is known to have exited although their ZooKeeper session
    lives on: a link of the latest round to them ended in order (the peer's kernel closed it,
    ``depart``). They count as gone at once, without waiting for the session; one that is
    alive after all (a false report) comes back through ``READMIT`` like an excluded node."""

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
        """Computed once for a round's members, not once per state (``with_back`` makes one
        for every decision)."""
        members = self.members
        return _MEMBER_IDS.get((members,), lambda: frozenset(m.node_id for m in members))

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


VIEW_ONLY = frozenset({"ready", "members"})
"""``JobState``'s fields that the document never holds: the round's table fills in the
members, the store's marks who is back."""


@dataclass(frozen=True)
class Document:
    """The state as the store holds it: every field but the view-only ones, and the name of
    the round's table, whose members ``filled`` puts back."""

    state: JobState
    """Without members (and without ``ready``)."""
    table: str
    """The digest of the members' table (``encode_table``); "" when there are none."""
    size: int
    """How many members the table holds."""

    def filled(self, table: bytes) -> JobState:
        """The state with its members, from the table this document names (the store
        returns a table only under the digest it has); raises RendezvousError for a table
        that does not hold ``size`` distinct members."""
        return self.with_members(decode_table(table) if self.size else ())

    def with_members(self, members: tuple[NodeInfo, ...]) -> JobState:
        """The state with ``members``, its table's (decoded, or made from the last round's
        table); raises RendezvousError unless they are ``size`` distinct members."""
        if len(members) != self.size:
            raise RendezvousError(
                f"The table of round {self.state.round} holds {len(members)} members where "
                f"its state counts {self.size}; check that every agent runs the same "
                "hpc-elastic version."
            )
        state = replace(self.state, members=members)
        if len(state.member_ids) != self.size:
            raise RendezvousError(
                f"The table of round {self.state.round} lists a member twice; check that "
                "every agent runs the same hpc-elastic version."
            )
        return state


def encode(state: JobState) -> bytes:
    """The document; the members go in their own table (``encode_table``), written first.

    Without ``asdict``, whose deep copy dominated a 1024-member round's CPU time."""
    raw: dict[str, Any] = {
        field.name: getattr(state, field.name)
        for field in fields(state)
        if field.name not in VIEW_ONLY
    }
    raw["table"] = table_name(state.members)
    raw["size"] = len(state.members)
    raw["last_failure"] = _record_fields(state.last_failure) if state.last_failure else None
    return json.dumps({"format": FORMAT, **raw}, sort_keys=True).encode()


@computed_once(size=8)
def encode_table(members: tuple[NodeInfo, ...]) -> bytes:
    """A round's members in rank order, as the table the store keeps beside the state.
    Cached: every write of a round's state names its table, and every connection of a
    process that makes a round's table (``tables._derived``) makes the same one."""
    return json.dumps([_record_fields(member) for member in members], sort_keys=True).encode()


@computed_once(size=8)
def table_name(members: tuple[NodeInfo, ...]) -> str:
    """The digest that names the members' table in the document; "" for no members."""
    return table_digest(encode_table(members)) if members else ""


def remember_table(members: tuple[NodeInfo, ...], table: bytes, name: str) -> None:
    """Keep ``table``, read from the store under ``name``, as the encoding of ``members``:
    a state of their round written later names it without encoding thousands of members."""
    encode_table.remember(members, table)
    table_name.remember(members, name)


def _record_fields(record: NodeInfo | Failure) -> dict[str, Any]:
    return {name: getattr(record, name) for name in _field_names(record)}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(record: NodeInfo | Failure) -> tuple[str, ...]:
    """A record's field names, found once a class: ``fields`` makes its tuple anew at every
    call, which was a third of the time a table of 4,096 members took to encode."""
    names = _FIELD_NAMES.get(type(record))
    if names is None:
        names = _FIELD_NAMES[type(record)] = tuple(field.name for field in fields(record))
    return names


# --- the typed decoder -------------------------------------------------------------------------
#
# Whatever is in the store was perhaps not written by an agent of this version (or at all by
# hpc-elastic): each field is checked for its type and range before a ``JobState`` is built,
# so a malformed state is one ``RendezvousError`` sentence, never a crash in a decision rule
# or a silently wrong value (``"closed": "no"`` is not "closed"). The checks are tables, one
# entry per dataclass field (``STATE_FIELDS``, ``NODE_FIELDS``, ``FAILURE_FIELDS``): a new
# field of the state is one entry more, and a test fails until it has one. The checks
# themselves are generic, shared with the other decoders (``hpc_elastic/decoding.py``).


NODE_FIELDS: dict[str, Check] = {
    "node_id": text(empty=False),
    "host": text(empty=False),
    "nproc": whole(1),
    "slot": text(),
    "link_port": whole(0, 65535),
}
"""``NodeInfo``'s fields: a member needs an id, an address the others reach and a worker."""

FAILURE_FIELDS: dict[str, Check] = {
    "node_id": text(empty=False),
    "host": text(),
    "rank": whole(0),
    "exit_code": optional(whole(0)),
    "signal": optional(text()),
    "message": text(),
    "time": seconds,
    "slot": text(),
}
"""``Failure``'s fields (an exit code is a Popen return code of 0 or more, or None for a
signal: ``rootcause.describe_exit``)."""

STATE_FIELDS: dict[str, Check] = {
    "max_restarts": whole(0),
    "round": whole(0),
    "master_port": optional(whole(1, 65535)),
    "restarts_used": whole(0),
    "failed_round": whole(0),
    "last_failure": optional(record(Failure, FAILURE_FIELDS)),
    "succeeded": tuple_of(text(empty=False)),
    "ended": flag,
    "failure_summary": text(),
    "closed": flag,
    "excluded": tuple_of(text(empty=False)),
    "departed": tuple_of(text(empty=False)),
}
"""``JobState``'s fields, by the name ``encode`` writes them under."""

DIGEST = re.compile(r"[0-9a-f]{64}")
"""A table's name: a sha256 in lower-case hex (``backend.table_digest``)."""


def _table_name(value: object, where: str) -> object:
    if type(value) is not str or not (value == "" or DIGEST.fullmatch(value)):
        raise MalformedError(f"'{where}' is {shown(value)}, not a sha256 digest in hex")
    return value


STATE_RULES: tuple[tuple[Callable[[JobState], bool], str], ...] = (
    (lambda s: s.restarts_used <= s.max_restarts, "spends more restarts than it has"),
    (lambda s: s.failed_round <= s.round, "failed a round that has not formed yet"),
)
"""What holds between fields of every state the rules in this module make."""

TABLE_CHECKS: dict[str, Check] = {"table": _table_name, "size": whole(0)}
"""What the document holds in the members' place: their table's digest and their count."""

_STATE = record(JobState, STATE_FIELDS)
_NODE = record(NodeInfo, NODE_FIELDS)
_MEMBERS = tuple_of(_NODE)


def decode_document(raw: object) -> Document:
    """A ``Document`` from parsed JSON (``format`` included); raises ``MalformedError``."""
    if type(raw) is not dict:
        raise MalformedError(f"it is {shown(raw)}, not an object")
    fmt = raw.get("format")  # first: a newer layout is "another version", not a bad field
    if type(fmt) is not int or fmt != FORMAT:
        raise MalformedError(f"its format is {shown(fmt)}")
    for name, check in TABLE_CHECKS.items():
        if name not in raw:
            raise MalformedError(f"it lacks '{name}'")
        check(raw[name], name)
    fields_only = {k: v for k, v in raw.items() if k != "format" and k not in TABLE_CHECKS}
    state = cast(JobState, _STATE(fields_only, ""))
    for holds, broken in STATE_RULES:
        if not holds(state):
            raise MalformedError(f"it {broken}")
    table, size = cast(str, raw["table"]), cast(int, raw["size"])
    if (table == "") != (size == 0):
        raise MalformedError(f"it names table {shown(table)} for {size} members")
    return Document(state, table, size)


def _parsed(data: bytes, convert: Callable[[object], object], what: str, kind: str) -> object:
    """``convert`` of the JSON in ``data``; anything malformed is one RendezvousError that
    quotes the bytes (``what``) and says what they are not (``kind``)."""
    try:
        return convert(json.loads(data))
    except (ValueError, RecursionError) as error:  # MalformedError and JSON's errors
        why = f": {error}" if isinstance(error, MalformedError) else ""
        raise RendezvousError(
            f"{what} {data[:40]!r} is not {kind}{why}; check that every agent runs the same "
            "hpc-elastic version."
        ) from error


@lru_cache(maxsize=8)
def decode(data: bytes) -> Document:
    """Parse a state; cached because every agent sharing a connection reads the same bytes."""
    state = f"a hpc-elastic state of format {FORMAT}"
    return cast(Document, _parsed(data, decode_document, "The rendezvous state", state))


@computed_once(size=8)
def decode_table(data: bytes) -> tuple[NodeInfo, ...]:
    """A round's members from their table; computed once: every connection of a process
    meets the new table at the same moment."""
    members = _parsed(
        data, lambda raw: _MEMBERS(raw, "members"), "The table of members", "a hpc-elastic table"
    )
    return cast(tuple[NodeInfo, ...], members)


def encode_node(node: NodeInfo) -> bytes:
    return json.dumps(_record_fields(node), sort_keys=True).encode()


@lru_cache(maxsize=4096)
def decode_node(data: bytes) -> NodeInfo:
    """Cached: a member's record never changes, and every proposal decodes all of them."""
    node = _parsed(data, lambda raw: _NODE(raw, ""), "The member record", "a hpc-elastic node")
    return cast(NodeInfo, node)


def round_is_live(state: JobState, alive: frozenset[str], nodes: NodeRange) -> bool:
    """Whether the latest round may keep training: nobody left, failed, came back to
    rendezvous or is waiting to join.

    Once a member has succeeded the round is finishing: a newcomer waits for the job to
    close rather than restart the last steps, and only the loss of a member that has not
    finished still ends the round (the exit barrier then fails the job).
    """
    if state.round == 0 or round_over(state):
        return False
    alive = present(state, alive)
    members = state.member_ids
    if state.succeeded:
        return members - set(state.succeeded) <= alive
    # Counted, not compared: every decision asks, and the members that count are memoized.
    here = len(_members_here(state, alive))
    if here < len(members):
        return False  # a member is missing
    return len(members) >= nodes.max or len(alive) == here  # or nobody is waiting to join


class Action(Enum):
    """What an agent waiting in ``next_round`` should do next, given what it sees."""

    RETURN = "return"
    """The latest round includes us and has its master port: start workers."""
    PUBLISH_PORT = "publish_port"
    """We are rank 0 of the latest round: pick a free port and publish it."""
    AWAIT_PORT = "await_port"
    """We are in the latest round; its rank 0 has not published the master port yet. Wait,
    up to ``straggler_timeout`` (its agent may be stuck with its session alive); then
    MARK_READY ends the round, and rank 0 becomes a straggler like any other."""
    MARK_READY = "mark_ready"
    """We are a member of the latest round and back here: say so, which ends the round."""
    READMIT = "readmit"
    """We were excluded as a stuck straggler (or reported departed, yet here we are) and are
    back: drop the exclusion, then join like any newcomer."""
    STRAGGLERS = "stragglers"
    """Members of the latest round are alive but not back yet: wait until they come back,
    their sessions expire or ``straggler_timeout`` passes, so that no round includes a node
    that has just died."""
    COMPLETE = "complete"
    """MAX nodes (or every node that can come) are here, or the round only lost members
    (``no_newcomer``) and Slurm expects nobody more: complete a new round now."""
    LAST_CALL = "last_call"
    """At least MIN nodes are here: complete a new round once the last call ends."""
    FINISHING = "finishing"
    """A member succeeded and the round is finishing: wait for the job to close, up to
    ``exit_barrier_timeout`` (the members that succeeded may have died since: then no
    barrier is left to fail a member that never finishes)."""
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
    stragglers_overdue: bool = False,
) -> Action:
    """Decide the next step of one waiting agent; ``last_round`` is the round it already ran.

    ``expected`` is how many nodes the job can expect soon (e.g. its Slurm allocation);
    once that many are here there is no point in waiting for the last call (nodes reported
    departed are taken off it: ``still_coming``). Once a member has succeeded the job is
    finishing: no new round opens, the exit barrier decides, unless a worker failure ended
    the round (then the members that succeeded rejoin and the job reruns from its
    checkpoint). ``stragglers_overdue``: this agent has waited
    ``straggler_timeout`` for the stragglers (see ``stragglers_overdue``); they are left out.
    """
    if me in state.excluded or me in state.departed:
        return Action.READMIT
    if state.succeeded and not round_over(state):
        if me in state.member_ids and me not in state.succeeded:
            # Back here without finishing (our workers were stopped, e.g. fenced): the
            # round can never complete, so end it; the others rerun with us.
            return Action.MARK_READY
        return Action.FINISHING
    if round_is_live(state, alive, nodes):
        if me in state.member_ids and state.round > last_round:
            if state.master_port is not None:
                return Action.RETURN
            return Action.PUBLISH_PORT if state.members[0].node_id == me else Action.AWAIT_PORT
        if me not in state.member_ids and len(state.members) >= nodes.max:
            return Action.WAIT
    if me not in alive:
        return Action.WAIT
    if me in state.member_ids and me not in state.ready:
        return Action.MARK_READY
    if has_stragglers(state, alive) and not stragglers_overdue:
        return Action.STRAGGLERS
    return new_round_action(state, alive, nodes, expected)


def new_round_action(
    state: JobState, alive: frozenset[str], nodes: NodeRange, expected: int | None
) -> Action:
    """Whether the candidates complete the next round now, after the last call, or not yet."""
    expected = still_coming(state, alive, expected)
    count = candidate_count(state, alive)
    enough = min(nodes.max, expected) if expected is not None else nodes.max
    if count >= max(enough, nodes.min):
        return Action.COMPLETE
    if count < nodes.min:
        return Action.BELOW_MIN
    if expected is None and no_newcomer(state, alive):
        # A shrink (or a restart of the same nodes): the last call waits for nodes that
        # arrive together, and none is arriving here. A node that comes later supersedes
        # the round as usual. When Slurm says more are coming (``expected`` above the
        # count), the wait still pays, so it is kept.
        return Action.COMPLETE
    return Action.LAST_CALL


def uncounted(state: JobState, alive: frozenset[str]) -> frozenset[str]:
    """The nodes reported departed that the store still lists: their agents have exited, but
    Slurm may still count their slots as running (``still_coming``)."""
    return alive & frozenset(state.departed) if state.departed else frozenset()


def still_coming(state: JobState, alive: frozenset[str], expected: int | None) -> int | None:
    """``expected`` (how many nodes Slurm runs or starts for the job) without the nodes
    reported departed whose sessions live on (``uncounted``).

    Slurm counts a slot as running until it notices that its task ended: after a node crash,
    until it marks the node down (tens of seconds, minutes on some clusters). The departed
    node's agent is gone for good (a node id is one agent process's), so without this the
    survivors took its slot for a node on its way and waited the whole last call for it.

    Only while the store still lists the node: its session is the bound of what the mark
    says. Once it expires the count is Slurm's again, so a slot that Slurm requeues and
    starts anew (a new agent, a new node id, never departed) is waited for as before. Within
    that bound the discount is one too many when Slurm has already dropped the slot, or when
    a new agent starts in it before the old session ends: the round then forms without a
    node that was starting, which supersedes it when it joins, like any node that comes
    after the last call. A departed node that comes back (``READMIT``) is counted again."""
    if expected is None:
        return None
    gone = uncounted(state, alive)
    return max(0, expected - len(gone)) if gone else expected


def no_newcomer(state: JobState, alive: frozenset[str]) -> bool:
    """Whether the next round can only be the latest round minus its lost members: every
    candidate was a member of it, every live member of it is back (no straggler, not even
    an overdue one), and no live node excluded as stuck may come back to take a place."""
    if state.round == 0 or has_stragglers(state, alive) or alive & frozenset(state.excluded):
        return False
    here = candidates(state, alive)
    return bool(here) and here <= state.member_ids


def is_spare(state: JobState, alive: frozenset[str], me: str, nodes: NodeRange) -> bool:
    """Whether ``me`` waits beside a live round that is full (MAX members): a hot spare
    (``submit --spares``). It disturbs nobody, and is a candidate of the very next round
    once a member is lost, so it replaces that member without a wait in Slurm's queue."""
    return (
        me in alive
        and me not in state.member_ids
        and len(state.members) >= nodes.max
        and not state.succeeded
        and round_is_live(state, alive, nodes)
    )


def spares(state: JobState, alive: frozenset[str], nodes: NodeRange) -> frozenset[str]:
    """The live nodes that wait as hot spares beside the latest round (``is_spare``)."""
    return frozenset(node for node in present(state, alive) if is_spare(state, alive, node, nodes))


def running(state: JobState | None) -> bool:
    """Whether the job has formed a round and has not ended: a node that joins it now ends the
    round that trains (an arrival supersedes it), so its members stop and wait for the newcomer."""
    return state is not None and state.round > 0 and not state.closed and not state.failed


def round_over(state: JobState) -> bool:
    """Whether the latest round ended: a worker failure, or a member came back to rendezvous."""
    return state.failed_round == state.round or state.ended or bool(state.ready)


def present(state: JobState, alive: frozenset[str]) -> frozenset[str]:
    """The live nodes that count: those excluded as stuck stragglers, and those whose agent
    is known to have exited (``departed``), are treated as gone."""
    if not (state.excluded or state.departed):
        return alive
    return alive - frozenset(state.excluded) - frozenset(state.departed)


def stragglers(state: JobState, alive: frozenset[str]) -> frozenset[str]:
    """Alive members of the latest round that have not come back to rendezvous yet."""
    return _members_here(state, alive) - frozenset(state.ready)


def has_stragglers(state: JobState, alive: frozenset[str]) -> bool:
    """Whether ``stragglers`` has any, in O(ready) rather than O(members): every decision of
    every agent asks, and early in a restart of thousands nearly all of them are stragglers."""
    here = _members_here(state, alive)
    return len(here) > len(here.intersection(state.ready))


def unlisted(state: JobState, alive: frozenset[str]) -> bool:
    """Whether a member of the latest round is missing from ``alive``: gone, or, on a list
    of members older than the state (``Store.alive_is_current``), not listed yet."""
    return len(_listed(state.member_ids, alive)) < len(state.member_ids)


def _members_here(state: JobState, alive: frozenset[str]) -> frozenset[str]:
    """The members of the latest round that count (``present``)."""
    return _listed(state.member_ids, present(state, alive))


def _listed(member_ids: frozenset[str], alive: frozenset[str]) -> frozenset[str]:
    """The members in ``alive``; computed once for all the agents deciding on the same
    round and membership."""
    return _MEMBERS_HERE.get((member_ids, alive), lambda: _intersection(member_ids, alive))


def _intersection(member_ids: frozenset[str], alive: frozenset[str]) -> frozenset[str]:
    """``member_ids & alive``, and ``member_ids`` itself when every member is listed: no
    second set of N ids kept, and the same object for whatever is memoized on it next."""
    here = member_ids & alive
    return member_ids if len(here) == len(member_ids) else here


def proposer(state: JobState, alive: frozenset[str]) -> str | None:
    """The member of the latest round that follows who is back from it and completes the
    next round: its lowest-ranked member that counts (``present``), None if none does.

    Every agent knows it from the state and the membership alone. The others do not read the
    marks: they wait for the commit, and read them only once the stragglers are overdue
    (the proposer may be the one that is stuck). Survivors keep their order, so it is rank 0
    of the round it commits.

    Found once for all the agents deciding on the same round and membership: where the
    first members do not count, every agent scanned past them (a fifth of a 4,096-agent
    driver's time in a round after a loss)."""

    def first_present() -> str | None:
        here = present(state, alive)
        return next((member.node_id for member in state.members if member.node_id in here), None)

    return _PROPOSER.get((state.members, state.excluded, state.departed, alive), first_present)


def candidates(state: JobState, alive: frozenset[str]) -> frozenset[str]:
    """Who may form the next round: the members that came back, and newcomers."""
    return present(state, alive) - stragglers(state, alive)


def candidate_count(state: JobState, alive: frozenset[str]) -> int:
    """``len(candidates(...))`` in O(ready), not O(N): every decision of every agent counts
    them, and in a join storm of thousands each count copied the live set."""
    here = _members_here(state, alive)
    return len(present(state, alive)) - (len(here) - len(here.intersection(state.ready)))


def position_among(alive: frozenset[str], node_id: str) -> int:
    """How many live nodes have an id below ``node_id`` (a proposer's turn, ``turn``); a
    binary search of the live ids sorted once for all the agents deciding on them, where each
    agent scanned all of them at every decision."""
    return bisect_left(_SORTED.get((alive,), lambda: tuple(sorted(alive))), node_id)


def echo_wait(settings: RendezvousSettings) -> float:
    """Seconds an agent whose rank died of a peer's death (an echo) waits to hear of the
    peer's failure before it reports its own: the peer's own report, or its session's
    expiry, which ZooKeeper notices up to a tick or two after the session timeout."""
    return 2 * settings.session_timeout + MARGIN


def only_arrivals(state: JobState, alive: frozenset[str], round_number: int) -> bool:
    """Whether round ``round_number`` was superseded only by nodes waiting to join: it is
    still the latest round, nothing failed, finished or closed, and every member is alive
    (none left out as stuck). Then every rank of its group is alive and reaches its next step
    boundary together with the others, where the training helpers save before they exit."""
    return (
        state.round == round_number
        and state.failed_round != round_number
        and not (state.failed or state.closed or state.succeeded)
        and _all_here(state, alive)
    )


def peer_lost(state: JobState, alive: frozenset[str], round_number: int) -> bool:
    """Whether round ``round_number``'s group lost a rank: a worker failure was recorded for
    it, or a member is gone (dead, left, or left out as stuck). Its other ranks then block or
    fail in their next collective, so waiting for them to reach a step boundary is in vain
    (only a rank that is saving is waited for, docs/agent.md)."""
    return state.round == round_number and (
        state.failed_round == round_number or not _all_here(state, alive)
    )


def _all_here(state: JobState, alive: frozenset[str]) -> bool:
    """Whether every member of the latest round counts (``present``). Counted, not compared:
    every agent asks as its round is superseded, and a subset test of the members, O(N) an
    agent while its list still shows the lost ones, was a tenth of a 4,096-agent driver's
    time after a loss (py-spy); the members that count are memoized (``_members_here``)."""
    return len(_members_here(state, alive)) == len(state.member_ids)


def arrival_grace(settings: RendezvousSettings) -> float:
    """Seconds an agent gives its workers to reach their step boundary and save when its
    round ends only for arrivals (``only_arrivals``), instead of ``stop_grace``.

    ``stop_grace`` (2 s) is short because after a failure the other ranks are blocked on the
    dead one and no save can come. After an arrival every rank is healthy, and a step longer
    than 2 s was SIGKILLed before its save: the job lost the steps since its last checkpoint
    at every grow (CI saw a 2.2 s step restart from scratch). The wait ends as soon as the
    ranks exit, so only slow steps use it; an agent away for it still comes back within the
    others' ``straggler_timeout``, which allows ``stop_grace`` plus ``echo_wait`` (an echo's
    wait, which a round ended by arrivals never has)."""
    return settings.stop_grace + echo_wait(settings)


def straggler_timeout(settings: RendezvousSettings) -> float:
    """Seconds the others wait for a live member to come back to rendezvous before leaving
    it out: it may stop its workers (``stop_grace``), wait for an echo's cause
    (``echo_wait``) and report; past that its agent is stuck, and a worker of it that is
    still running has fenced itself, since its lease (a third of ``session_timeout``, see
    ``rules.fence_after``) went stale."""
    return settings.stop_grace + echo_wait(settings) + settings.session_timeout + MARGIN


def stragglers_overdue(since: float | None, now: float, settings: RendezvousSettings) -> bool:
    """Whether the wait for stragglers that began at ``since`` (None: not waiting) is over."""
    # Compared with the deadline itself (not ``now - since``), so that waking up exactly at
    # the deadline the loop computed always finds it passed, whatever the float rounding.
    return since is not None and now >= since + straggler_timeout(settings)


def mark_ready(state: JobState, node_id: str) -> JobState:
    """``node_id`` is back: the round is over (``ended``), and it is ready for the next."""
    if node_id not in state.member_ids or node_id in state.ready:
        return state
    return replace(state, ended=True, ready=(*state.ready, node_id))


def with_back(state: JobState, back: frozenset[str]) -> JobState:
    """The state to decide on: the document and the ``Mark.BACK`` marks of its round.

    Only members count (a mark outlives nothing but its writer's session, and a node marks
    only a round it is a member of), in rank order, so one set of marks is one state."""
    if len(back) * 8 < len(state.members):
        # A few marks (an agent knows only its own): sorted by rank, not found in a scan of
        # thousands of members at every decision.
        ranks = member_ranks(state.members)
        ready = tuple(sorted((node for node in back if node in ranks), key=ranks.__getitem__))
    else:
        ready = tuple(member.node_id for member in state.members if member.node_id in back)
    return state if ready == state.ready else replace(state, ready=ready)


def with_done(state: JobState, done: frozenset[str]) -> JobState:
    """The state to decide on in a finishing round: the document and the ``Mark.DONE`` marks
    of its round, as ``succeeded``. Only members count, the state's own successes first (in
    the order written), then the marks in rank order, so one set of marks is one state.
    Computed once for all the agents deciding on the same state and marks: a scan of the
    members by every agent at every decision cost a job's end of 1,904 agents seconds."""
    return _WITH_DONE.get((state, done), lambda: _with_done(state, done))


def _with_done(state: JobState, done: frozenset[str]) -> JobState:
    known = set(state.succeeded)
    marked = tuple(m.node_id for m in state.members if m.node_id in done and m.node_id not in known)
    return replace(state, succeeded=(*state.succeeded, *marked)) if marked else state


def rank_of(state: JobState, node_id: str) -> int:
    """``node_id``'s rank in the latest round (it is a member)."""
    return member_ranks(state.members)[node_id]


def readmit(state: JobState, node_id: str) -> JobState:
    """A stuck straggler (or a node reported departed) came back: it is a node like any
    other again."""
    if node_id not in state.excluded and node_id not in state.departed:
        return state
    return replace(
        state,
        excluded=tuple(n for n in state.excluded if n != node_id),
        departed=tuple(n for n in state.departed if n != node_id),
    )


def depart(
    state: JobState, alive: frozenset[str], reporter: str, node_id: str, round_number: int
) -> JobState:
    """``reporter``'s link of round ``round_number`` to ``node_id`` ended in order: the peer's
    kernel closed it (FIN), which a live agent never makes happen while that round is the
    latest (docs/rendezvous.md, "A killed node noticed at once"). So ``node_id``'s agent
    process has exited, and its workers with it (they die with their agent): it counts as
    gone now (``departed``) instead of when its session expires, and the next round forms
    without waiting for it as a straggler.

    Only while ``round_number`` is still the latest round, both nodes are its members, the
    reporter itself counts (neither left out nor reported departed), the round is not
    finishing (a success was recorded: the exit barrier decides as before) and the job goes
    on. A link of an older round ends whenever its node moves on, so its end says nothing.
    Departed nodes that the store no longer lists are forgotten on the way: a node id is an
    agent process's, and a dead one never comes back (a live one whose session expired, and
    that joins again under its id, is then a node like any other)."""
    if (
        state.closed
        or state.failed
        or state.succeeded
        or state.round != round_number
        or reporter == node_id
        or not {reporter, node_id} <= state.member_ids
        or reporter not in present(state, alive)
        or node_id not in alive
        or node_id in state.departed
    ):
        return state
    kept = tuple(node for node in state.departed if node in alive)
    return replace(state, departed=(*kept, node_id))


def complete_round(
    state: JobState,
    candidates: Sequence[NodeInfo],
    nodes: NodeRange,
    *,
    exclude: frozenset[str] = frozenset(),
) -> JobState:
    """Open the next round with stable ranks: survivors keep their order, so rank 0 stays
    on a surviving node; newcomers follow in the order given (their join order).
    ``exclude``: overdue stragglers, left out until they come back (see ``excluded``).
    Departed nodes stay so: their sessions may live on, and listed as alive outside the
    round they would look like newcomers that supersede it."""
    by_id = {candidate.node_id: candidate for candidate in candidates}
    survivors = [member for member in state.members if member.node_id in by_id]
    kept = {member.node_id for member in survivors}
    newcomers = [candidate for candidate in candidates if candidate.node_id not in kept]
    excluded = tuple(sorted({*state.excluded, *exclude} - set(by_id)))
    return replace(
        state,
        round=state.round + 1,
        members=tuple([*survivors, *newcomers][: nodes.max]),
        master_port=None,
        succeeded=(),
        ready=(),
        ended=False,
        excluded=excluded,
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
    """A success in a round that already ended (a failure, or a member back in rendezvous)
    does not count: that round reruns. Nor does one in a job that failed or closed: a node
    frozen while its workers finished, and failed by the others' exit barrier meanwhile, must
    not close the failed job as a success (simulation seed 498)."""
    if state.failed or state.closed or round_number != state.round or node_id in state.succeeded:
        return state
    if state.round == round_number and round_over(state):
        return state
    return replace(state, succeeded=(*state.succeeded, node_id))


def all_succeeded(state: JobState) -> bool:
    return state.round > 0 and state.member_ids <= set(state.succeeded)


class Barrier(Enum):
    """What an agent whose workers all succeeded does next, waiting for the other members."""

    DONE = "done"
    """Every member succeeded (or the job was closed): exit 0."""
    FAILED = "failed"
    """The job failed as a whole: exit with its reason."""
    RESTART = "restart"
    """A worker failure (budget left) or a member that came back without finishing ended the
    round: rejoin ``next_round`` and rerun from the checkpoint."""
    MEMBER_LOST = "member_lost"
    """A member vanished before its workers finished: fail the job, naming it."""
    TIMED_OUT = "timed_out"
    """A member is alive but did not finish within ``exit_barrier_timeout``: fail the job."""
    WAIT = "wait"
    """Wait for a change, or the barrier's deadline."""


def barrier_action(
    state: JobState | None, alive: frozenset[str], my_round: int, now: float, deadline: float
) -> Barrier:
    """The exit barrier's rule; ``state`` None means removed, which only ``close`` does.
    ``deadline``: when the barrier entered plus ``exit_barrier_timeout``."""
    if state is None or state.closed or all_succeeded(state):
        return Barrier.DONE
    if state.failed:
        return Barrier.FAILED
    if state.round != my_round or round_over(state):
        return Barrier.RESTART
    if unfinished(state) - alive:
        return Barrier.MEMBER_LOST
    if now >= deadline:
        return Barrier.TIMED_OUT
    return Barrier.WAIT


def unfinished(state: JobState) -> frozenset[str]:
    """Members of the latest round whose workers have not all succeeded yet."""
    return state.member_ids - set(state.succeeded)


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
