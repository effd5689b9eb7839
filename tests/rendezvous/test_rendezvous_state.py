"""The pure rendezvous rules, without any store."""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import fields, replace
from typing import Any, cast

import pytest
import typed_json
from hypothesis import given
from hypothesis import strategies as hs
from typed_json import json_values, mutated, well_typed

from hpc_elastic.errors import RendezvousError
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import Failure, NodeInfo, RendezvousSettings, Round
from hpc_elastic.rendezvous.backend import table_digest
from hpc_elastic.spec import NodeRange

ONE_TO_FOUR = NodeRange(1, 4)
TWO_TO_THREE = NodeRange(2, 3)


def node(name: str) -> NodeInfo:
    return NodeInfo(node_id=name, host="127.0.0.1", nproc=2, slot=name)


def failure(name: str = "a") -> Failure:
    return Failure(
        node_id=name, host="127.0.0.1", rank=0, exit_code=1, signal=None, message="boom", time=1.0
    )


def running(*names: str, port: int | None = 29500) -> st.JobState:
    state = st.complete_round(st.JobState(max_restarts=2), [node(n) for n in names], ONE_TO_FOUR)
    return st.publish_master(state, state.round, port) if port else state


def back(names: str, state: st.JobState) -> st.JobState:
    """The state once these members of its round came back to rendezvous."""
    for name in names:
        state = st.mark_ready(state, name)
    return state


def stored(state: st.JobState) -> st.JobState:
    """``state`` as an agent reads it back: its document, filled from its members' table."""
    return st.decode(st.encode(state)).filled(st.encode_table(state.members))


def test_codec_round_trips_json_not_pickle() -> None:
    state = st.record_failure(running("a", "b"), 1, failure())
    data = st.encode(state)
    assert data.startswith(b"{")
    assert stored(state) == state


def test_the_document_names_its_members_table_and_does_not_grow_with_the_job() -> None:
    """A round of 1,000 members is committed by a document of the size of a round of two:
    the members are their table, which the document names by its digest."""
    few = running("a", "b")
    nodes = [node(f"node-{i:04d}") for i in range(1000)]
    many = st.complete_round(st.JobState(max_restarts=2), nodes, NodeRange(1, 1000))
    document = st.decode(st.encode(many))
    assert document.state.members == ()
    assert document.size == 1000
    assert document.table == table_digest(st.encode_table(many.members))
    assert abs(len(st.encode(many)) - len(st.encode(few))) < 100
    assert b"node-0001" not in st.encode(many)
    with pytest.raises(RendezvousError, match="holds 2 members where its state counts 1000"):
        document.filled(st.encode_table(few.members))


def test_a_table_that_lists_a_member_twice_is_refused_in_one_sentence() -> None:
    twice = (node("a"), node("a"))
    document = st.decode(st.encode(replace(running("a", "b"), members=twice)))
    with pytest.raises(RendezvousError, match="lists a member twice; check that every agent"):
        document.filled(st.encode_table(twice))


@pytest.mark.parametrize("data", [b"not json", b"{}", b'{"format": 99}', b"[1]"])
def test_decode_refuses_foreign_state_in_one_sentence(data: bytes) -> None:
    with pytest.raises(RendezvousError, match="same hpc-elastic version"):
        st.decode(data)


def test_complete_round_keeps_survivor_ranks_and_appends_newcomers() -> None:
    state = running("a", "b", "c")
    nxt = st.complete_round(state, [node("d"), node("c"), node("b")], ONE_TO_FOUR)
    assert [m.node_id for m in nxt.members] == ["b", "c", "d"]
    assert nxt.round == 2
    assert nxt.master_port is None


def test_complete_round_caps_at_max_preferring_survivors() -> None:
    state = running("a", "b")
    nxt = st.complete_round(state, [node(n) for n in "xyzab"], NodeRange(1, 3))
    assert [m.node_id for m in nxt.members] == ["a", "b", "x"]


@given(
    old=hs.lists(hs.sampled_from("abcdefgh"), min_size=1, max_size=4, unique=True),
    new=hs.lists(hs.sampled_from("abcdefgh"), min_size=1, max_size=8, unique=True),
)
def test_ranks_are_stable_and_rank0_stays_on_a_survivor(old: list[str], new: list[str]) -> None:
    nodes = NodeRange(1, 8)
    state = st.complete_round(st.JobState(max_restarts=0), [node(n) for n in old], nodes)
    nxt = st.complete_round(state, [node(n) for n in new], nodes)
    survivors = [n for n in old if n in new]
    assert [m.node_id for m in nxt.members][: len(survivors)] == survivors
    assert {m.node_id for m in nxt.members} == set(new)


def test_round_is_live_rules() -> None:
    state = running("a", "b")
    assert st.round_is_live(state, frozenset("ab"), ONE_TO_FOUR)
    assert not st.round_is_live(state, frozenset("a"), ONE_TO_FOUR), "a member left"
    assert not st.round_is_live(state, frozenset("abc"), ONE_TO_FOUR), "a node waits to join"
    assert st.round_is_live(state, frozenset("abc"), NodeRange(1, 2)), "spare beyond MAX"
    assert not st.round_is_live(
        st.record_failure(state, 1, failure()), frozenset("ab"), ONE_TO_FOUR
    )
    assert not st.round_is_live(st.JobState(max_restarts=1), frozenset(), ONE_TO_FOUR)


def test_a_finishing_round_ignores_arrivals_and_finished_members_but_not_lost_ones() -> None:
    finishing = st.record_success(running("a", "b"), 1, "a")
    assert st.round_is_live(finishing, frozenset("abc"), ONE_TO_FOUR), "c waits for the close"
    assert st.round_is_live(finishing, frozenset("b"), ONE_TO_FOUR), "a is done and may go"
    assert not st.round_is_live(finishing, frozenset("ac"), ONE_TO_FOUR), "b left unfinished"
    assert st.next_action(finishing, frozenset("abc"), "c", 0, ONE_TO_FOUR) is st.Action.FINISHING


