"""Who hung (agent/hangs.py): the pure rule over every node's evidence, case by case.

Two nodes, n0 (ranks 0, 1) and n1 (ranks 2, 3), unless a case says otherwise. The evidence is
what the agents would share: each rank's /proc state, collective marker, stack and age."""

from __future__ import annotations

import itertools
import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, fields, replace
from typing import cast

import pytest
from agent_fakes import MemoryJob
from hypothesis import given, settings
from hypothesis import strategies as hs
from typed_json import decodes_or_refuses, each_value_replaced, json_values, mutated

from hpc_elastic.agent import hangs, investigation
from hpc_elastic.agent.hangs import (
    AMBIGUOUS,
    CULPRIT,
    DISMISSED,
    EVIDENCE_FIELDS,
    EXITED,
    FINISHED,
    RANK_FIELDS,
    SUSPICION_FIELDS,
    VERDICT_FIELDS,
    Member,
    NodeEvidence,
    RankEvidence,
    Suspicion,
    Verdict,
    attribute,
    first_look,
)
from hpc_elastic.agent.workers import WorkerGroup
from hpc_elastic.errors import AgentError
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings, Round
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.memory import MemoryStore
from hpc_elastic.spec import NodeRange

MEMBERS = (Member("id0", "n0", 0, 2), Member("id1", "n1", 2, 2))
CAUGHT = Suspicion(rank=0, phase="step", waited=61.0, deadline=60.0)


def waiting(rank: int, op: str = "all_reduce #12") -> RankEvidence:
    """A rank that waits in a marked collective, and whose stack says so too."""
    return RankEvidence(
        rank,
        state="S",
        age=61.0,
        deadline=60.0,
        marker=f"in {op}",
        inside=True,
        stack="distributed_c10d.py:2950 in all_reduce, called from train.py:80 in step",
        waits_in="all_reduce",
        dumped=True,
    )


def in_backward(rank: int) -> RankEvidence:
    """A DDP rank waiting in the gradient all-reduce: its marker says it left should_stop's
    all_reduce (DDP's own is not marked), its stack says backward."""
    return RankEvidence(
        rank,
        state="S",
        age=61.0,
        deadline=60.0,
        marker="out all_reduce #12",
        inside=False,
        stack="graph.py:979 in _engine_run_backward, called from train.py:70 in step",
        waits_in="backward",
        dumped=True,
    )


def own_code(rank: int, state: str = "R") -> RankEvidence:
    """A rank hung in its own loop, in no collective."""
    return RankEvidence(
        rank,
        state=state,
        age=61.0,
        deadline=60.0,
        marker="out all_reduce #12",
        inside=False,
        stack="train.py:42 in spin",
        dumped=True,
    )


def stopped(rank: int, state: str = "T") -> RankEvidence:
    return RankEvidence(rank, state=state, age=62.0, deadline=60.0, marker="out all_reduce #12")


def nodes(*ranks: RankEvidence, stage: int = 2) -> dict[str, NodeEvidence]:
    """The evidence of every node that holds one of ``ranks``; n0 caught the hang."""
    found: dict[str, NodeEvidence] = {}
    for member in MEMBERS:
        mine = tuple(rank for rank in ranks if rank.rank in member.ranks)
        if mine:
            suspicion = CAUGHT if member.slot == "n0" else None
            found[member.node_id] = NodeEvidence(
                member.node_id, member.slot, mine, stage, suspicion
            )
    return found


def test_a_stopped_rank_is_blamed_and_not_the_ranks_of_another_node_that_wait_for_it() -> None:
    """The soak's case: rank 2 frozen, n0's ranks caught first, waiting in backward."""
    verdict = attribute(nodes(in_backward(0), in_backward(1), stopped(2), in_backward(3)), MEMBERS)
    assert (verdict.kind, verdict.rank, verdict.node_id, verdict.slot) == (CULPRIT, 2, "id1", "n1")
    assert verdict.reporter == "id1", "the culprit's own agent records the failure"
    assert verdict.sentence == (
        "Rank 2 on node 'n1' was stopped (state T) while ranks 0, 1 and 3 waited in backward "
        "for it; the job made no progress for 61.0 s in step (learned deadline 60.0 s)."
    )
    assert verdict.blames_a_node


