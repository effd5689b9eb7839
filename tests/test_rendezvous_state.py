"""The pure rendezvous rules, without any store."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from hpc_elastic.errors import RendezvousError
from hpc_elastic.rendezvous import state as st
from hpc_elastic.rendezvous.api import Failure, NodeInfo
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


def test_codec_round_trips_json_not_pickle() -> None:
    state = st.record_failure(running("a", "b"), 1, failure())
    data = st.encode(state)
    assert data.startswith(b"{")
    assert st.decode(data) == state


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
    assert st.next_action(finishing, frozenset("abc"), "c", 0, ONE_TO_FOUR) is st.Action.WAIT


@pytest.mark.parametrize(
    ("state", "alive", "me", "last", "expected", "action"),
    [
        (running("a", "b"), "ab", "a", 0, None, st.Action.RETURN),
        (running("a", "b", port=None), "ab", "a", 0, None, st.Action.PUBLISH_PORT),
        (running("a", "b", port=None), "ab", "b", 0, None, st.Action.WAIT),
        (running("a", "b"), "ab", "a", 1, None, st.Action.MARK_READY),
        (back("a", running("a", "b")), "ab", "a", 1, None, st.Action.STRAGGLERS),
        (back("a", running("a", "b")), "a", "a", 1, None, st.Action.BELOW_MIN),
        (back("ab", running("a", "b")), "ab", "a", 1, None, st.Action.LAST_CALL),
        (running("a"), "ab", "b", 0, None, st.Action.STRAGGLERS),
        (back("a", running("a")), "ab", "b", 0, None, st.Action.LAST_CALL),
        (back("a", running("a")), "ab", "b", 0, 2, st.Action.COMPLETE),
        (running("a", "b"), "abc", "c", 0, None, st.Action.STRAGGLERS),
        (back("ab", running("a", "b")), "abc", "c", 0, None, st.Action.COMPLETE),
        (back("bc", running("a", "b", "c")), "bcd", "d", 0, None, st.Action.COMPLETE),
        (st.JobState(max_restarts=1), "a", "a", 0, None, st.Action.BELOW_MIN),
        (st.JobState(max_restarts=1), "ab", "b", 0, None, st.Action.LAST_CALL),
        (st.JobState(max_restarts=1), "ab", "c", 0, None, st.Action.WAIT),
        (st.record_success(running("a", "b"), 1, "a"), "ab", "b", 1, None, st.Action.WAIT),
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
    assert st.next_action(state, frozenset("a"), "a", 1, ONE_TO_FOUR) is st.Action.LAST_CALL
    assert st.candidates(state, frozenset("a")) == {"a"}


def test_mark_ready_is_idempotent_and_only_for_members() -> None:
    state = back("a", running("a", "b"))
    assert st.mark_ready(state, "a") == state
    assert st.mark_ready(state, "z") == state
    assert st.complete_round(state, [node("a")], ONE_TO_FOUR).ready == ()