@pytest.mark.parametrize(
    ("state", "alive", "me", "last", "expected", "action"),
    [
        (running("a", "b"), "ab", "a", 0, None, st.Action.RETURN),
        (running("a", "b", port=None), "ab", "a", 0, None, st.Action.PUBLISH_PORT),
        (running("a", "b", port=None), "ab", "b", 0, None, st.Action.AWAIT_PORT),
        (running("a", "b"), "ab", "a", 1, None, st.Action.MARK_READY),
        (back("a", running("a", "b")), "ab", "a", 1, None, st.Action.STRAGGLERS),
        (back("a", running("a", "b")), "a", "a", 1, None, st.Action.BELOW_MIN),
        # The same nodes again, nobody new: the last call has nobody to wait for.
        (back("ab", running("a", "b")), "ab", "a", 1, None, st.Action.COMPLETE),
        # ... unless Slurm says a third node is coming.
        (back("ab", running("a", "b")), "ab", "a", 1, 3, st.Action.LAST_CALL),
        (running("a"), "ab", "b", 0, None, st.Action.STRAGGLERS),
        (back("a", running("a")), "ab", "b", 0, None, st.Action.LAST_CALL),
        (back("a", running("a")), "ab", "b", 0, 2, st.Action.COMPLETE),
        (running("a", "b"), "abc", "c", 0, None, st.Action.STRAGGLERS),
        (back("ab", running("a", "b")), "abc", "c", 0, None, st.Action.COMPLETE),
        (back("bc", running("a", "b", "c")), "bcd", "d", 0, None, st.Action.COMPLETE),
        (st.JobState(max_restarts=1), "a", "a", 0, None, st.Action.BELOW_MIN),
        (st.JobState(max_restarts=1), "ab", "b", 0, None, st.Action.LAST_CALL),
        (st.JobState(max_restarts=1), "ab", "c", 0, None, st.Action.WAIT),
        # b back in rendezvous without finishing ends the finishing round (it used to WAIT
        # here for ever: the exit-barrier deadlock of issue 11).
        (st.record_success(running("a", "b"), 1, "a"), "ab", "b", 1, None, st.Action.MARK_READY),
        (st.record_success(running("a", "b"), 1, "a"), "abc", "c", 0, None, st.Action.FINISHING),
    ],
)
def test_next_action(
    *, state: st.JobState, alive: str, me: str, last: int, expected: int | None, action: st.Action
) -> None:
    assert (
        st.next_action(state, frozenset(alive), me, last, TWO_TO_THREE, expected=expected) is action
    )


def test_spare_beyond_max_waits() -> None:
    state = running("a", "b", "c")
    assert st.next_action(state, frozenset("abcd"), "d", 0, TWO_TO_THREE) is st.Action.WAIT


def test_failure_spends_one_restart_per_round_then_fails_the_job() -> None:
    state = running("a", "b")
    once = st.record_failure(state, 1, failure("a"))
    assert once.restarts_used == 1
    assert once.last_failure == failure("a")
    assert st.record_failure(once, 1, failure("b")) == once, "second report of round 1"
    assert st.record_failure(once, 7, failure("b")) == once, "report of another round"
    again = st.record_failure(
        st.complete_round(once, list(state.members), ONE_TO_FOUR), 2, failure()
    )
    assert again.restarts_used == 2
    assert not again.failed
    spent = st.record_failure(
        st.complete_round(again, list(state.members), ONE_TO_FOUR), 3, failure()
    )
    assert spent.failed
    assert "all 2 restarts are spent" in spent.failure_summary
    assert "boom" in spent.failure_summary


def test_membership_changes_never_spend_the_budget() -> None:
    state = running("a", "b")
    for names in ("a", "abc", "c"):
        state = st.complete_round(state, [node(n) for n in names], ONE_TO_FOUR)
    assert state.restarts_used == 0


def test_success_barrier_and_close() -> None:
    state = st.record_success(running("a", "b"), 1, "a")
    assert not st.all_succeeded(state)
    assert st.record_success(state, 1, "a") == state
    done = st.record_success(state, 1, "b")
    assert st.all_succeeded(done)
    assert st.close(done).closed


def test_fail_keeps_the_first_summary() -> None:
    state = st.fail(st.fail(running("a"), "first"), "second")
    assert state.failure_summary == "first"


def test_describe_is_flat_json() -> None:
    summary = st.describe(st.record_failure(running("a", "b"), 1, failure()))
    assert summary["round"] == 1
    assert summary["members"] == ["a", "b"]
    assert summary["world_size"] == 4
    assert summary["restarts"] == "1/2"
    assert summary["last_failure"]["message"] == "boom"


def test_to_round_needs_a_master_port() -> None:
    with pytest.raises(RendezvousError, match="no master port"):
        running("a", port=None).to_round()
    round_ = running("a", "b").to_round()
    assert (round_.master_addr, round_.master_port, round_.world_size) == ("127.0.0.1", 29500, 4)


def test_a_member_that_died_is_never_in_the_next_round() -> None:
    """b's session has not expired yet: a, back first, waits for b instead of forming a round
    with it; once b's membership is gone, a forms the next round alone."""
    state = back("a", running("a", "b"))
    assert not st.round_is_live(state, frozenset("ab"), ONE_TO_FOUR)
    assert st.next_action(state, frozenset("ab"), "a", 1, ONE_TO_FOUR) is st.Action.STRAGGLERS
    assert st.next_action(state, frozenset("a"), "a", 1, ONE_TO_FOUR) is st.Action.COMPLETE
    assert st.candidates(state, frozenset("a")) == {"a"}


def test_mark_ready_is_idempotent_and_only_for_members() -> None:
    state = back("a", running("a", "b"))
    assert st.mark_ready(state, "a") == state
    assert st.mark_ready(state, "z") == state
    assert st.complete_round(state, [node("a")], ONE_TO_FOUR).ready == ()


def test_the_first_member_back_ends_the_round_in_the_document_and_the_next_round_is_live() -> None:
    """Who is back is kept in marks beside the document; that one is back is in it."""
    state = back("b", running("a", "b", "c"))
    stored_state = stored(state)
    assert stored_state.ended, "the document says that the round ended"
    assert stored_state.ready == (), "and not who is back"
    assert st.round_over(stored_state)
    assert not st.round_is_live(stored_state, frozenset("abc"), ONE_TO_FOUR)
    after = st.complete_round(stored_state, [node("a"), node("b")], ONE_TO_FOUR)
    assert not after.ended
    assert st.round_is_live(after, frozenset("ab"), ONE_TO_FOUR)