@pytest.mark.parametrize(
    ("rank", "why"),
    [
        (stopped(3, "D"), "in uninterruptible sleep (state D)"),
        (stopped(3, "t"), "stopped (state t)"),
        (replace(own_code(3), dumped=False, stack=None), "silent to the stack-dump signal"),
    ],
)
def test_a_rank_that_cannot_answer_is_the_culprit(rank: RankEvidence, why: str) -> None:
    verdict = attribute(nodes(waiting(0), waiting(1), waiting(2), rank), MEMBERS)
    assert (verdict.kind, verdict.rank) == (CULPRIT, 3)
    assert f"Rank 3 on node 'n1' was {why} while ranks 0, 1 and 2 waited in" in verdict.sentence


def test_the_rank_that_never_entered_the_collective_is_blamed_with_where_it_hung() -> None:
    verdict = attribute(nodes(waiting(0), own_code(1), waiting(2), waiting(3)), MEMBERS)
    assert (verdict.kind, verdict.rank, verdict.slot) == (CULPRIT, 1, "n0")
    assert verdict.sentence.startswith(
        "Rank 1 on node 'n0' was outside every collective while ranks 0, 2 and 3 waited in "
        "all_reduce #12 for it; it hung in train.py:42 in spin;"
    )


def test_a_sleeping_rank_in_its_own_code_is_blamed_like_a_spinning_one() -> None:
    verdict = attribute(nodes(waiting(0), waiting(1), own_code(2, "S"), waiting(3)), MEMBERS)
    assert (verdict.kind, verdict.rank) == (CULPRIT, 2)


def test_a_ddp_rank_whose_marker_says_out_but_whose_stack_is_in_backward_waits() -> None:
    """Its marker only says it left the last marked collective: the stack has the last word."""
    verdict = attribute(nodes(in_backward(0), in_backward(1), own_code(2), in_backward(3)), MEMBERS)
    assert (verdict.kind, verdict.rank) == (CULPRIT, 2)


def test_every_rank_waiting_in_a_collective_its_peers_never_join_is_ambiguous() -> None:
    """Rank 1 skipped the all_reduce the others wait in and waits in another one."""
    evidence = nodes(waiting(0), waiting(1, "pair #12"), waiting(2), waiting(3))
    verdict = attribute(evidence, MEMBERS)
    assert verdict.kind == AMBIGUOUS
    assert verdict.rank is None
    assert not verdict.blames_a_node
    assert verdict.reporter == "id0", "the first member that answered records it"
    assert verdict.sentence == (
        "Every rank waited in a collective its peers never joined (ranks 0, 2 and 3 waited in "
        "all_reduce #12 and rank 1 in pair #12); no rank can be blamed; the job made no "
        "progress for 61.0 s in step (learned deadline 60.0 s)."
    )


def test_a_node_that_did_not_answer_leaves_the_hang_ambiguous_and_says_so() -> None:
    verdict = attribute(nodes(waiting(0), waiting(1)), MEMBERS)
    assert verdict.kind == AMBIGUOUS
    assert verdict.sentence.startswith(
        "Ranks 0 and 1 waited in all_reduce #12 for a rank that never arrived; ranks 2 and 3 "
        "did not answer; no rank can be blamed;"
    )


def test_ranks_stuck_on_two_nodes_blame_no_node() -> None:
    verdict = attribute(nodes(stopped(0), waiting(1), stopped(2), waiting(3)), MEMBERS)
    assert verdict.kind == AMBIGUOUS
    assert (
        "Ranks 0 (node 'n0') and 2 (node 'n1') on different nodes were each stopped (state T)"
        in (verdict.sentence)
    )


def test_two_stuck_ranks_of_one_node_blame_that_node_and_name_both() -> None:
    verdict = attribute(nodes(waiting(0), waiting(1), stopped(2), stopped(3, "D")), MEMBERS)
    assert (verdict.kind, verdict.rank, verdict.node_id) == (CULPRIT, 2, "id1")
    assert verdict.sentence.startswith("Ranks 2 and 3 on node 'n1' were stopped (state T) while")
    assert "for them;" in verdict.sentence


