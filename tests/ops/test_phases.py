"""The restart timeline: agents' (and training helpers') events turned into phases per restart."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from test_agent import Cluster

from hpc_elastic import cli, events
from hpc_elastic.agent.api import ExitCode
from hpc_elastic.ops.phases import IN_PLACE_PHASES, PHASES, restarts, table


def event(kind: str, at: float, round_: int, slot: str = "0", **details: object) -> events.Event:
    return events.Event(
        events.kind_of(kind), job="run1", slot=slot, round=round_, details=details, time=at
    )


def test_a_worker_failure_restart_records_every_agent_phase_in_order(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="2")
    cluster.start(2, FAKE_WORKER_FAIL="1:1:3", FAKE_WORKER_SECONDS="2")
    assert cluster.join() == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}
    history = list(events.read(cluster.job_dir / "events.jsonl"))
    (restart,) = restarts(history)
    assert (restart.previous, restart.round, restart.reason) == (1, 2, "failed")
    after = restart.after
    assert after["ready"] is None  # The fake worker does not use the training helpers.
    told, stopped, formed, spawned, stepped = (
        after[phase] for phase in ("told", "stopped", "formed", "spawned", "stepped")
    )
    assert None not in (told, stopped, formed, spawned, stepped), after
    assert told is not None
    assert stopped is not None
    assert formed is not None
    assert spawned is not None
    assert stepped is not None
    assert 0 <= told <= formed <= spawned <= stepped  # The failing node reports, then a round.
    assert 0 <= stopped <= formed  # Nobody joins the next round with workers still running.
    assert restart.total == stepped


def test_the_training_helpers_first_step_wins_over_the_heartbeat() -> None:
    history = [
        event("start", 1.0, 1),
        event("round_ended", 10.0, 1, outcome="changed"),
        event("round_ended", 10.2, 1, slot="1", outcome="changed"),
        event("workers_stopped", 10.5, 1),
        event("workers_stopped", 10.7, 1, slot="1"),
        event("round", 11.0, 2),
        event("round", 11.1, 2, slot="1"),
        event("start", 11.2, 2),
        event("start", 11.4, 2, slot="1"),
        event("store_connected", 11.5, 2, slot="1"),
        event("store_connected", 11.6, 2),
        event("first_heartbeat", 12.0, 2),
        event("worker_ready", 12.5, 2),
        event("worker_ready", 12.6, 2, slot="1"),
        event("first_step", 12.8, 2),
        event("first_step", 12.9, 2, slot="1"),
    ]
    (restart,) = restarts(history)
    rounded = {phase: None if v is None else round(v, 3) for phase, v in restart.after.items()}
    assert rounded == {
        "told": None,  # A membership change: no failure to report.
        "stopped": 0.7,
        "formed": 1.0,
        "spawned": 1.4,
        "kept": None,  # nothing survived in place
        "connected": 1.6,  # the last agent to see its ranks connected to the store
        "ready": 2.6,
        "stepped": 2.9,
    }
    assert restart.seen == 10.0
    assert restart.reason == "changed"


def test_a_plain_script_without_the_training_helpers_still_shows_when_its_ranks_connected() -> None:
    """A torchrun script writes no ``worker_ready`` nor ``first_step``: the agents' own
    ``store_connected`` (seen in /proc) is the last phase its restart has."""
    history = [
        event("start", 1.0, 1),
        event("round_ended", 10.0, 1, outcome="failed"),
        event("failure_reported", 10.01, 1),
        event("workers_stopped", 10.1, 1),
        event("round", 10.2, 2),
        event("start", 10.25, 2),
        event("start", 10.3, 2, slot="1"),
        event("store_connected", 10.35, 2),
        event("store_connected", 10.4, 2, slot="1"),
    ]
    (restart,) = restarts(history)
    assert restart.after["connected"] is not None
    assert round(restart.after["connected"], 3) == 0.4
    assert restart.after["ready"] is None
    assert restart.total is None
    (header, row) = table([restart])
    assert header.split()[-len(PHASES) :] == list(PHASES)
    assert row.split()[4:] == ["0.01s", "0.10s", "0.20s", "0.30s", "0.40s", "-", "-"]


def test_a_round_that_changed_before_it_started_is_part_of_the_next_restart() -> None:
    history = [
        event("start", 1.0, 1),
        event("round_ended", 5.0, 1, outcome="failed"),
        event("failure_reported", 5.1, 1),
        event("workers_stopped", 5.2, 1),
        event("round", 5.5, 2),  # Another node left before round 2 started its workers.
        event("round", 7.0, 3),
        event("start", 7.5, 3),
        event("first_heartbeat", 8.0, 3),
    ]
    (restart,) = restarts(history)
    assert (restart.previous, restart.round) == (1, 3)
    assert restart.after["formed"] == 2.0
    assert restart.total == 3.0


def job_with_a_record(tmp_path: Path) -> Path:
    """A job directory with the smallest ``job.json`` that ``events`` accepts (mode 0600)."""
    job_dir = tmp_path / "run1"
    job_dir.mkdir()
    record = {"run_id": "run1", "job_id": None, "job_dir": str(job_dir), "spec": {"nodes": "2"}}
    (job_dir / "job.json").write_text(json.dumps(record))
    (job_dir / "job.json").chmod(0o600)
    return job_dir


def test_events_phases_prints_one_row_per_restart(tmp_path: Path) -> None:
    job_dir = job_with_a_record(tmp_path)
    for recorded in (
        event("start", 1.0, 1),
        event("round_ended", 5.0, 1, outcome="failed"),
        event("round", 5.5, 2),
        event("start", 5.75, 2),
    ):
        events.append(job_dir / "events.jsonl", recorded)
    result = CliRunner().invoke(cli.app, ["events", "--phases", str(job_dir)])
    assert result.exit_code == 0, result.output
    header, row = result.output.splitlines()
    assert header.split()[-len(PHASES) :] == list(PHASES)
    assert row.split()[:4] == ["1", "->", "2", "failed"]
    assert row.split()[4:] == ["-", "-", "0.50s", "0.75s", "-", "-", "-"]
    assert table([]) == [header]


def test_the_timing_markers_stay_out_of_the_events_story(tmp_path: Path) -> None:
    job_dir = job_with_a_record(tmp_path)
    for recorded in (
        event("start", 1.0, 1, ranks=[0]),
        event("round_ended", 5.0, 1, outcome="failed"),
        event("workers_stopped", 5.1, 1),
        event("first_heartbeat", 6.0, 1),
    ):
        events.append(job_dir / "events.jsonl", recorded)
    story = CliRunner().invoke(cli.app, ["events", str(job_dir)])
    assert story.exit_code == 0, story.output
    assert story.output.count("\n") == 1
    assert "workers started" in story.output
    every = CliRunner().invoke(cli.app, ["events", "--all", str(job_dir)])
    assert "round_ended" in every.output


IN_PLACE_RESTART = [
    # Recorded shape of tests/agent/test_inplace.py's kill (2 agents, in-place), times made round.
    event("start", 1.0, 1, ranks=[0]),
    event("start", 1.1, 1, slot="1", ranks=[1]),
    event("round_ended", 10.0, 1, outcome="failed"),
    event("round_ended", 10.1, 1, slot="1", outcome="failed"),
    event("failure_reported", 10.2, 1, slot="1"),
    event("workers_stopped", 10.3, 1, slot="1"),  # the dead worker's node restarts normally
    event("round", 10.5, 2),
    event("round", 10.5, 2, slot="1"),
    event("workers_kept", 10.6, 2, ranks=[0]),
    event("start", 10.6, 2, ranks=[0]),
    event("start", 10.7, 2, slot="1", ranks=[1]),
    event("store_connected", 10.8, 2, slot="1", ranks=[1]),
    event("store_connected", 10.9, 2, ranks=[0]),
    event("worker_ready", 11.0, 2),
    event("worker_ready", 11.2, 2, slot="1"),
    event("first_step", 11.5, 2),
    event("first_step", 11.4, 2, slot="1"),
]


def test_a_kept_round_shows_its_own_phases_instead_of_stopped_and_spawned(
    tmp_path: Path,
) -> None:
    (restart,) = restarts(IN_PLACE_RESTART)
    assert restart.in_place
    assert restart.phases == IN_PLACE_PHASES
    rounded = {phase: round(restart.after[phase] or -1, 3) for phase in IN_PLACE_PHASES}
    assert rounded == {
        "told": 0.2,
        "formed": 0.5,
        "kept": 0.6,
        "connected": 0.9,
        "ready": 1.2,
        "stepped": 1.5,
    }
    job_dir = job_with_a_record(tmp_path)
    normal = [  # a normal restart after the in-place one: the header changes back
        event("round_ended", 20.0, 2, outcome="changed"),
        event("workers_stopped", 20.2, 2),
        event("round", 20.5, 3),
        event("start", 20.75, 3, ranks=[0]),
    ]
    for recorded in (*IN_PLACE_RESTART, *normal):
        events.append(job_dir / "events.jsonl", recorded)
    result = CliRunner().invoke(cli.app, ["events", "--phases", str(job_dir)])
    assert result.exit_code == 0, result.output
    kept_header, kept_row, header, row = result.output.splitlines()
    assert kept_header.split()[-len(IN_PLACE_PHASES) :] == list(IN_PLACE_PHASES)
    assert kept_row.split() == [
        "1",
        "->",
        "2",
        "failed",
        "0.20s",
        "0.50s",
        "0.60s",
        "0.90s",
        "1.20s",
        "1.50s",
    ]
    assert header.split()[-len(PHASES) :] == list(PHASES)
    assert row.split() == [
        *("2", "->", "3", "changed"),
        *("-", "0.20s", "0.50s", "0.75s", "-", "-", "-"),
    ]