def test_the_marks_seen_fill_in_who_is_back_among_the_members_in_rank_order() -> None:
    document = stored(back("c", running("a", "b", "c")))
    seen = st.with_back(document, frozenset({"c", "a", "stranger"}))
    assert seen.ready == ("a", "c")
    assert st.stragglers(seen, frozenset("abc")) == {"b"}
    assert st.with_back(seen, frozenset({"a", "c"})) is seen, "the same marks, the same state"
    assert stored(seen) == document, "marks are never written into the document"


def test_the_done_marks_seen_count_as_successes_after_the_documents_own_in_rank_order() -> None:
    document = stored(st.record_success(running("a", "b", "c", "d"), 1, "c"))
    seen = st.with_done(document, frozenset({"d", "a", "c", "stranger"}))
    assert seen.succeeded == ("c", "a", "d")
    assert st.unfinished(seen) == {"b"}
    assert st.barrier_action(seen, frozenset("acd"), 1, 0.0, 300.0) is st.Barrier.MEMBER_LOST
    assert st.barrier_action(seen, frozenset("abcd"), 1, 0.0, 300.0) is st.Barrier.WAIT
    assert st.all_succeeded(st.with_done(seen, frozenset("b")))
    assert st.with_done(document, frozenset({"c"})) is document, "nothing new, the same state"
    assert document.succeeded == ("c",), "the document keeps its own successes"


SETTINGS = RendezvousSettings("job", ONE_TO_FOUR, session_timeout=6.0, stop_grace=2.0)


def test_a_failure_after_a_success_ends_the_round_and_the_success_rejoins() -> None:
    """The exit-barrier deadlock: a succeeded, then b's worker failed with budget left. b must
    not wait on a's success, and a must leave the barrier to rerun with b."""
    state = st.record_success(running("a", "b"), 1, "a")
    state = st.record_failure(state, 1, failure("b"))
    assert st.next_action(state, frozenset("ab"), "b", 1, ONE_TO_FOUR) is st.Action.MARK_READY
    assert st.barrier_action(state, frozenset("ab"), 1, 0.0, 300.0) is st.Barrier.RESTART
    state = back("ab", state)
    assert st.next_action(state, frozenset("ab"), "a", 1, ONE_TO_FOUR) is st.Action.COMPLETE


def test_a_success_in_a_round_that_a_failure_ended_does_not_count() -> None:
    state = st.record_failure(running("a", "b"), 1, failure("b"))
    assert st.record_success(state, 1, "a") == state


def test_a_newcomer_still_waits_while_a_round_finishes_without_failure() -> None:
    state = st.record_success(running("a", "b"), 1, "a")
    assert st.next_action(state, frozenset("abc"), "c", 0, ONE_TO_FOUR) is st.Action.FINISHING
    assert st.barrier_action(state, frozenset("abc"), 1, 10.0, 300.0) is st.Barrier.WAIT


def test_the_exit_barrier_fails_a_member_that_never_finishes_at_its_deadline() -> None:
    state = st.record_success(running("a", "b"), 1, "a")
    assert st.barrier_action(state, frozenset("ab"), 1, 299.9, 300.0) is st.Barrier.WAIT
    assert st.barrier_action(state, frozenset("ab"), 1, 300.0, 300.0) is st.Barrier.TIMED_OUT
    assert st.barrier_action(state, frozenset("a"), 1, 1.0, 300.0) is st.Barrier.MEMBER_LOST
    assert st.unfinished(state) == {"b"}


def test_the_wait_for_stragglers_has_a_deadline_derived_from_the_settings() -> None:
    timeout = st.straggler_timeout(SETTINGS)
    assert timeout == 2.0 + (2 * 6.0 + st.MARGIN) + 6.0 + st.MARGIN
    assert timeout > st.echo_wait(SETTINGS) + SETTINGS.stop_grace
    assert not st.stragglers_overdue(None, 1e9, SETTINGS)
    assert not st.stragglers_overdue(100.0, 100.0 + timeout - 0.1, SETTINGS)
    assert st.stragglers_overdue(100.0, 100.0 + timeout, SETTINGS)


def test_only_a_round_superseded_by_arrivals_gives_its_workers_the_long_grace() -> None:
    state = running("a", "b")
    assert st.only_arrivals(state, frozenset("abc"), 1), "c waits to join: all ranks healthy"
    assert st.only_arrivals(back("a", state), frozenset("abc"), 1), "a stopped first"
    assert not st.only_arrivals(state, frozenset("ac"), 1), "b left: its ranks may be dead"
    assert not st.only_arrivals(st.record_failure(state, 1, failure("b")), frozenset("ab"), 1)
    assert not st.only_arrivals(st.record_success(state, 1, "a"), frozenset("abc"), 1)
    assert not st.only_arrivals(replace(state, excluded=("b",)), frozenset("abc"), 1)
    assert not st.only_arrivals(replace(state, round=2), frozenset("abc"), 1), "superseded"


class _Compared(frozenset[str]):
    """A membership that counts how often it is compared with, or intersected by, a round's
    members (Python asks a subclass's reflected operator first)."""

    compared = 0

    def __ge__(self, other: AbstractSet[object]) -> bool:
        _Compared.compared += 1
        return frozenset(self) >= other

    def __rand__(self, other: AbstractSet[str]) -> frozenset[str]:
        _Compared.compared += 1
        return frozenset(self) & other


def test_the_agents_of_a_superseded_round_compare_its_members_with_the_list_once() -> None:
    """Every agent that sees its round superseded asks whether only arrivals did it and
    whether a peer was lost; with the same round and the same list, the members are compared
    with the list once, not once an agent (O(N) each: N² in a process of N agents)."""
    state = running("a", "b", "c")
    alive = _Compared("abcd")
    _Compared.compared = 0
    for _ in range(100):
        assert st.only_arrivals(state, alive, 1)
        assert not st.peer_lost(state, alive, 1)
    assert _Compared.compared <= 1


