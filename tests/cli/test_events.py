"""Typed events: kinds are a ``StrEnum``, the details readers use are typed records, and old
or foreign events files still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_elastic import events
from hpc_elastic.agent import watchdog
from hpc_elastic.agent.agent import round_details
from hpc_elastic.errors import EventsError
from hpc_elastic.events import (
    CheckpointDetails,
    ChurnDetails,
    Event,
    FailedDetails,
    FailureDetails,
    Kind,
    RoundDetails,
    UnknownKind,
)
from hpc_elastic.ops import timeline
from hpc_elastic.rendezvous.api import NodeInfo, Round
from hpc_elastic.slurm import ending


def test_a_written_event_reads_back_with_its_kind_and_typed_details(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    formed = RoundDetails(world_size=4, members=("0", "1"), restarts_used=2)
    events.append(path, Event(Kind.ROUND, round=3, details=formed.to_details()))
    (event,) = events.read(path)
    assert event.kind is Kind.ROUND
    assert RoundDetails.from_details(event.details) == formed


def test_every_record_survives_its_own_round_trip() -> None:
    records: list[FailureDetails | FailedDetails | CheckpointDetails | ChurnDetails] = [
        FailureDetails(rank=2, exit_code=None, signal="SIGKILL", message="oom", hung=True),
        FailedDetails("budget spent"),
        CheckpointDetails(step=40, path="/ckpt/40"),
        ChurnDetails("kill", "3"),
    ]
    for record in records:
        assert type(record).from_details(json.loads(json.dumps(record.to_details()))) == record


def test_an_old_file_with_a_kind_this_version_does_not_know_keeps_the_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    lines = [
        {"kind": "round", "round": 1, "time": 1.0, "details": {"world_size": 2}},
        {"kind": "rebalanced", "time": 2.0, "details": {"shards": 8}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    known, unknown = events.read(path)
    assert known.kind is Kind.ROUND
    assert isinstance(unknown.kind, UnknownKind)
    assert unknown.kind == "rebalanced"
    assert timeline.describe(unknown) == "rebalanced shards=8"


def test_a_line_whose_details_are_of_the_wrong_types_is_skipped_not_read_as_defaults(
    tmp_path: Path,
) -> None:
    """A world size of "four" once read as 0 and ``true`` as 1: neither is what any agent
    wrote, so the line is skipped like a line of the wrong shape, and the next one counts."""
    path = tmp_path / "events.jsonl"
    hostile = {"world_size": "four", "members": "a,b", "restarts_used": True}
    fine = RoundDetails(world_size=2, members=("a", "b"), restarts_used=1).to_details()
    path.write_text(
        json.dumps({"kind": "round", "round": 1, "time": 1.0, "details": fine})
        + "\n"
        + json.dumps({"kind": "round", "round": 2, "time": 2.0, "details": hostile})
        + "\n"
    )
    summary = timeline.summarize(events.read(path))
    assert (summary.round, summary.world_size, summary.members) == (1, 2, ("a", "b"))
    with pytest.raises(EventsError) as refused:
        FailureDetails.from_details({"rank": "0", "message": 7})
    assert str(refused.value) == (
        "A 'failure' event's details are not of their types ('rank' is '0', not a whole "
        "number); the line is not one hpc-elastic writes, so it is skipped."
    )
    assert FailureDetails.from_details({"node_id": "n1-7", "phase": "running"}) == FailureDetails()


def _round_of(count: int) -> Round:
    members = tuple(
        NodeInfo(f"gpu-{i:05d}-4242-a1b2c3", f"10.0.{i // 256}.{i % 256}", 8, slot=f"{i}")
        for i in range(count)
    )
    return Round(7, members, "10.0.0.0", 29500, restarts_used=2, max_restarts=10)


def test_a_round_of_thousands_of_members_keeps_its_sizes_in_its_event(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events.append(
        path, Event(Kind.ROUND, round=7, details=round_details(_round_of(4096)).to_details())
    )
    (event,) = events.read(path)
    formed = RoundDetails.from_details(event.details)
    assert (formed.world_size, formed.count, formed.restarts_used) == (4096 * 8, 4096, 2)
    assert formed.members == tuple(str(i) for i in range(events.NAMES_SHOWN))
    summary = timeline.summarize([event])
    assert (summary.world_size, summary.member_count) == (4096 * 8, 4096)
    assert f"and {4096 - events.NAMES_SHOWN:,} more" in timeline.describe(event)


def test_a_small_round_lists_every_member_in_its_event() -> None:
    formed = round_details(_round_of(16))
    assert formed.members == tuple(str(i) for i in range(16))
    assert formed.count == 16


def test_the_loss_of_thousands_of_nodes_is_recorded_whole_in_lines_appended_whole(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    lost = [f"gpu-node-{i:05d}.cluster.example.org" for i in range(2048)]
    runs = events.in_lines(lost)
    for run in runs:
        events.append(path, Event(Kind.NODE_LOST, slot="0", round=3, details={"nodes": list(run)}))
    assert len(runs) > 1
    assert [node for run in runs for node in run] == lost
    assert ending.lost_slots(events.read(path)) == set(lost)


def test_a_line_of_status_names_the_first_members_and_counts_the_rest() -> None:
    names = [str(i) for i in range(4096)]
    assert timeline.listed(names, 4096) == ", ".join(names[:32]) + " and 4,064 more"
    assert timeline.listed(names[:32], 4096) == ", ".join(names[:32]) + " and 4,064 more"
    assert timeline.listed(["0", "1"], 2) == "0, 1"
    assert timeline.listed([], 3) == "3 members"


def test_reading_some_kinds_gives_exactly_the_events_of_those_kinds(tmp_path: Path) -> None:
    """Lines of other kinds are skipped unread, even those that name a wanted kind in their
    details or in a longer kind of their own."""
    path = tmp_path / "events.jsonl"
    written = [
        Event(Kind.CHECKPOINT, round=1, details={"step": 10, "path": "/c/10"}),
        Event(Kind.FAILURE, round=1, details={"rank": 0, "message": 'no "checkpoint" here'}),
        Event(Kind.CHECKPOINT_LOADED, round=2, details={"step": 10, "tier": "local"}),
        Event(Kind.ROUND, round=2, details={"world_size": 2, "members": ["checkpoint"]}),
        Event(Kind.CHECKPOINT, round=2, details={"step": 20, "path": "/c/20"}),
    ]
    for event in written:
        events.append(path, event)
    everything = list(events.read(path))
    wanted = [event for event in everything if event.kind == Kind.CHECKPOINT]
    assert [event.details["step"] for event in wanted] == [10, 20]
    assert list(events.read(path, events.CHECKPOINTS)) == wanted
    assert events.read_new(path, 0, events.CHECKPOINTS)[0] == wanted
    breaker = [event for event in everything if event.kind in (Kind.CHECKPOINT, Kind.FAILURE)]
    assert list(events.read(path, watchdog.BREAKER_KINDS)) == breaker


def test_a_happening_reported_by_thousands_of_slots_is_one_short_line() -> None:
    formed = round_details(_round_of(4096)).to_details()
    reports = [
        Event(Kind.ROUND, slot=str(slot), round=7, details=formed, time=1000.0 + slot / 4096)
        for slot in range(4096)
        if slot != 2048
    ]
    ((event, places),) = timeline.compact(reports)
    line = timeline.compact_line(event, places)
    assert "  0-2047,2049-4095  round 7: world size 32768 (0, 1, " in line
    assert line.endswith("and 4,064 more), restarts used 2")
    assert len(line) < 300
    assert timeline.places_of(["0", "1", "node0"]) == "0,1,node0"
