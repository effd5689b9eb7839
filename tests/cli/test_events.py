"""Typed events: kinds are a ``StrEnum``, the details readers use are typed records, and old
or foreign events files still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_elastic import events
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