def test_the_members_here_of_a_round_listed_whole_are_its_member_ids_themselves() -> None:
    """No second set of N ids kept for each list, and the very object for whatever is
    memoized on the members here next."""
    state = running("a", "b", "c")
    assert st._members_here(state, frozenset("abcd")) is state.member_ids
    assert st._members_here(state, frozenset("acd")) == frozenset("ac")


def test_the_arrival_grace_ends_before_the_others_leave_the_node_out() -> None:
    """An agent that spends the whole arrival grace still comes back within the others'
    wait for stragglers (a round ended by arrivals has no echo to wait for)."""
    assert st.arrival_grace(SETTINGS) > SETTINGS.stop_grace
    assert st.arrival_grace(SETTINGS) + SETTINGS.session_timeout < st.straggler_timeout(SETTINGS)


def test_a_stuck_straggler_is_left_out_and_cannot_stall_the_next_round() -> None:
    """b is alive (its agent is stuck on an unkillable worker) but never comes back."""
    state = back("a", running("a", "b"))
    alive = frozenset("ab")
    assert st.next_action(state, alive, "a", 1, ONE_TO_FOUR) is st.Action.STRAGGLERS
    overdue = st.next_action(state, alive, "a", 1, ONE_TO_FOUR, stragglers_overdue=True)
    assert overdue is st.Action.LAST_CALL
    state = st.complete_round(state, [node("a")], ONE_TO_FOUR, exclude=frozenset("b"))
    state = st.publish_master(state, 2, 29500)
    assert state.excluded == ("b",)
    assert st.round_is_live(state, alive, ONE_TO_FOUR), "the stuck b must not supersede round 2"
    assert st.next_action(state, alive, "a", 1, ONE_TO_FOUR) is st.Action.RETURN
    assert st.next_action(state, alive, "b", 1, ONE_TO_FOUR) is st.Action.READMIT
    back_again = st.readmit(state, "b")
    assert back_again.excluded == ()
    assert not st.round_is_live(back_again, alive, ONE_TO_FOUR), "b now arrives as a newcomer"


def test_excluded_nodes_that_died_are_forgotten_at_the_next_round() -> None:
    state = st.complete_round(running("a", "b"), [node("a")], ONE_TO_FOUR, exclude=frozenset("b"))
    assert st.complete_round(state, [node("a"), node("b")], ONE_TO_FOUR).excluded == ()


def test_a_member_back_without_finishing_ends_a_finishing_round_without_spending_budget() -> None:
    """Found by the simulation: b was fenced (cut off) after a succeeded; b can never finish
    round 1, so it ends the round and both rerun; the budget is untouched."""
    state = st.record_success(running("a", "b"), 1, "a")
    assert st.next_action(state, frozenset("ab"), "b", 1, ONE_TO_FOUR) is st.Action.MARK_READY
    state = st.mark_ready(state, "b")
    assert st.barrier_action(state, frozenset("ab"), 1, 0.0, 300.0) is st.Barrier.RESTART
    assert st.record_success(state, 1, "b") == state
    assert state.restarts_used == 0


def test_a_shrink_completes_at_once_instead_of_waiting_the_last_call() -> None:
    """Issue 17: a `3:4` round that lost d waited the last call (1 s) for nodes that nobody
    had started; every candidate was a member and every live member is back."""
    state = back("abc", running("a", "b", "c", "d"))
    alive = frozenset("abc")
    assert st.no_newcomer(state, alive)
    assert st.next_action(state, alive, "a", 1, NodeRange(3, 4)) is st.Action.COMPLETE


def test_a_shrink_still_waits_the_last_call_when_slurm_says_a_node_is_coming() -> None:
    state = back("abc", running("a", "b", "c", "d"))
    alive = frozenset("abc")
    action = st.next_action(state, alive, "a", 1, NodeRange(3, 4), expected=4)
    assert action is st.Action.LAST_CALL
    assert st.next_action(state, alive, "a", 1, NodeRange(3, 4), expected=3) is st.Action.COMPLETE


def test_a_newcomer_or_a_straggler_keeps_the_last_call_after_a_shrink() -> None:
    state = back("abc", running("a", "b", "c", "d"))
    with_newcomer = frozenset("abce")
    assert not st.no_newcomer(state, with_newcomer)
    assert st.next_action(state, frozenset("abe"), "a", 1, NodeRange(3, 5)) is st.Action.LAST_CALL
    stuck = back("ab", running("a", "b", "c", "d"))
    overdue = st.next_action(
        stuck, frozenset("abc"), "a", 1, NodeRange(2, 4), stragglers_overdue=True
    )
    assert overdue is st.Action.LAST_CALL, "c is stuck, not gone: its slot may be refilled"
    without_c = st.publish_master(
        st.complete_round(stuck, [node("a"), node("b")], NodeRange(2, 4), exclude=frozenset("c")),
        2,
        29500,
    )
    again = back("ab", without_c)
    action = st.next_action(again, frozenset("abc"), "a", 2, NodeRange(2, 4))
    assert action is st.Action.LAST_CALL, "c is alive and may come back (READMIT) any moment"
    gone = st.next_action(again, frozenset("ab"), "a", 2, NodeRange(2, 4))
    assert gone is st.Action.COMPLETE


def test_the_first_round_always_waits_the_last_call() -> None:
    fresh = st.JobState(max_restarts=1)
    assert not st.no_newcomer(fresh, frozenset("ab"))
    assert st.next_action(fresh, frozenset("ab"), "a", 0, NodeRange(2, 4)) is st.Action.LAST_CALL


TWO = NodeRange(2, 2)