def test_a_finished_rank_is_never_blamed_and_a_lone_rank_stuck_in_its_code_is() -> None:
    """One node: rank 0 hangs in its own code, rank 1 said its loop is over."""
    members = (Member("id0", "n0", 0, 2),)
    done = RankEvidence(1, state=FINISHED, stack="train.py:9 in wait", dumped=True)
    evidence = {"id0": NodeEvidence("id0", "n0", (own_code(0, "S"), done), 2, CAUGHT)}
    verdict = attribute(evidence, members)
    assert (verdict.kind, verdict.rank) == (CULPRIT, 0)
    assert "stuck in its own code, in no collective; it hung in train.py:42 in spin" in (
        verdict.sentence
    )


def test_a_rank_that_died_of_a_vanished_peer_counts_as_waiting() -> None:
    echo = RankEvidence(3, state=EXITED, exit_code=1, echo=True)
    verdict = attribute(nodes(waiting(0), waiting(1), stopped(2), echo), MEMBERS)
    assert (verdict.kind, verdict.rank) == (CULPRIT, 2)
    assert "ranks 0 and 1 waited in all_reduce #12 and rank 3 in a collective" in verdict.sentence


def test_ranks_that_left_neither_a_marker_nor_a_stack_leave_it_ambiguous() -> None:
    """A script without the helpers, started without faulthandler: nothing to tell by."""
    blind = [RankEvidence(rank, state="S", age=61.0, deadline=60.0, dumped=True) for rank in (2, 3)]
    verdict = attribute(nodes(waiting(0), waiting(1), *blind), MEMBERS)
    assert verdict.kind == AMBIGUOUS
    assert "ranks 2 and 3 left no marker and no stack to tell" in verdict.sentence


def test_the_verdict_does_not_depend_on_the_order_the_evidence_came_in() -> None:
    evidence = nodes(in_backward(0), in_backward(1), stopped(2), in_backward(3))
    verdicts = {
        attribute(dict(order), MEMBERS).encode()
        for order in itertools.permutations(evidence.items())
    }
    assert len(verdicts) == 1


def test_a_rank_still_moving_on_a_busy_machine_dismisses_the_investigation() -> None:
    """Stage 1, nothing touched: rank 1 is outside any collective and beat 10 s ago (less than
    half its deadline): it is slow, not hung, and the others wait for it."""
    slow = RankEvidence(1, state="R", age=10.0, deadline=60.0, marker="out all_reduce #12")
    evidence = nodes(waiting(0), slow, waiting(2), waiting(3), stage=1)
    verdict = first_look(evidence, MEMBERS)
    assert verdict is not None
    assert (verdict.kind, verdict.rank) == (DISMISSED, 1)
    assert verdict.sentence.startswith("No hang: rank 1 still made progress 10.0 s ago")


@pytest.mark.parametrize(
    "rank",
    [
        replace(waiting(1), age=1.0),  # in a collective, however fresh: it waits
        replace(stopped(1), age=1.0),  # stopped: cannot be moving
        replace(own_code(1), age=31.0, stack=None, dumped=None),  # past half its deadline
        RankEvidence(1, state=FINISHED, age=1.0, deadline=60.0),  # not at work any more
    ],
)
def test_no_rank_that_waits_cannot_answer_or_is_past_half_its_deadline_dismisses(
    rank: RankEvidence,
) -> None:
    evidence = nodes(waiting(0), rank, waiting(2), waiting(3), stage=1)
    assert first_look(evidence, MEMBERS) is None


def test_evidence_and_verdicts_survive_the_store_and_garbage_is_refused() -> None:
    evidence = nodes(waiting(0), stopped(1))["id0"]
    assert NodeEvidence.decode(evidence.encode()) == evidence
    verdict = attribute(nodes(waiting(0), waiting(1), stopped(2), waiting(3)), MEMBERS)
    assert Verdict.decode(verdict.encode()) == verdict
    for garbage in (b"", b"[]", b'{"node_id": 1}', b'{"kind": "nonsense", "sentence": ""}'):
        assert NodeEvidence.decode(garbage) is None
    assert Verdict.decode(b'{"kind": "nonsense", "sentence": "", "reporter": ""}') is None


def test_a_hang_timeout_is_named_as_such() -> None:
    set_by_hand = replace(CAUGHT, overridden=True, deadline=4.0, waited=4.2)
    evidence = nodes(waiting(0), waiting(1), stopped(2), waiting(3))
    evidence["id0"] = replace(evidence["id0"], suspicion=set_by_hand)
    sentence = attribute(evidence, MEMBERS).sentence
    assert sentence.endswith("made no progress for 4.2 s in step (--hang-timeout 4.0 s).")


