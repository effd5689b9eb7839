"""The state as agents decide on it: a small document, and its round's members in a table
beside it (``rendezvous/tables.py``), on the in-memory store that passes the store contract."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hpc_elastic.errors import RendezvousError
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous import tables
from hpc_elastic.rendezvous.api import Failure, NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.backend import ABSENT, Store
from hpc_elastic.rendezvous.handler import MEMBERS_RETRY, StoreRendezvous
from hpc_elastic.rendezvous.memory import ManualClock, MemoryServer
from hpc_elastic.spec import NodeRange

NODES = NodeRange(1, 8)


def node(name: str) -> NodeInfo:
    return NodeInfo(name, f"host-{name}", 1)


def failure() -> Failure:
    return Failure("a", "host-a", 0, 1, None, "boom", 1.0)


def connect(server: MemoryServer) -> Store:
    return server.connect("job", 6.0)


def counted(store: Store) -> list[int]:
    """The rounds whose tables ``store`` is asked for, as they are asked."""
    asked: list[int] = []
    table = store.table

    def counting(round_number: int, digest: str) -> bytes | None:
        asked.append(round_number)
        return table(round_number, digest)

    store.table = counting  # type: ignore[method-assign]
    return asked


def commit(store: Store, step: Callable[[st.JobState], st.JobState]) -> st.JobState:
    """Apply ``step`` to the store's state as an agent does (``tables.update``)."""
    state = tables.update(store, step)
    assert state is not None
    return state


def joined(server: MemoryServer, names: str) -> dict[str, Store]:
    """A connection for each of ``names``, joined as that member (released, it leaves)."""
    lives = {name: connect(server) for name in names}
    for name, store in lives.items():
        store.join(name, st.encode_node(node(name)))
    return lives


def started(store: Store, names: str) -> st.JobState:
    """A job whose round 1 has ``names`` as members."""
    tables.write(store, st.JobState(max_restarts=3), ABSENT, after=None)
    return commit(store, lambda state: st.complete_round(state, [node(n) for n in names], NODES))


def test_a_connection_reads_a_rounds_table_once_for_every_state_of_the_round() -> None:
    """The port, a failure and the round's end each write a new document; a reader asks for
    the round's table once, and fills each of them from it."""
    server = MemoryServer()
    writer, reader = connect(server), connect(server)
    started(writer, "abc")
    asked = counted(reader)
    seen = []
    for step in (
        lambda state: st.publish_master(state, 1, 29500),
        lambda state: st.record_failure(state, 1, failure()),
    ):
        commit(writer, step)
        state, _ = tables.current(reader)
        assert state is not None
        seen.append([member.node_id for member in state.members])
    assert seen == [["a", "b", "c"]] * 2
    assert asked == [1], "the table of round 1 was read once"


def test_a_state_written_on_a_round_read_from_the_store_names_its_table_without_encoding_it() -> (
    None
):
    """Every member that comes back writes the round's end (the first fifty at once); each
    write names the round's table, which a connection that read the table already has."""
    server = MemoryServer()
    writer, reader = connect(server), connect(server)
    started(writer, "abc")
    st.encode_table.forget()
    st.table_name.forget()
    state, _ = tables.current(reader)
    assert state is not None
    encoded = st.encode_table.computed
    commit(reader, lambda state: st.publish_master(state, 1, 29500))
    assert st.encode_table.computed == encoded, "the table read was encoded again"
    data, _ = reader.get_state()
    assert data is not None
    assert reader.table(1, st.decode(data).table) == st.encode_table(state.members)


def test_a_new_rounds_table_is_there_before_the_commit_that_names_it() -> None:
    server = MemoryServer()
    store = connect(server)
    state = started(store, "ab")
    data, _ = store.get_state()
    assert data is not None
    document = st.decode(data)
    assert document.size == 2
    assert store.table(1, document.table) == st.encode_table(state.members)


def test_a_round_that_only_lost_members_is_made_from_the_last_table_not_read() -> None:
    """Survivors keep their order, so a connection that holds the last round's table makes a
    loss round's table itself, from the members alive: a loss costs no connection the table.
    A round with a newcomer, or a view of the members other than the proposer's, is read."""
    server = MemoryServer()
    writer, reader = connect(server), connect(server)
    lives = joined(server, "abc")
    started(writer, "abc")
    asked = counted(reader)
    tables.current(reader)
    lives["b"].release()
    shrunk = commit(writer, lambda state: st.complete_round(state, [node("a"), node("c")], NODES))
    state, _ = tables.current(reader)
    assert state == shrunk
    commit(writer, lambda state: st.publish_master(state, 2, 29500))
    state, _ = tables.current(reader)
    assert state is not None
    assert state.master_port == 29500
    assert asked == [1], "the loss round's table was read"
    lives.update(joined(server, "d"))
    grown = [node("a"), node("c"), node("d")]
    commit(writer, lambda state: st.complete_round(state, grown, NODES))
    state, _ = tables.current(reader)
    assert state is not None
    assert [member.node_id for member in state.members] == ["a", "c", "d"]
    assert asked == [1, 3], "a newcomer's round must be read"
    lives["d"].release()  # the reader sees a and c alive; the proposer decided on a and d
    commit(writer, lambda state: st.complete_round(state, [node("a"), node("d")], NODES))
    state, _ = tables.current(reader)
    assert state is not None
    assert [member.node_id for member in state.members] == ["a", "d"], "the digest let it by"
    assert asked == [1, 3, 4]