def test_a_hot_spare_waits_beside_a_full_round_and_replaces_a_lost_member() -> None:
    """submit --spares 1 with --nodes 2:2: c's agent waits, and the round ignores it."""
    state = running("a", "b")
    assert st.round_is_live(state, frozenset("abc"), TWO)
    assert st.is_spare(state, frozenset("abc"), "c", TWO)
    assert st.spares(state, frozenset("abc"), TWO) == {"c"}
    assert st.next_action(state, frozenset("abc"), "c", 0, TWO) is st.Action.WAIT
    # b's node dies: a comes back, and with the spare the next round is full at once.
    lost = back("a", state)
    assert not st.spares(lost, frozenset("ac"), TWO), "the round is over: c is a candidate now"
    assert st.next_action(lost, frozenset("ac"), "c", 0, TWO) is st.Action.COMPLETE
    assert st.next_action(lost, frozenset("ac"), "a", 1, TWO) is st.Action.COMPLETE
    nxt = st.complete_round(lost, [node("a"), node("c")], TWO)
    assert [m.node_id for m in nxt.members] == ["a", "c"], "the survivor keeps rank 0"


def test_of_two_spares_one_replaces_the_lost_member_and_the_other_stays_a_spare() -> None:
    lost = back("a", running("a", "b"))
    nxt = st.publish_master(st.complete_round(lost, [node("a"), node("c"), node("d")], TWO), 2, 1)
    assert [m.node_id for m in nxt.members] == ["a", "c"]
    assert st.spares(nxt, frozenset("acd"), TWO) == {"d"}


def test_a_node_beside_a_round_below_max_is_a_newcomer_not_a_spare() -> None:
    state = running("a", "b")
    assert not st.is_spare(state, frozenset("abc"), "c", TWO_TO_THREE)
    assert not st.round_is_live(state, frozenset("abc"), TWO_TO_THREE), "the job grows instead"


def test_a_spare_beside_a_finishing_round_is_no_spare_any_more() -> None:
    finishing = st.record_success(running("a", "b"), 1, "a")
    assert not st.is_spare(finishing, frozenset("abc"), "c", TWO)
    assert st.next_action(finishing, frozenset("abc"), "c", 0, TWO) is st.Action.FINISHING


def test_a_job_runs_from_its_first_round_until_it_closes_or_fails() -> None:
    """A node arriving at a running job ends its round (``Agent._warm_up`` waits first)."""
    trains = running("a")
    assert not st.running(None)  # no agent arrived yet
    assert not st.running(st.JobState(max_restarts=3))  # the first round's last call is open
    assert st.running(trains)
    assert not st.running(st.close(trains))
    assert not st.running(st.fail(trains, "rank 0 failed"))


# --- the codec: a typed decoder, fuzzed ------------------------------------------------------


def fields_of(data: bytes) -> dict[str, Any]:
    return dict(json.loads(data))


@pytest.mark.parametrize(
    ("path", "value", "said"),
    [
        (("closed",), "no", "'closed' is 'no', not true or false"),
        (("round",), True, "'round' is True, not a whole number"),
        (("round",), 1.5, "'round' is 1.5, not a whole number"),
        (("master_port",), 70000, "'master_port' is 70000, out of range (from 1 to 65535)"),
        (("restarts_used",), -1, "'restarts_used' is -1, out of range (0 or more)"),
        (("succeeded",), "a", "'succeeded' is 'a', not a list"),
        (("ended",), 1, "'ended' is 1, not true or false"),
        (("ready",), ["a"], "it has an unknown field 'ready'"),
        (("members",), [], "it has an unknown field 'members'"),
        (("table",), "abc", "'table' is 'abc', not a sha256 digest in hex"),
        (("table",), "", "it names table '' for 2 members"),
        (("size",), -1, "'size' is -1, out of range (0 or more)"),
        (("last_failure",), {"rank": 0}, "'last_failure' lacks 'exit_code'"),
        (("last_failure", "time"), "now", "'last_failure.time' is 'now', not a number of seconds"),
        (("last_failure", "time"), 1e400, "'last_failure.time' is inf, not a time"),
        (("failure_summary",), None, "'failure_summary' is None, not a string"),
        (("format",), 3.0, "its format is 3.0"),
        (("restarts_used",), 3, "it spends more restarts than it has"),
        (("failed_round",), 9, "it failed a round that has not formed yet"),
    ],
)
def test_a_state_field_of_the_wrong_type_or_range_is_refused_in_one_sentence(
    path: tuple[str | int, ...], value: object, said: str
) -> None:
    """A field is checked before it is used: ``closed: "no"`` was once taken as closed."""
    raw = fields_of(st.encode(st.record_failure(running("a", "b"), 1, failure())))
    refused_in_one_sentence(st.decode, raw, path, value, said)


def refused_in_one_sentence(
    decode: Callable[[bytes], object],
    raw: Any,
    path: tuple[str | int, ...],
    value: object,
    said: str,
) -> None:
    """``decode`` of ``raw`` with ``value`` planted at ``path`` is one sentence saying ``said``."""
    place: Any = raw
    for step in path[:-1]:
        place = place[step]
    place[path[-1]] = value
    with pytest.raises(RendezvousError) as refused:
        decode(json.dumps(raw).encode())
    message = str(refused.value)
    assert said in message
    assert message.endswith("check that every agent runs the same hpc-elastic version.")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("path", "value", "said"),
    [
        ((0, "host"), ["x"], "'members[0].host' is ['x'], not a string"),
        ((0, "nproc"), "2", "'members[0].nproc' is '2', not a whole number"),
        ((0, "nproc"), 0, "'members[0].nproc' is 0, out of range (1 or more)"),
        ((1,), "b", "'members[1]' is 'b', not an object"),
    ],
)
def test_a_member_of_the_wrong_type_in_a_table_is_refused_in_one_sentence(
    path: tuple[str | int, ...], value: object, said: str
) -> None:
    raw = json.loads(st.encode_table(running("a", "b").members))
    refused_in_one_sentence(st.decode_table, raw, path, value, said)


@pytest.mark.parametrize(
    "record",
    [{"node_id": "a", "host": ["x"], "nproc": 1, "slot": ""}, {"node_id": "a", "host": "h"}],
)
def test_a_member_record_of_the_wrong_shape_is_refused(record: dict[str, Any]) -> None:
    with pytest.raises(RendezvousError, match="is not a hpc-elastic node: "):
        st.decode_node(json.dumps(record).encode())


