"""Agent metrics: the gauges follow the agent's events, and the textfile is node_exporter's."""

from __future__ import annotations

import json
import math
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hpc_elastic.events import Event
from hpc_elastic.metrics import AgentMetrics, MetricsExporter


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
    metrics.observe(Event("round", round=2, details={"world_size": 4, "restarts_used": 1}))
    metrics.observe(Event("start", round=2, time=100.0))
    metrics.refresh(step=10, now=101.0)
    metrics.refresh(step=30, now=103.0)
    events_file.write_text(json.dumps({"kind": "checkpoint", "time": 102.0}) + "\n")
    metrics.refresh(step=40, now=104.0)
    metrics.observe(Event("restart", round=2, time=105.0))
    metrics.observe(Event("preempt", time=106.0))
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
    metrics.observe(Event("round", round=1, details={"world_size": 2}))
    textfile = tmp_path / "hpc_elastic.prom"
    exporter = MetricsExporter(metrics, lambda: 7, textfile=textfile, interval=0.05)
    exporter.stop()
    found = samples(textfile.read_text())
    assert found["hpc_elastic_world_size"] == 2
    assert found["hpc_elastic_training_step"] == 7
    assert 'job="job",slot="1"' in textfile.read_text()
