"""The typed decoders of what is read from shared places (``hpc_elastic/decoding.py``): a bad
node record, a slot's ledger and hold record, an event's details, a round assignment.

For each: a value the product writes survives its encoding; any JSON, and a valid encoding
with one value replaced, removed or added, decodes to a value whose every field has its
declared type or raises the decoder's one error, in one line (hypothesis); and the values
that were once coerced (``str(["x"])``, ``int(True)``, ``int(2.9)``, ``int("7")``, NaN) are
refused with a sentence naming the field and the value.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as hs
from typed_json import decodes_or_refuses, each_value_replaced, json_values, mutated

from hpc_elastic import events
from hpc_elastic.errors import AgentError, EventsError, RendezvousError, SlurmError
from hpc_elastic.events import DETAILS, Event, Kind
from hpc_elastic.rendezvous.badnode import BADNODE_FIELDS, BadNode, check_host
from hpc_elastic.slurm.departure import Departure
from hpc_elastic.slurm.holds import HOLD_RECORD_FIELDS, HoldRecord, decode_hold_record
from hpc_elastic.slurm.ledger import LEDGER_FIELDS, SlotLedger, decode_ledger
from hpc_elastic.train.assignment import (
    ROUND_KEYS,
    Assignment,
    decode_assignment,
    write_assignment,
)

texts = hs.text(max_size=12)
names = hs.text(hs.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8)
counts = hs.integers(0, 10**6)
hosts = hs.from_regex(r"[a-z][a-z0-9.-]{0,11}", fullmatch=True)
times = hs.floats(0, 4e9)


def encoded(value: Any) -> bytes:
    """A record as its writer stores it: ``json.dumps`` of its fields."""
    return json.dumps(asdict(value), sort_keys=True).encode()


def test_every_field_of_every_decoded_record_has_a_check() -> None:
    """A field added to a record needs its row in the decoder's table, or it would never be
    read back (and the round-trip tests below would not see it)."""
    assert set(BADNODE_FIELDS) == {field.name for field in fields(BadNode)}
    assert set(LEDGER_FIELDS) == {field.name for field in fields(SlotLedger)}
    assert set(HOLD_RECORD_FIELDS) == {field.name for field in fields(HoldRecord)}


# --- bad-node records (ZooKeeper, under the user's node) -------------------------------------

bad_nodes = hs.builds(BadNode, host=hosts, reason=texts, since=times, until=times, job=texts)


def parse_bad_node(data: bytes) -> BadNode:
    record = BadNode.parse(data)
    assert check_host(record.host) == record.host  # a host the exclude list can carry
    return record


@given(bad_nodes)
def test_every_bad_node_record_survives_its_encoding(record: BadNode) -> None:
    assert BadNode.parse(record.encode()) == record


@given(json_values)
def test_any_json_is_a_bad_node_record_or_one_rendezvous_error(value: object) -> None:
    decodes_or_refuses(parse_bad_node, json.dumps(value).encode(), RendezvousError, BadNode, asdict)


@given(record=bad_nodes, data=hs.data())
def test_a_mutated_bad_node_record_is_one_or_one_rendezvous_error(
    record: BadNode, data: hs.DataObject
) -> None:
    mutant = mutated(json.loads(record.encode()), data)
    decodes_or_refuses(parse_bad_node, mutant, RendezvousError, BadNode, asdict)


def test_every_bad_node_field_meets_every_awkward_value() -> None:
    record = BadNode("n1", "gpu", 1.0, 2.0, "job")
    for mutant in each_value_replaced(json.loads(record.encode())):
        decodes_or_refuses(parse_bad_node, mutant, RendezvousError, BadNode, asdict)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("host", ["x"], "'host' is ['x'], not a string"),
        ("host", "a/b", "'host' is 'a/b', not a node name"),
        ("since", math.nan, "'since' is nan, not a time"),
        ("until", math.inf, "'until' is inf, not a time"),
        ("until", "tomorrow", "'until' is 'tomorrow', not a number of seconds"),
        ("reason", 7, "'reason' is 7, not a string"),
    ],
)
def test_a_bad_node_field_of_the_wrong_type_is_refused_not_coerced(
    field: str, value: object, said: str
) -> None:
    raw = {**asdict(BadNode("n1", "gpu", 1.0, 2.0, "job")), field: value}
    with pytest.raises(RendezvousError) as refused:
        BadNode.parse(json.dumps(raw).encode())
    assert said in str(refused.value)
    assert str(refused.value).endswith("clear it with 'hpc-elastic nodes clear NODE'.")
    assert BadNode.decode(json.dumps(raw).encode()) is None  # the book forgets it


def test_a_bad_node_record_of_an_older_version_without_a_job_still_reads() -> None:
    old = {"host": "n1", "reason": "gpu", "since": 1, "until": 2}
    assert BadNode.parse(json.dumps(old).encode()) == BadNode("n1", "gpu", 1.0, 2.0, "")


# --- a slot's ledger and hold record (the job directory's slots/) ----------------------------

ledgers = hs.builds(
    SlotLedger,
    preemptions=counts,
    time_limits=counts,
    node_failures=hs.dictionaries(names, counts, max_size=3),
    excluded=hs.lists(names, max_size=3).map(tuple),
    running_on=hs.none() | texts,
    leaving_for=hs.none() | hs.sampled_from([why.value for why in Departure]),
)
hold_records = hs.builds(HoldRecord, releases=counts, released_at=hs.none() | counts, ended=counts)


def read_ledger(data: bytes) -> SlotLedger:
    return decode_ledger(data, "slots/0.json")


def read_hold_record(data: bytes) -> HoldRecord:
    return decode_hold_record(data, "slots/0.hold.json")


@given(ledgers)
def test_every_slot_ledger_survives_its_encoding(ledger: SlotLedger) -> None:
    assert read_ledger(encoded(ledger)) == ledger


@given(json_values)
def test_any_json_is_a_slot_ledger_or_one_slurm_error(value: object) -> None:
    decodes_or_refuses(read_ledger, json.dumps(value).encode(), SlurmError, SlotLedger, asdict)


@given(ledger=ledgers, data=hs.data())
def test_a_mutated_slot_ledger_is_one_or_one_slurm_error(
    ledger: SlotLedger, data: hs.DataObject
) -> None:
    mutant = mutated(json.loads(encoded(ledger)), data)
    decodes_or_refuses(read_ledger, mutant, SlurmError, SlotLedger, asdict)


@given(hold_records)
def test_every_hold_record_survives_its_encoding(record: HoldRecord) -> None:
    assert read_hold_record(encoded(record)) == record


@given(json_values)
def test_any_json_is_a_hold_record_or_one_slurm_error(value: object) -> None:
    decodes_or_refuses(read_hold_record, json.dumps(value).encode(), SlurmError, HoldRecord, asdict)


@given(record=hold_records, data=hs.data())
def test_a_mutated_hold_record_is_one_or_one_slurm_error(
    record: HoldRecord, data: hs.DataObject
) -> None:
    mutant = mutated(json.loads(encoded(record)), data)
    decodes_or_refuses(read_hold_record, mutant, SlurmError, HoldRecord, asdict)


def test_every_slot_file_field_meets_every_awkward_value() -> None:
    ledger = SlotLedger(1, 2, {"n1": 1}, ("n2",), "n3", Departure.PREEMPTION.value)
    for mutant in each_value_replaced(json.loads(encoded(ledger))):
        decodes_or_refuses(read_ledger, mutant, SlurmError, SlotLedger, asdict)
    for mutant in each_value_replaced(json.loads(encoded(HoldRecord(1, 5, 2)))):
        decodes_or_refuses(read_hold_record, mutant, SlurmError, HoldRecord, asdict)


@pytest.mark.parametrize(
    ("read", "record", "said"),
    [
        (read_ledger, {"preemptions": True}, "'preemptions' is True, not a whole number"),
        (read_ledger, {"time_limits": 2.9}, "'time_limits' is 2.9, not a whole number"),
        (read_ledger, {"node_failures": {"n1": "7"}}, "'node_failures['n1']' is '7', not a"),
        (read_ledger, {"leaving_for": "holiday"}, "'leaving_for' is 'holiday', not one of"),
        (read_ledger, {"excluded": ["n1", ""]}, "'excluded[1]' is empty"),
        (read_ledger, {"shelved": 1}, "it has an unknown field 'shelved'"),
        (read_hold_record, {"releases": True}, "'releases' is True, not a whole number"),
        (read_hold_record, {"released_at": 2.9}, "'released_at' is 2.9, not a whole number"),
        (read_hold_record, {"ended": "7"}, "'ended' is '7', not a whole number"),
        (read_hold_record, {"ended": -1}, "'ended' is -1, out of range (0 or more)"),
    ],
)
def test_a_count_or_name_of_the_wrong_type_in_a_slot_file_is_refused_not_coerced(
    read: Any, record: dict[str, object], said: str
) -> None:
    with pytest.raises(SlurmError) as refused:
        read(json.dumps(record).encode())
    assert said in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_slot_file_of_an_older_version_with_fewer_fields_still_reads() -> None:
    assert read_ledger(b'{"preemptions": 2}') == SlotLedger(preemptions=2)
    assert read_hold_record(b'{"releases": 1}') == HoldRecord(releases=1)


def test_an_unreadable_hold_record_starts_afresh_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from hpc_elastic.slurm.holds import load_hold_record  # noqa: PLC0415

    path = tmp_path / "0.hold.json"
    path.write_text('{"releases": true}')
    assert load_hold_record(path) == HoldRecord()
    assert "'releases' is True, not a whole number" in caplog.text
    assert caplog.text.rstrip().endswith("It starts afresh.")


# --- an event's details (events.jsonl) ------------------------------------------------------

DETAIL_VALUES: dict[str, Any] = {
    "world_size": counts,
    "members": hs.lists(texts, max_size=3),
    "restarts_used": counts,
    "member_count": counts,
    "rank": hs.none() | counts,
    "exit_code": hs.none() | hs.integers(0, 255),
    "signal": hs.none() | texts,
    "message": texts,
    "hung": hs.booleans(),
    "sentence": texts,
    "node_fault": hs.booleans(),
    "investigation": counts,
    "verdict": texts,
    "culprit_slot": texts,
    "evidence": hs.dictionaries(texts, texts, max_size=3),
    "logs": hs.dictionaries(texts, texts, max_size=3),
    "reason": texts,
    "step": hs.none() | counts,
    "path": texts,
    "tier": texts,
    "action": texts,
    "target": texts,
    "host": texts,
    "nproc": counts,
    "ranks": hs.lists(counts, max_size=3),
    "nodes": hs.lists(texts, max_size=3),
}
"""A value a writer may put under each detail's name, for the valid details of every kind."""
_EXAMPLE: dict[str, Any] = {
    "world_size": 2, "members": ["a", "b"], "restarts_used": 1, "member_count": 2,
    "rank": 0, "exit_code": 1,
    "signal": "SIGKILL", "message": "boom", "hung": False, "sentence": "s", "node_fault": True,
    "investigation": 1, "verdict": "culprit", "culprit_slot": "1", "evidence": {"0": "D"},
    "logs": {"0": "rank_0.log"}, "reason": "r", "step": 3, "path": "p", "tier": "local",
    "action": "kill", "target": "1", "host": "n1", "nproc": 2, "ranks": [0, 1], "nodes": ["2"],
}  # fmt: skip
"""One value a writer puts under each detail's name."""
details_kinds = hs.sampled_from(sorted(DETAILS))


