"""Agent metrics: the gauges follow the agent's events, and the textfile is node_exporter's."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpc_elastic.agent.api import AgentPhase
from hpc_elastic.agent.metrics import AgentMetrics, MetricsExporter
from hpc_elastic.errors import UsageError
from hpc_elastic.events import Event, Kind


def samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: AgentMetrics, name: str) -> float:
    labels = next(
        sample.labels
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    )
    found = metrics.registry.get_sample_value(name, labels)
    assert found is not None
    return found


def test_gauges_follow_rounds_restarts_preemptions_and_checkpoints(tmp_path: Path) -> None:
    events_file = tmp_path / "events.jsonl"
    metrics = AgentMetrics("job", "3", events_file, now=100.0)
    metrics.observe(Event(Kind.ROUND, round=2, details={"world_size": 4, "restarts_used": 1}))
    metrics.observe(Event(Kind.START, round=2, time=100.0))
    metrics.refresh(step=10, now=101.0)
    metrics.refresh(step=30, now=103.0)
    events_file.write_text(json.dumps({"kind": "checkpoint", "time": 102.0}) + "\n")
    metrics.refresh(step=40, now=104.0)
    metrics.observe(Event(Kind.RESTART, round=2, time=105.0))
    metrics.observe(Event(Kind.PREEMPT, time=106.0))
    metrics.refresh(step=None, now=110.0)

    assert value(metrics, "hpc_elastic_world_size") == 4
    assert value(metrics, "hpc_elastic_round") == 2
    assert value(metrics, "hpc_elastic_restarts_used") == 1
    assert value(metrics, "hpc_elastic_restarts_total") == 1
    assert value(metrics, "hpc_elastic_preemptions_total") == 1
    assert value(metrics, "hpc_elastic_training_step") == 40
    assert value(metrics, "hpc_elastic_last_checkpoint_age_seconds") == 8.0
    assert math.isclose(value(metrics, "hpc_elastic_goodput_ratio"), 5.0 / 10.0)
    assert value(metrics, "hpc_elastic_steps_per_second") == 0.0


def test_steps_per_second_from_the_heartbeat(tmp_path: Path) -> None:
    metrics = AgentMetrics("job", "0", tmp_path / "none.jsonl", now=0.0)
    metrics.refresh(step=10, now=1.0)
    metrics.refresh(step=30, now=3.0)
    assert value(metrics, "hpc_elastic_steps_per_second") == 10.0
    assert math.isnan(value(metrics, "hpc_elastic_last_checkpoint_age_seconds"))


def test_textfile_is_written_for_node_exporter(tmp_path: Path) -> None:
    metrics = AgentMetrics("job", "1", tmp_path / "events.jsonl")
    metrics.observe(Event(Kind.ROUND, round=1, details={"world_size": 2}))
    textfile = tmp_path / "hpc_elastic.prom"
    exporter = MetricsExporter(metrics, lambda: 7, textfile=textfile, interval=0.05)
    exporter.stop()
    found = samples(textfile.read_text())
    assert found["hpc_elastic_world_size"] == 2
    assert found["hpc_elastic_training_step"] == 7
    assert 'job="job",slot="1"' in textfile.read_text()


def test_metrics_are_served_on_loopback_unless_widened(tmp_path: Path) -> None:
    metrics = AgentMetrics("job", "1", tmp_path / "events.jsonl")
    exporter = MetricsExporter(metrics, lambda: 7, port=0, interval=0.05)
    try:
        assert exporter.bind == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as r:
            assert "hpc_elastic_training_step" in samples(r.read().decode())
    finally:
        exporter.stop()
    widened = MetricsExporter(metrics, lambda: 7, port=0, bind="0.0.0.0", interval=0.05)
    widened.stop()
    assert widened.bind == "0.0.0.0"


@pytest.mark.parametrize("bind", ["not an address", "10.255.255.1"])
def test_a_metrics_address_that_cannot_be_bound_is_one_sentence(tmp_path: Path, bind: str) -> None:
    metrics = AgentMetrics("job", "1", tmp_path / "events.jsonl")
    with pytest.raises(UsageError, match=f"^--metrics-port '0' cannot be served on '{bind}'"):
        MetricsExporter(metrics, lambda: 7, port=0, bind=bind)


def test_hostile_job_and_slot_names_stay_inside_their_label_values(tmp_path: Path) -> None:
    job = 'j"} hpc_elastic_world_size 999\n#'
    slot = 'x\\"\n'
    metrics = AgentMetrics(job, slot, tmp_path / "events.jsonl")
    metrics.observe(Event(Kind.ROUND, round=1, details={"world_size": 2}))
    textfile = tmp_path / "hpc_elastic.prom"
    MetricsExporter(metrics, lambda: 7, textfile=textfile, interval=0.05).stop()
    parsed = [
        sample
        for family in text_string_to_metric_families(textfile.read_text())
        for sample in family.samples
    ]
    assert {sample.labels["job"] for sample in parsed} == {job}
    assert {sample.labels["slot"] for sample in parsed} == {slot}
    assert [s.value for s in parsed if s.name == "hpc_elastic_world_size"] == [2]


def test_a_straggler_is_counted_and_scored_until_the_next_round(tmp_path: Path) -> None:
    metrics = AgentMetrics("job", "3", tmp_path / "events.jsonl", now=100.0)
    metrics.observe(Event(Kind.STRAGGLER, round=1, details={"rank": 2, "score": 3.5}))
    score = {"job": "job", "slot": "3", "rank": "2"}
    assert value(metrics, "hpc_elastic_stragglers_total") == 1
    assert metrics.registry.get_sample_value("hpc_elastic_straggler_score", score) == 3.5
    metrics.observe(Event(Kind.ROUND, round=2, details={"world_size": 4}))
    assert metrics.registry.get_sample_value("hpc_elastic_straggler_score", score) is None
    assert value(metrics, "hpc_elastic_stragglers_total") == 1


def phase_shown(metrics: AgentMetrics) -> str:
    """The one state of the ``hpc_elastic_agent_phase`` enum whose sample is 1."""
    (shown,) = (
        sample.labels["hpc_elastic_agent_phase"]
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == "hpc_elastic_agent_phase" and sample.value == 1
    )
    return shown


def test_the_agents_phase_follows_its_events_and_the_live_phase(tmp_path: Path) -> None:
    metrics = AgentMetrics("job", "3", tmp_path / "events.jsonl", now=100.0)
    assert phase_shown(metrics) == AgentPhase.JOINING.value
    metrics.observe(Event(Kind.START, round=1, details={"phase": AgentPhase.RUNNING.value}))
    assert phase_shown(metrics) == AgentPhase.RUNNING.value
    metrics.observe(Event(Kind.RESTART, round=1, details={"phase": "no such phase"}))
    assert phase_shown(metrics) == AgentPhase.RUNNING.value  # a stranger's line changes nothing
    metrics.refresh(step=None, now=101.0, phase=AgentPhase.DONE)
    assert phase_shown(metrics) == AgentPhase.DONE.value


def test_the_exporter_writes_the_live_phase_to_the_textfile(tmp_path: Path) -> None:
    metrics = AgentMetrics("job", "3", tmp_path / "events.jsonl")
    textfile = tmp_path / "agent.prom"
    exporter = MetricsExporter(
        metrics, lambda: None, textfile=textfile, interval=0.05, phase=lambda: AgentPhase.DRAINING
    )
    exporter.stop()
    text = textfile.read_text()
    assert 'hpc_elastic_agent_phase{hpc_elastic_agent_phase="draining",job="job",slot="3"} 1.0' in (
        text
    ), text