def test_every_field_of_the_state_and_its_records_has_a_check_in_the_decoder() -> None:
    """A field added to ``JobState`` (or ``NodeInfo``, ``Failure``) needs its row in the
    decoder's table, or every state would be refused as lacking it."""
    every = {field.name for field in fields(st.JobState)}
    assert st.VIEW_ONLY.issubset(every), "a view-only name that is no field hides nothing"
    assert set(st.STATE_FIELDS) == every - st.VIEW_ONLY
    assert not set(st.STATE_FIELDS) & st.VIEW_ONLY, "the document never holds the marks"
    assert set(st.TABLE_CHECKS) == {"table", "size"}, "the members' place is checked too"
    assert not set(st.TABLE_CHECKS) & every, "and is no field of the state"
    assert set(st.NODE_FIELDS) == {field.name for field in fields(NodeInfo)}
    assert set(st.FAILURE_FIELDS) == {field.name for field in fields(Failure)}


def assert_valid(state: st.JobState) -> None:
    assert well_typed(state, st.JobState), state
    assert stored(state) == state


names = hs.text(hs.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8)
nodes = hs.builds(NodeInfo, names, names, hs.integers(1, 16), hs.text(max_size=4))
failures = hs.builds(
    Failure,
    names,
    hs.text(max_size=8),
    hs.integers(0, 1000),
    hs.none() | hs.integers(0, 255),
    hs.none() | hs.sampled_from(["SIGKILL", "SIGSEGV"]),
    hs.text(max_size=40),
    hs.floats(0, 2e9),
    hs.text(max_size=4),
)


@hs.composite
def valid_states(draw: hs.DrawFn) -> st.JobState:
    """Any state the rules could make: members unique, the budget and rounds consistent."""
    members = draw(hs.lists(nodes, max_size=5, unique_by=lambda node: node.node_id))
    max_restarts = draw(hs.integers(0, 100))
    round_number = draw(hs.integers(0, 10**6))
    ids = hs.lists(names, max_size=4).map(tuple)
    return st.JobState(
        max_restarts=max_restarts,
        round=round_number,
        members=tuple(members),
        master_port=draw(hs.none() | hs.integers(1, 65535)),
        restarts_used=draw(hs.integers(0, max_restarts)),
        failed_round=draw(hs.integers(0, round_number)),
        last_failure=draw(hs.none() | failures),
        succeeded=draw(ids),
        ended=draw(hs.booleans()),
        failure_summary=draw(hs.text(max_size=20)),
        closed=draw(hs.booleans()),
        excluded=draw(ids),
    )


def decodes_or_refuses(data: bytes) -> None:
    """The codec's contract: a document that is valid in every field, or one RendezvousError."""
    document = typed_json.decodes_or_refuses(st.decode, data, RendezvousError, st.Document)
    if document is not None:
        state = cast(st.Document, document).state
        assert state.members == (), "the members are in their table"
        assert_valid(state)


@given(valid_states())
def test_every_valid_state_survives_its_encoding(state: st.JobState) -> None:
    assert_valid(state)


@given(json_values)
def test_any_json_decodes_to_a_table_of_members_or_one_rendezvous_error(value: object) -> None:
    members = typed_json.decodes_or_refuses(
        st.decode_table, json.dumps(value).encode(), RendezvousError, tuple[NodeInfo, ...]
    )
    if members is not None:
        assert st.decode_table(st.encode_table(cast(tuple[NodeInfo, ...], members))) == members


@given(json_values)
def test_any_json_decodes_to_a_valid_state_or_one_rendezvous_error(value: object) -> None:
    decodes_or_refuses(json.dumps(value).encode())
    if isinstance(value, dict):  # with the right format, the fields themselves are judged
        decodes_or_refuses(json.dumps({**value, "format": st.FORMAT}).encode())


@given(state=valid_states(), data=hs.data())
def test_a_mutated_valid_encoding_decodes_to_a_valid_state_or_one_rendezvous_error(
    state: st.JobState, data: hs.DataObject
) -> None:
    decodes_or_refuses(mutated(fields_of(st.encode(state)), data))


def test_a_success_in_a_job_that_failed_does_not_count() -> None:
    """Found by the simulation (seed 498): a node froze as its workers finished, the others'
    exit barrier failed the job for it, and once awake it recorded its success, the last,
    and closed the failed job: one node exited 1 and the others 0."""
    failed = st.fail(st.record_success(running("a", "b"), 1, "a"), "node 'b' left round 1")
    assert st.record_success(failed, 1, "b") == failed
    assert not st.all_succeeded(st.record_success(failed, 1, "b"))


# --- a killed node noticed at the speed of a closed connection ---------------------------------


def test_a_member_whose_link_closed_is_gone_at_once_and_the_round_forms_without_it() -> None:
    """c's agent was SIGKILLed: its link to a (the centre) ended with FIN, while its session
    lives on. Without the mark, the survivors wait for c as a straggler until its session
    expires; with it, they form the next round at once, without the last call (a shrink)."""
    alive = frozenset("abc")
    state = running("a", "b", "c")
    assert st.next_action(back("ab", state), alive, "a", 1, ONE_TO_FOUR) is st.Action.STRAGGLERS
    departed = st.depart(state, alive, "a", "c", 1)
    assert departed.departed == ("c",)
    assert st.present(departed, alive) == frozenset("ab")
    assert not st.round_is_live(departed, alive, ONE_TO_FOUR), "c's death ends the round"
    assert st.peer_lost(departed, alive, 1), "the survivors' ranks are blocked on c's"
    assert not st.only_arrivals(departed, alive, 1)
    both_back = back("ab", departed)
    assert st.stragglers(both_back, alive) == frozenset()
    assert st.next_action(both_back, alive, "a", 1, ONE_TO_FOUR) is st.Action.COMPLETE
    nxt = st.complete_round(both_back, [node("a"), node("b")], ONE_TO_FOUR)
    assert [member.node_id for member in nxt.members] == ["a", "b"]
    nxt = st.publish_master(nxt, 2, 29501)
    assert st.round_is_live(nxt, alive, ONE_TO_FOUR), "c, alive in the store, is no newcomer"
    assert st.next_action(nxt, alive, "b", 1, ONE_TO_FOUR) is st.Action.RETURN