def the_class(kind: str) -> type[Any]:
    """The details class a kind decodes to (what its table builds from empty details)."""
    return type(events.decode_details(kind, {}))


@hs.composite
def valid_details(draw: hs.DrawFn) -> tuple[str, dict[str, Any]]:
    """A kind, and details of it as its writers write them, with the agent's extra keys."""
    kind = draw(details_kinds)
    field_names = [field.name for field in fields(the_class(kind))]
    details = {name: draw(DETAIL_VALUES[name]) for name in field_names if draw(hs.booleans())}
    if draw(hs.booleans()):
        details.update(node_id="n1-42-abc", phase="running")
    return kind, details


def read_details(kind: str) -> Any:
    return lambda data: events.decode_details(kind, json.loads(data))


@given(valid_details())
def test_the_details_of_every_kind_survive_their_encoding(
    found: tuple[str, dict[str, Any]],
) -> None:
    kind, details = found
    decoded = events.decode_details(kind, json.loads(json.dumps(details)))
    for name in (field.name for field in fields(the_class(kind))):
        value = getattr(decoded, name)
        expected = details.get(name, getattr(the_class(kind)(), name))
        assert (list(value) if isinstance(value, tuple) else value) == (
            list(expected) if isinstance(expected, tuple) else expected
        )