def test_a_rank_stalled_on_its_own_is_not_excused_by_another_that_moves() -> None:
    """Ranks that train without collectives (or of which nothing is known before their
    stacks): rank 0 stopped beating while rank 1 goes on. The first look dismisses nothing,
    and the stacks blame rank 0, never the rank still moving."""
    members = (Member("id0", "n0", 0, 2),)
    stalled = RankEvidence(0, state="S", age=61.0, deadline=60.0)
    going = RankEvidence(1, state="R", age=0.2, deadline=60.0)
    look = {"id0": NodeEvidence("id0", "n0", (stalled, going), 1, CAUGHT)}
    assert first_look(look, members) is None
    stacks = {
        "id0": NodeEvidence(
            "id0",
            "n0",
            (
                replace(stalled, stack="worker.py:9 in main", dumped=True),
                replace(going, stack="worker.py:12 in main", dumped=True),
            ),
            2,
            CAUGHT,
        )
    }
    verdict = attribute(stacks, members)
    assert (verdict.kind, verdict.rank) == (CULPRIT, 0)


def test_ranks_waiting_for_a_rank_still_moving_blame_nobody() -> None:
    """DDP on a busy machine: the waiting ranks' markers say "out" (the gradient all-reduce
    is not marked), so the first look cannot dismiss; their stacks say backward, and the rank
    they wait for still moves: slow, not stuck. Nobody is blamed."""
    slow = replace(own_code(2), age=12.0)
    verdict = attribute(nodes(in_backward(0), in_backward(1), slow, in_backward(3)), MEMBERS)
    assert verdict.kind == AMBIGUOUS
    assert "rank 2 (12.0 s ago) still made progress" in verdict.sentence


def test_ddp_ranks_blocked_on_an_event_may_wait_for_a_moving_rank_once() -> None:
    """Their markers say "out" (DDP's all-reduce is not marked), but the kernel says they
    sleep until an event (a futex): they may be waiting for the moving rank, and the first
    look dismisses. Not a second time: past ``EXCUSES`` deadlines their stacks are asked for.
    Nor for a rank asleep in ``sleep``: that one waits for nobody."""

    def blocked(rank: int, waited: float = 61.0, wchan: str = "futex_do_wait") -> RankEvidence:
        return RankEvidence(
            rank,
            state="S",
            age=61.0,
            waited=waited,
            wchan=wchan,
            deadline=60.0,
            marker="out all_reduce #12",
            inside=False,
        )

    slow = RankEvidence(1, state="R", age=10.0, waited=40.0, deadline=60.0)
    look = nodes(blocked(0), slow, blocked(2), blocked(3), stage=1)
    dismissed = first_look(look, MEMBERS)
    assert dismissed is not None
    assert dismissed.kind == DISMISSED
    again = nodes(replace(blocked(0), age=121.0), slow, blocked(2), blocked(3), stage=1)
    assert first_look(again, MEMBERS) is None
    asleep = nodes(blocked(0, wchan="hrtimer_nanosleep"), slow, blocked(2), blocked(3), stage=1)
    assert first_look(asleep, MEMBERS) is None


def test_a_rank_that_spins_on_a_busy_machine_is_not_moving_however_little_it_ran() -> None:
    """The machine gave rank 1 a sixth of a CPU: counted without its waits for one, its wait
    is short, but it burnt 0.9 s of CPU without a step that takes 20 ms: it spins."""
    spinner = RankEvidence(
        1,
        state="R",
        age=1.5,
        waited=9.0,
        deadline=4.0,
        cpu=0.9,
        cpu_per_step=0.02,
        marker="out all_reduce #24",
        inside=False,
    )
    assert spinner.spinning
    assert not spinner.moving
    assert not replace(spinner, cpu=0.04).spinning, "a slow step's worth is not spinning"
    assert not replace(spinner, cpu=0.3, cpu_per_step=0.001).spinning, "below the floor"
    verdict = attribute(
        nodes(
            in_backward(0),
            replace(spinner, stack="train.py:42 in spin", dumped=True),
            in_backward(2),
            in_backward(3),
        ),
        MEMBERS,
    )
    assert (verdict.kind, verdict.rank) == (CULPRIT, 1)