@pytest.mark.parametrize(
    "gone", ["a", "f", "cd", "af", "bdf", "abcde"], ids=lambda gone: f"without {gone}"
)
def test_a_loss_round_keeps_the_survivors_in_their_order_wherever_the_lost_ones_stood(
    gone: str,
) -> None:
    members = tuple(node(name) for name in "abcdef")
    kept = tables._without(members, frozenset(gone))
    assert kept == tuple(member for member in members if member.node_id not in gone)
    assert all(any(member is mine for mine in members) for member in kept), "records copied"


def test_a_loss_round_made_here_holds_the_last_rounds_member_objects_decoded_nowhere() -> None:
    """Its members are the very records of the last round, in every state of the round, and
    one tuple of them for every connection of the process that made it: their ranks, ids
    and encoding are then computed once, and found by identity."""
    server = MemoryServer()
    writer, reader, other = connect(server), connect(server), connect(server)
    lives = joined(server, "abc")
    started(writer, "abc")
    first, _ = tables.current(reader)
    assert first is not None
    tables.current(other)
    lives["b"].release()
    commit(writer, lambda state: st.complete_round(state, [node("a"), node("c")], NODES))
    commit(writer, lambda state: st.publish_master(state, 2, 29500))
    state, _ = tables.current(reader)
    assert state is not None
    assert state.master_port == 29500
    last = {member.node_id: member for member in first.members}
    assert all(member is last[member.node_id] for member in state.members), state.members
    also, _ = tables.current(other)
    assert also is not None
    assert also.members is state.members, "each connection made a tuple of its own"


def test_a_loss_round_made_by_one_connection_is_not_made_or_encoded_again_by_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connections of a process hold the same last round and see the same members go:
    the first one makes the table and checks its encoding against the digest, the others
    find it made. Each encoding of its own was O(N) for every connection of the process."""
    server = MemoryServer()
    writer, reader, other = connect(server), connect(server), connect(server)
    lives = joined(server, "abcd")
    started(writer, "abcd")
    tables.current(reader)
    tables.current(other)
    lives["b"].release()
    commit(writer, lambda state: st.complete_round(state, [node("a"), node("c"), node("d")], NODES))
    state, _ = tables.current(reader)
    assert state is not None
    encoded: list[tuple[NodeInfo, ...]] = []
    encode = st.encode_table

    def counting(members: tuple[NodeInfo, ...]) -> bytes:
        encoded.append(members)
        return encode(members)

    monkeypatch.setattr(st, "encode_table", counting)
    also, _ = tables.current(other)
    assert also is not None
    assert also.members is state.members
    assert [member.node_id for member in also.members] == ["a", "c", "d"]
    assert encoded == [], "a connection encoded the table another one of its process made"


def test_a_state_whose_table_was_forgotten_is_read_again_from_the_server() -> None:
    """A view two rounds behind names a table ``forget_rounds`` removed: the state is read
    again (a compare-and-set on the stale token, which cannot win), not taken for damage."""
    server = MemoryServer()
    store = connect(server)
    started(store, "ab")
    old = store.get_state()
    for _ in range(2):
        commit(store, lambda state: st.complete_round(state, [node("a"), node("b")], NODES))
    store.forget_rounds(2)
    fresh = connect(server)  # holds no table yet
    state, token = tables.current(fresh, old)
    assert state is not None
    assert state.round == 3
    assert token == store.get_state()[1]
    assert [member.node_id for member in state.members] == ["a", "b"]


def test_a_current_state_whose_table_is_missing_is_refused_in_one_sentence() -> None:
    server = MemoryServer()
    store = connect(server)
    started(store, "ab")
    store.forget_rounds(5)  # what no agent does: the current round's table goes
    with pytest.raises(tables.MissingTable) as refused:
        tables.current(connect(server))
    message = str(refused.value)
    assert "The table of round 1 (" in message
    assert message.endswith("cancel the job and submit it again.")
    assert "\n" not in message


def test_a_watch_callback_reads_no_table_it_does_not_hold() -> None:
    server = MemoryServer()
    writer, reader = connect(server), connect(server)
    started(writer, "ab")
    asked = counted(reader)
    data, _ = reader.get_state()
    assert data is not None
    assert tables.read(reader, data, fetch=False) is None
    assert asked == []
    assert tables.read(reader, data) is not None
    assert tables.read(reader, data, fetch=False) is not None, "held once read"
    assert asked == [1]


def test_an_agent_that_cannot_read_a_new_rounds_table_decides_again_a_moment_later() -> None:
    """A request for the table fails as the connection goes (its notice not there yet): the
    agent waits ``MEMBERS_RETRY`` and decides again, as after a failed listing of members,
    instead of leaving the job. A state that is not one (garbage) still fails at once."""
    server = MemoryServer()
    started(connect(server), "ab")
    store = connect(server)
    settings = RendezvousSettings(run_id="job", nodes=NodeRange(2, 2))
    clock = ManualClock(100.0)
    agent = StoreRendezvous(settings, node("b"), store, clock=clock)
    fetch = store.table

    def cut(round_number: int, digest: str) -> bytes | None:
        raise RendezvousError("the connection is cut off")

    store.table = cut  # type: ignore[method-assign]
    agent.begin_round()
    step = agent.round_step()
    assert step.action is st.Action.WAIT
    assert step.wake_at == 100.0 + MEMBERS_RETRY
    store.table = fetch  # type: ignore[method-assign]
    decided = agent.round_step().action
    assert decided is st.Action.MARK_READY, "b, a member of round 1 without a, ends it"