@given(kind=details_kinds, value=json_values)
def test_any_json_is_a_kinds_details_or_one_events_error(kind: str, value: object) -> None:
    decodes_or_refuses(
        read_details(kind), json.dumps(value).encode(), EventsError, the_class(kind), asdict
    )


@given(found=valid_details(), data=hs.data())
def test_mutated_details_are_a_kinds_details_or_one_events_error(
    found: tuple[str, dict[str, Any]], data: hs.DataObject
) -> None:
    kind, details = found
    mutant = mutated(details, data)
    decodes_or_refuses(read_details(kind), mutant, EventsError, the_class(kind), asdict)


@given(found=valid_details(), data=hs.data())
def test_an_events_file_gives_only_events_whose_details_read_as_their_kinds(
    tmp_path_factory: pytest.TempPathFactory, found: tuple[str, dict[str, Any]], data: hs.DataObject
) -> None:
    """Through ``events.read``: a line whose details are not of its kind's types is skipped,
    so no reader's ``from_details`` ever raises on what it reads."""
    kind, details = found
    path = tmp_path_factory.mktemp("events") / "events.jsonl"
    lines = [
        json.dumps({"kind": kind, "time": 1.0, "details": details}),
        json.dumps({"kind": kind, "time": 2.0, "details": json.loads(mutated(details, data))}),
    ]
    path.write_text("\n".join(lines) + "\n")
    read = list(events.read(path))
    assert read[0].time == 1.0  # the valid line is never lost
    for event in read:
        assert isinstance(events.decode_details(event.kind, event.details), the_class(kind))