def test_a_departed_node_that_is_alive_after_all_comes_back_and_supersedes_the_round() -> None:
    """A false report (the rule makes it impossible short of a bug): c's agent finds itself
    departed, comes back through READMIT like an excluded straggler, and is then a newcomer
    that ends the round the others formed without it: a restart, nothing worse."""
    alive = frozenset("abc")
    departed = st.depart(running("a", "b", "c"), alive, "a", "c", 1)
    assert st.next_action(departed, alive, "c", 1, ONE_TO_FOUR) is st.Action.READMIT
    nxt = st.publish_master(
        st.complete_round(back("ab", departed), [node("a"), node("b")], ONE_TO_FOUR), 2, 29501
    )
    assert st.next_action(nxt, alive, "c", 1, ONE_TO_FOUR) is st.Action.READMIT
    again = st.readmit(nxt, "c")
    assert again.departed == ()
    assert not st.round_is_live(again, alive, ONE_TO_FOUR), "c now arrives as a newcomer"


def second_round(names: str) -> st.JobState:
    """Round 2 of ``names``, every one of them back from round 1."""
    state = st.complete_round(back(names, running(*names)), [node(n) for n in names], ONE_TO_FOUR)
    return st.publish_master(state, 2, 29501)


PAIR = running("a", "b")
NO_DEPARTURE: dict[str, tuple[st.JobState, str, str, str, int]] = {
    "an older round's link": (second_round("abc"), "abc", "a", "c", 1),
    "a node of no round": (PAIR, "abx", "a", "x", 1),
    "a reporter of no round": (PAIR, "abx", "x", "b", 1),
    "itself": (PAIR, "ab", "a", "a", 1),
    "a node already gone from the store": (PAIR, "a", "a", "b", 1),
    "a finishing round": (st.record_success(PAIR, 1, "a"), "ab", "a", "b", 1),
    "a failed job": (st.fail(PAIR, "boom"), "ab", "a", "b", 1),
    "a closed job": (st.close(PAIR), "ab", "a", "b", 1),
    "a reporter left out": (replace(running("a", "b", "c"), excluded=("a",)), "abc", "a", "b", 1),
    "a departed reporter": (replace(running("a", "b", "c"), departed=("a",)), "abc", "a", "b", 1),
}
"""Closed links that say nothing: (state, alive, reporter, node, the link's round)."""


@pytest.mark.parametrize("why", NO_DEPARTURE)
def test_a_closed_link_departs_nobody_unless_both_ends_are_members_of_the_latest_round(
    why: str,
) -> None:
    """A link of round N ends whenever its node moves on to a later round (it closes the old
    links then): only while N is the latest round does its end say the peer's process exited."""
    state, alive, reporter, node_id, round_number = NO_DEPARTURE[why]
    assert st.depart(state, frozenset(alive), reporter, node_id, round_number) == state


def test_a_closed_link_in_a_round_that_already_failed_still_spares_the_wait_for_its_node() -> None:
    """A worker failure was recorded (the survivors' ranks failed at once on the dead peer's
    closed connection): the next round still waits for no straggler that is dead."""
    alive = frozenset("abc")
    failed = st.record_failure(running("a", "b", "c"), 1, failure("a"))
    departed = st.depart(failed, alive, "b", "c", 1)
    assert departed.departed == ("c",)
    assert st.stragglers(back("ab", departed), alive) == frozenset()


def test_departed_nodes_that_the_store_no_longer_lists_are_forgotten_at_the_next_mark() -> None:
    alive = frozenset("abcd")
    first = st.depart(running("a", "b", "c", "d"), alive, "a", "d", 1)
    assert st.depart(first, alive, "b", "d", 1) == first, "marked once"
    second = st.depart(first, frozenset("abc"), "a", "c", 1)  # d's session expired meanwhile
    assert second.departed == ("c",)
    assert stored(second) == second


def test_a_departed_node_is_not_expected_so_the_survivors_do_not_wait_the_last_call_for_it() -> (
    None
):
    """Under Slurm: c's node was killed and its links ended with FIN, but Slurm still shows
    its task running (it notices a crashed node only when it marks it down). Slurm's count of
    3 must not make a and b wait the last call for a node whose agent is gone."""
    alive = frozenset("abc")
    departed = back("ab", st.depart(running("a", "b", "c"), alive, "a", "c", 1))
    assert st.uncounted(departed, alive) == frozenset("c")
    assert st.still_coming(departed, alive, 3) == 2
    assert st.next_action(departed, alive, "a", 1, ONE_TO_FOUR, expected=3) is st.Action.COMPLETE
    not_reported = back("ab", running("a", "b", "c"))
    assert st.still_coming(not_reported, frozenset("ab"), 3) == 3, "only a mark discounts"


def test_a_node_slurm_is_starting_is_still_waited_for_beside_a_departed_one() -> None:
    """Slurm counts c's slot (its agent departed) and d's, which is starting: a and b wait
    the last call for d, not for c."""
    alive = frozenset("abc")
    departed = back("ab", st.depart(running("a", "b", "c"), alive, "a", "c", 1))
    action = st.next_action(departed, alive, "a", 1, ONE_TO_FOUR, expected=4)
    assert action is st.Action.LAST_CALL
    assert st.next_action(departed, frozenset("abcd"), "a", 1, ONE_TO_FOUR, expected=4) is (
        st.Action.COMPLETE
    ), "d is here: every node that can come"


def test_a_departed_node_is_counted_again_once_its_session_expires() -> None:
    """The mark says something only while the store lists the node: after its session
    expired (the mark stays until the next one), Slurm's count is taken as it is, so a slot
    that Slurm requeues and starts anew is waited for again."""
    alive = frozenset("abc")
    departed = back("ab", st.depart(running("a", "b", "c"), alive, "a", "c", 1))
    expired = frozenset("ab")
    assert departed.departed == ("c",)
    assert st.uncounted(departed, expired) == frozenset()
    assert st.still_coming(departed, expired, 3) == 3
    assert st.next_action(departed, expired, "a", 1, ONE_TO_FOUR, expected=3) is (
        st.Action.LAST_CALL
    )
    assert st.still_coming(departed, alive, None) is None, "no count, nothing to take off"