def test_a_rank_stopped_inside_a_collective_is_not_among_those_waiting_for_it() -> None:
    """Frozen in backward, rank 2's stack says it waits there too: it is the culprit, and the
    sentence names only the others as waiting (a run of test_hang_attribution.py once said
    "while ranks 0, 1, 2 and 3 waited in backward for it")."""
    frozen = replace(in_backward(2), state="T")
    verdict = attribute(nodes(in_backward(0), in_backward(1), frozen, in_backward(3)), MEMBERS)
    assert (verdict.kind, verdict.rank) == (CULPRIT, 2)
    assert "while ranks 0, 1 and 3 waited in backward for it;" in verdict.sentence


# --- notes read back from the store: typed, and a malformed one is ignored with one warning ----

evidence_values = hs.builds(
    NodeEvidence,
    node_id=hs.text(min_size=1, max_size=8),
    slot=hs.text(max_size=8),
    ranks=hs.lists(
        hs.builds(
            RankEvidence,
            rank=hs.integers(0, 10**4),
            state=hs.sampled_from(["R", "S", "T", "D", EXITED, FINISHED]),
            age=hs.floats(0, 1e6),
            cpu=hs.none() | hs.floats(0, 1e6),
            inside=hs.none() | hs.booleans(),
            dumped=hs.none() | hs.booleans(),
            exit_code=hs.none() | hs.integers(-64, 255),
        ),
        max_size=3,
    ).map(tuple),
    stage=hs.sampled_from([1, 2]),
    suspicion=hs.none() | hs.just(CAUGHT),
)


@settings(deadline=None)  # no timed assertion: a busy machine may take a second per example
@given(json_values)
def test_any_json_is_evidence_or_one_agent_error(value: object) -> None:
    data = json.dumps(value).encode()
    decodes_or_refuses(NodeEvidence.parse, data, AgentError, NodeEvidence)
    decodes_or_refuses(Verdict.parse, data, AgentError, Verdict, asdict)


@settings(deadline=None)
@given(evidence=evidence_values, data=hs.data())
def test_mutated_evidence_is_evidence_or_one_agent_error(
    evidence: NodeEvidence, data: hs.DataObject
) -> None:
    assert NodeEvidence.parse(evidence.encode()) == evidence
    mutant = mutated(json.loads(evidence.encode()), data)
    decodes_or_refuses(NodeEvidence.parse, mutant, AgentError, NodeEvidence)


def test_every_field_of_evidence_and_verdicts_meets_every_awkward_value() -> None:
    evidence = nodes(waiting(0), stopped(1))["id0"]
    for mutant in each_value_replaced(json.loads(evidence.encode())):
        decodes_or_refuses(NodeEvidence.parse, mutant, AgentError, NodeEvidence)
    verdict = attribute(nodes(waiting(0), waiting(1), stopped(2), waiting(3)), MEMBERS)
    for mutant in each_value_replaced(json.loads(verdict.encode())):
        decodes_or_refuses(Verdict.parse, mutant, AgentError, Verdict, asdict)


def test_every_field_of_the_notes_has_a_check() -> None:
    assert set(RANK_FIELDS) == {field.name for field in fields(RankEvidence)}
    assert set(SUSPICION_FIELDS) == {field.name for field in fields(Suspicion)}
    assert set(EVIDENCE_FIELDS) == {field.name for field in fields(NodeEvidence)}
    assert set(VERDICT_FIELDS) == {field.name for field in fields(Verdict)}