def test_a_hostile_details_line_is_skipped_and_the_timeline_shows_typed_values(
    tmp_path: Path,
) -> None:
    from hpc_elastic.ops import timeline  # noqa: PLC0415

    path = tmp_path / "events.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"kind": kind, "time": time, "details": details})
            for kind, time, details in [
                ("join", 1.0, {"host": ["x"], "nproc": 2}),
                ("join", 2.0, {"host": "n1", "nproc": 2}),
                ("start", 3.0, {"ranks": [0, "1"]}),
                ("leave", 4.0, {"exit_code": 2.9}),
                ("leave", 5.0, {"exit_code": 75}),
                ("rebalanced", 6.0, {"shards": {"a": [1] * 100}, "note": "two\nlines"}),
            ]
        )
        + "\n"
    )
    shards = repr({"a": [1] * 100})[: timeline.VALUE_WIDTH - 3] + "..."
    assert [timeline.describe(event) for event in events.read(path)] == [
        "agent joined (2 workers on n1)",
        "agent left (exit code 75)",
        f"rebalanced shards={shards} note=two\\nlines",
    ]


def test_every_details_field_of_every_kind_meets_every_awkward_value() -> None:
    for kind in DETAILS:
        example = {
            name: _EXAMPLE[name] for name in (field.name for field in fields(the_class(kind)))
        }
        for mutant in each_value_replaced(example):
            decodes_or_refuses(read_details(kind), mutant, EventsError, the_class(kind), asdict)


def test_an_event_of_the_wrong_details_is_one_events_error_naming_the_field() -> None:
    event = Event(Kind.CHECKPOINT, details={"step": True})
    assert events.details_problem(event) == (
        "A 'checkpoint' event's details are not of their types ('step' is True, not a whole "
        "number); the line is not one hpc-elastic writes, so it is skipped."
    )


# --- a round assignment (in-place mode, the agent's private run directory) -------------------

assignments = hs.builds(
    Assignment,
    round=counts,
    env=hs.fixed_dictionaries({name: texts for name in ROUND_KEYS}),
)


def the_assignment(assignment: Assignment, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes ``write_assignment`` writes for ``assignment``."""
    path = tmp_path_factory.mktemp("assignment") / "assignment_0"
    write_assignment(path, assignment)
    return path.read_bytes()


@given(assignments)
def test_every_assignment_survives_its_encoding(
    tmp_path_factory: pytest.TempPathFactory, assignment: Assignment
) -> None:
    assert decode_assignment(the_assignment(assignment, tmp_path_factory)) == assignment


@given(json_values)
def test_any_json_is_an_assignment_or_one_agent_error(value: object) -> None:
    decodes_or_refuses(
        decode_assignment, json.dumps(value).encode(), AgentError, Assignment, asdict
    )


@given(assignment=assignments, data=hs.data())
def test_a_mutated_assignment_is_one_or_one_agent_error(
    tmp_path_factory: pytest.TempPathFactory, assignment: Assignment, data: hs.DataObject
) -> None:
    mutant = mutated(json.loads(the_assignment(assignment, tmp_path_factory)), data)
    decodes_or_refuses(decode_assignment, mutant, AgentError, Assignment, asdict)


def test_every_assignment_field_meets_every_awkward_value() -> None:
    document = {"round": 3, "env": {name: "0" for name in ROUND_KEYS}}
    for mutant in each_value_replaced(document):
        decodes_or_refuses(decode_assignment, mutant, AgentError, Assignment, asdict)


@pytest.mark.parametrize(
    ("round_number", "said"),
    [
        (True, "'round' is True, not a whole number"),
        (2.0, "'round' is 2.0, not a whole number"),
        ("2", "'round' is '2', not a whole number"),
    ],
)
def test_a_round_number_that_is_no_whole_number_is_refused(round_number: object, said: str) -> None:
    data = json.dumps({"round": round_number, "env": {name: "0" for name in ROUND_KEYS}})
    with pytest.raises(AgentError) as refused:
        decode_assignment(data.encode())
    assert said in str(refused.value)