def test_a_requeued_slot_joins_beside_the_departed_agent_it_replaces() -> None:
    """c's task was requeued and a new agent, c2 (a new node id: one per agent process),
    starts in the same slot while c's session still lives: c2 is a newcomer like any other.
    It ends the round a and b formed without c, and the next round takes it in."""
    alive = frozenset({"a", "b", "c"})
    departed = back("ab", st.depart(running("a", "b", "c"), alive, "a", "c", 1))
    survivors = st.publish_master(
        st.complete_round(departed, [node("a"), node("b")], ONE_TO_FOUR), 2, 29501
    )
    with_c2 = alive | {"c2"}
    assert st.still_coming(survivors, with_c2, 3) == 2, "c's slot is counted once, for c2"
    assert not st.round_is_live(survivors, with_c2, ONE_TO_FOUR), "c2 arrives"
    assert st.next_action(survivors, with_c2, "c2", 0, ONE_TO_FOUR, expected=3) is (
        st.Action.STRAGGLERS
    ), "c2 waits for a and b to come back"
    both_back = back("ab", survivors)
    assert st.next_action(both_back, with_c2, "c2", 0, ONE_TO_FOUR, expected=3) is (
        st.Action.COMPLETE
    )
    nxt = st.complete_round(both_back, [node("a"), node("b"), node("c2")], ONE_TO_FOUR)
    assert [member.node_id for member in nxt.members] == ["a", "b", "c2"]


def test_a_departed_node_that_comes_back_is_expected_and_counted_again() -> None:
    """A false report: c's agent lives, finds itself departed and comes back (READMIT); from
    then on it is neither taken off Slurm's count nor left out of the candidates."""
    alive = frozenset("abc")
    departed = back("ab", st.depart(running("a", "b", "c"), alive, "a", "c", 1))
    assert st.next_action(departed, alive, "c", 1, ONE_TO_FOUR, expected=3) is st.Action.READMIT
    again = st.readmit(departed, "c")
    assert st.uncounted(again, alive) == frozenset()
    assert st.still_coming(again, alive, 3) == 3
    assert st.next_action(again, alive, "c", 1, ONE_TO_FOUR, expected=3) is st.Action.MARK_READY
    ready = back("c", again)
    assert st.candidates(ready, alive) == frozenset("abc")
    assert st.next_action(ready, alive, "c", 1, ONE_TO_FOUR, expected=3) is st.Action.COMPLETE


def test_a_member_record_names_where_its_agent_takes_links() -> None:
    linked = replace(node("a"), link_port=40000)
    assert st.decode_node(st.encode_node(linked)) == linked
    with pytest.raises(RendezvousError, match="link_port"):
        st.decode_node(json.dumps({**json.loads(st.encode_node(linked)), "link_port": -1}).encode())


def test_the_proposer_is_the_lowest_ranked_member_that_counts() -> None:
    state = running("a", "b", "c")
    assert st.proposer(state, frozenset("abc")) == "a"
    assert st.proposer(state, frozenset("bc")) == "b", "rank 0 is gone: the next one"
    assert st.proposer(replace(state, excluded=("a",)), frozenset("abc")) == "b"
    assert st.proposer(replace(state, departed=("a", "b")), frozenset("abc")) == "c"
    assert st.proposer(state, frozenset("xy")) is None, "newcomers only: nobody to follow"


@given(
    size=hs.integers(0, 40),
    back=hs.sets(hs.integers(0, 45)),
    alive=hs.sets(hs.integers(0, 45)),
    ready=hs.sets(hs.integers(0, 40)),
    excluded=hs.sets(hs.integers(0, 45), max_size=3),
    most=hs.integers(1, 46),
)
def test_the_fast_paths_of_a_decision_agree_with_their_definitions(
    *, size: int, back: set[int], alive: set[int], ready: set[int], excluded: set[int], most: int
) -> None:
    """``with_back`` sorts a few marks by rank instead of scanning the round,
    ``has_stragglers``, ``round_is_live`` and ``candidate_count`` count instead of building
    sets, and ``position_among`` searches instead of scanning (thousands of members, every
    decision of every agent): each must say what the plain definition says."""
    names = [f"n{index:02d}" for index in range(46)]
    members = tuple(node(names[index]) for index in range(size))
    state = st.JobState(
        max_restarts=3,
        round=2,
        members=members,
        ready=tuple(m.node_id for m in members if int(m.node_id[1:]) in ready),
        excluded=tuple(names[index] for index in sorted(excluded)),
    )
    marks = frozenset(names[index] for index in back)
    here = frozenset(names[index] for index in alive)
    in_rank_order = tuple(m.node_id for m in members if m.node_id in marks)
    assert st.with_back(state, marks).ready == in_rank_order
    plain = (frozenset(m.node_id for m in members) & st.present(state, here)) - frozenset(
        state.ready
    )
    assert st.stragglers(state, here) == plain
    assert st.has_stragglers(state, here) == bool(plain)
    ids, counted = frozenset(m.node_id for m in members), st.present(state, here)
    live = not st.round_over(state) and ids <= counted and (size >= most or counted <= ids)
    assert st.round_is_live(state, here, NodeRange(1, most)) == live
    assert st.candidate_count(state, here) == len(st.candidates(state, here))
    for name in (names[0], names[size // 2], names[-1], "n", "n99"):
        assert st.position_among(here, name) == sum(1 for other in here if other < name)


def test_a_round_ranks_its_members_in_order_and_refuses_a_stranger() -> None:
    members = tuple(NodeInfo(f"n{i}", f"h{i}", nproc=i + 1) for i in range(5))
    first = Round(1, members, "h0", 29500, restarts_used=0, max_restarts=3)
    again = replace(first, number=2)
    assert [first.group_rank(f"n{i}") for i in range(5)] == [0, 1, 2, 3, 4]
    assert [again.first_rank(f"n{i}") for i in range(5)] == [0, 1, 3, 6, 10]
    with pytest.raises(RendezvousError, match="Node 'n9' is not a member of round 2"):
        again.group_rank("n9")