@pytest.mark.parametrize(
    ("path", "value", "said"),
    [
        (("ranks", 0, "rank"), True, "'ranks[0].rank' is True, not a whole number"),
        (("ranks", 0, "age"), math.nan, "'ranks[0].age' is nan, not a time"),
        (("ranks", 0, "inside"), "false", "'ranks[0].inside' is 'false', not true or false"),
        (("ranks", 1, "state"), ["T"], "'ranks[1].state' is ['T'], not a string"),
        (("suspicion", "waited"), "61", "'suspicion.waited' is '61', not a number of seconds"),
        (("stage",), 2.0, "'stage' is 2.0, not a whole number"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_not_coerced(
    path: tuple[str | int, ...], value: object, said: str
) -> None:
    raw = json.loads(nodes(waiting(0), stopped(1))["id0"].encode())
    at = raw
    for step in path[:-1]:
        at = at[step]
    at[path[-1]] = value
    with pytest.raises(AgentError) as refused:
        NodeEvidence.parse(json.dumps(raw).encode())
    assert said in str(refused.value)
    assert str(refused.value).endswith("run the same hpc-elastic version on every node.")


def test_a_malformed_note_is_one_warning_and_ignored_however_often_it_is_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    note = b'{"node_id": "id9", "slot": "n9", "ranks": [{"rank": "0"}], "stage": 1}'
    with caplog.at_level(logging.WARNING, logger="hpc_elastic.agent.hangs"):
        for _ in range(3):
            assert NodeEvidence.decode(note, "the note of id9") is None
            assert Verdict.decode(b'{"kind": "culprit"}', "the verdict") is None
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("Ignoring the note of id9: The hang evidence"), warnings
    assert "'ranks[0].rank' is '0', not a whole number" in warnings[0]
    assert warnings[1].startswith("Ignoring the verdict: The hang verdict"), warnings


def test_the_investigation_leaves_out_a_malformed_note_and_decides_on_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three nodes share on one stage through a real rendezvous: one note is not evidence, one
    is a stopped rank's. The verdict rests on the good one and says who did not answer; the
    malformed first answer agreed by some other version is taken for "go on", not a crash."""
    job = MemoryJob(RendezvousSettings("hangs", NodeRange.parse("3")))
    ids = ("id0", "id1", "id2")
    nodes_ = [NodeInfo(node_id, "127.0.0.1", 2, f"n{index}") for index, node_id in enumerate(ids)]
    rdzvs = [job.rendezvous(node) for node in nodes_]
    rdzv_round = Round(1, tuple(nodes_), "127.0.0.1", 1, 0, 3)
    garbage = b'{"node_id": "id1", "ranks": [], "stage": "two"}'
    rdzvs[1].share(investigation.topic(1, 1, investigation.STACKS), garbage)
    good = NodeEvidence("id2", "n2", (stopped(4), waiting(5)), 2, CAUGHT)
    rdzvs[2].share(investigation.topic(1, 1, investigation.STACKS), good.encode())
    rdzvs[2].agree(investigation.topic(1, 1, investigation.FIRST), b"[1, 2]")
    with caplog.at_level(logging.WARNING, logger="hpc_elastic.agent.hangs"):
        assert investigation.unanswered(rdzvs[0], 1, set()) == 1
        assert investigation.unanswered(rdzvs[0], 1, set()) == 1
        mine = NodeEvidence("id0", "n0", (waiting(0), waiting(1)), 2, CAUGHT)
        look = investigation.Investigation(
            rdzvs[0],
            rdzv_round,
            cast(WorkerGroup, None),  # not looked at: only the shared notes are
            1,
            {},
            None,
            0.01,
            interrupted=lambda: False,
        )
        verdict = look._verdict(mine)
    assert (verdict.kind, verdict.rank, verdict.node_id) == (CULPRIT, 4, "id2"), verdict
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2, warnings
    assert "the hang evidence of node 'id1'" in warnings[0] + warnings[1]
    assert "the first answer agreed on 'hang-1-1.first'" in warnings[0] + warnings[1]


def members_who_looked(
    count: int,
) -> tuple[list[str], list[StoreRendezvous], Round, list[NodeEvidence]]:
    """``count`` members of round 1 on one in-memory job (``id00``, ``id01``, ...), each with
    the evidence of its one waiting rank."""
    job = MemoryJob(RendezvousSettings("hangs", NodeRange.parse(str(count))))
    ids = [f"id{index:02d}" for index in range(count)]
    nodes_ = [NodeInfo(node_id, "127.0.0.1", 1, f"n{i}") for i, node_id in enumerate(ids)]
    rdzvs = [job.rendezvous(node) for node in nodes_]
    rdzv_round = Round(1, tuple(nodes_), "127.0.0.1", 1, 0, 3)
    looks = [
        NodeEvidence(node_id, f"n{i}", (waiting(i),), 1, CAUGHT) for i, node_id in enumerate(ids)
    ]
    return ids, rdzvs, rdzv_round, looks


def test_only_the_first_member_in_line_reads_every_members_evidence_to_propose_an_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every member reaches the first answer at about the same moment; each reading every
    member's evidence to propose its own was N² reads (16.7 million at 4,096 nodes). The
    others wait their turn: here a long one, so that the first in line comes after them."""
    count = 12
    _, rdzvs, rdzv_round, looks = members_who_looked(count)
    for rdzv, look in zip(rdzvs, looks, strict=True):
        rdzv.share(investigation.topic(1, 1, investigation.LOOK), look.encode())
    readers: list[str] = []
    read = StoreRendezvous.shared

    def counted(rdzv: StoreRendezvous, topic: str) -> dict[str, bytes]:
        readers.append(rdzv.node.node_id)
        return read(rdzv, topic)

    monkeypatch.setattr(StoreRendezvous, "shared", counted)
    monkeypatch.setattr(investigation, "turn", lambda place: 120.0 * place)

    def first_look(index: int) -> hangs.Verdict | None:
        return investigation.Investigation(
            rdzvs[index], rdzv_round, cast(WorkerGroup, None), 1, {}, None, 0.01, lambda: False
        )._first_look(looks[index])

    with ThreadPoolExecutor(count) as pool:
        later = [pool.submit(first_look, index) for index in range(1, count)]
        first = first_look(0)
        answers = [future.result(timeout=60) for future in later]
    assert readers == ["id00"]
    assert answers == [first] * (count - 1)


def test_only_the_first_member_in_line_follows_who_shared_evidence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every member waited for every member's evidence by following who shared it: on
    ZooKeeper, every connection listed the topic's notes again after each burst of them, O(N²)
    bytes at 4,096 nodes. Only the first in line, which proposes the answer, follows them; the
    others wait for the answer alone."""
    count = 12
    ids, rdzvs, rdzv_round, looks = members_who_looked(count)
    evidence = investigation.topic(1, 1, investigation.LOOK)
    for rdzv, look in zip(rdzvs, looks, strict=True):
        rdzv.share(evidence, look.encode())
    monkeypatch.setattr(investigation, "turn", lambda place: 120.0 * place)

    def wait_then_look(index: int) -> hangs.Verdict | None:
        look = investigation.Investigation(
            rdzvs[index], rdzv_round, cast(WorkerGroup, None), 1, {}, None, 0.01, lambda: False
        )
        assert look._wait_for(investigation.LOOK, investigation.FIRST, give_up_on_change=True)
        return look._first_look(looks[index])

    with ThreadPoolExecutor(count) as pool:
        later = [pool.submit(wait_then_look, index) for index in range(1, count)]
        first = wait_then_look(0)
        answers = [future.result(timeout=60) for future in later]
    followed = {}
    for rdzv in rdzvs:
        store = rdzv._store
        assert isinstance(store, MemoryStore)
        followed[rdzv.node.node_id] = store.followed_topic
    assert followed == {node_id: evidence if node_id == "id00" else None for node_id in ids}
    assert answers == [first] * (count - 1)


def test_the_first_member_of_a_round_forgets_the_hangs_of_every_round_before_the_last() -> None:
    """Every member's evidence of a hang stays on the ensemble until the job closes (about 20
    MB at 4,096 nodes): a week of hourly hangs would outgrow its heap. The last round's are
    kept, for an agent still reading its verdict; a planted topic is not a round's."""
    _, rdzvs, first_round, looks = members_who_looked(3)
    for number in (1, 2, 3, 4):
        rdzvs[1].share(investigation.topic(number, 1, investigation.LOOK), looks[1].encode())
        rdzvs[1].agree(investigation.topic(number, 1, investigation.FIRST), investigation.GO_ON)
    for planted in ("hang-3a-1.look", "hang-x", "hang-3"):
        rdzvs[2].share(planted, b"planted")
    fifth = Round(5, first_round.members, "127.0.0.1", 1, 0, 3)
    assert investigation.past_topics(rdzvs[1], fifth) == [], "only the first member forgets"
    past = investigation.past_topics(rdzvs[0], fifth)
    assert past == [f"hang-{number}-1.{part}" for number in (1, 2, 3) for part in ("first", "look")]
    for name in past:
        rdzvs[0].forget(name)
    assert rdzvs[2].topics(investigation.TOPICS) == {
        "hang-4-1.look",
        "hang-4-1.first",
        "hang-3a-1.look",
        "hang-x",
        "hang-3",
    }
    assert rdzvs[2].shared(investigation.topic(2, 1, investigation.LOOK)) == {}
