"""The operating commands' pure parts on a hand-made job directory: no cluster needed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from hpc_elastic import events
from hpc_elastic.errors import SlurmError, UsageError
from hpc_elastic.ops import jobs, logs, status, timeline
from hpc_elastic.slurm.commands import JobStatus, SlurmJobId


def make_job(log_dir: Path, run_id: str = "train-1", job_id: str | None = "4242") -> Path:
    job_dir = log_dir / run_id
    (job_dir / "logs" / "attempt_1").mkdir(parents=True)
    (job_dir / "logs" / "attempt_2").mkdir()
    record = {
        "run_id": run_id,
        "job_id": job_id,
        "job_dir": str(job_dir),
        "spec": {"nodes": "1:2", "nproc_per_node": 1, "max_restarts": 3},
    }
    (job_dir / "job.json").write_text(json.dumps(record))
    (job_dir / "logs" / "attempt_1" / "rank_0.log").write_text("step=1\n")
    (job_dir / "logs" / "attempt_2" / "rank_0.log").write_text("step=2\n")
    (job_dir / "logs" / "attempt_2" / "rank_1.log").write_text("step=2 on rank 1\n")
    story = [
        events.Event("join", slot="0", details={"node_id": "a"}, time=1.0),
        events.Event(
            "round",
            slot="0",
            round=1,
            details={"node_id": "a", "world_size": 1, "members": ["0"]},
            time=2.0,
        ),
        events.Event("checkpoint", slot="0", round=1, details={"step": 20}, time=3.0),
        events.Event(
            "failure",
            slot="0",
            round=1,
            details={
                "node_id": "a",
                "rank": 0,
                "exit_code": 1,
                "message": "Traceback\nValueError: bad batch",
            },
            time=4.0,
        ),
        events.Event("restart", slot="0", round=1, details={"node_id": "a"}, time=4.1),
        events.Event(
            "round",
            slot="0",
            round=2,
            details={"node_id": "a", "world_size": 2, "members": ["0", "1"], "restarts_used": 1},
            time=5.0,
        ),
        events.Event("preempt", slot="1", details={"node_id": "b"}, time=6.0),
        events.Event("requeue", slot="1", time=7.0),
    ]
    for event in story:
        events.append(job_dir / "events.jsonl", event)
    return job_dir


def test_a_job_is_found_by_run_id_path_or_slurm_id(tmp_path: Path) -> None:
    job_dir = make_job(tmp_path)
    assert jobs.resolve("train-1", tmp_path).job_dir == job_dir
    assert jobs.resolve(str(job_dir), Path("elsewhere")).run_id == "train-1"
    assert jobs.resolve("4242_1", tmp_path).run_id == "train-1"
    with pytest.raises(UsageError, match="Job '999' is unknown"):
        jobs.resolve("999", tmp_path)


def test_summary_counts_across_requeues(tmp_path: Path) -> None:
    make_job(tmp_path)
    summary = timeline.summarize(jobs.resolve("train-1", tmp_path).events())
    assert summary.round == 2
    assert summary.world_size == 2
    assert summary.restarts_used == 1
    assert summary.restarts == 1
    assert summary.preemptions == 1
    assert summary.requeues == 1
    assert summary.last_checkpoint_step == 20
    assert summary.last_failure == "rank 0 on 0 (exit code 1) in round 1: ValueError: bad batch"


def test_status_combines_slurm_and_events_and_reports_slurm_trouble(tmp_path: Path) -> None:
    record = jobs.load(make_job(tmp_path))

    def squeue(ids: Sequence[str]) -> list[JobStatus]:
        assert list(ids) == ["4242"]
        return [
            JobStatus(SlurmJobId("4242"), "0", "RUNNING", "None", "n1"),
            JobStatus(SlurmJobId("4242"), "1", "PENDING", "BeginTime", ""),
        ]

    view = status.gather(record, squeue)
    slots = {slot.slot: slot for slot in view.slots}
    assert slots["0"].slurm_state == "RUNNING"
    assert slots["0"].node == "n1"
    assert slots["1"].node == "BeginTime"
    assert slots["1"].agent == "preempted"

    def broken(ids: Sequence[str]) -> list[JobStatus]:
        raise SlurmError("squeue was not found on PATH; run this on a Slurm login node.")

    view = status.gather(record, broken)
    assert view.state == "stopped"
    assert view.warnings == ["squeue was not found on PATH; run this on a Slurm login node."]


def test_an_agent_that_arrived_after_the_job_finished_shows_as_exited(tmp_path: Path) -> None:
    job_dir = make_job(tmp_path, job_id=None)
    for event in (
        events.Event("done", slot="0", round=2, details={"node_id": "a"}, time=8.0),
        events.Event("join", slot="2", details={"node_id": "c"}, time=9.0),
    ):
        events.append(job_dir / "events.jsonl", event)
    view = status.gather(jobs.load(job_dir), lambda ids: [])
    slots = {slot.slot: slot.agent for slot in view.slots}
    assert view.state == "succeeded"
    assert slots == {"0": "done", "1": "preempted", "2": "exited"}


def test_logs_select_by_rank_and_attempt(tmp_path: Path) -> None:
    record = jobs.load(make_job(tmp_path))
    found = logs.find(record)
    assert [(log.attempt, log.rank) for log in found] == [(1, 0), (2, 0), (2, 1)]
    assert [log.attempt for log in logs.select(record, found, 0, None)] == [1, 2]
    with pytest.raises(
        UsageError, match="--rank '7' has no log in job 'train-1'; its ranks are 0, 1"
    ):
        logs.select(record, found, 7, None)
    with pytest.raises(UsageError, match="--attempt '9' never ran"):
        logs.select(record, found, None, 9)
    written: list[str] = []
    logs.follow(record, 1, None, written.append, lambda: False)
    assert written == ["==> attempt 2, rank 1 <==\n", "step=2 on rank 1\n"]


def test_following_the_events_file_reads_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert events.read_new(path, 0) == ([], 0)
    events.append(path, events.Event("round", round=1, time=1.0))
    with path.open("a") as file:
        file.write('{"kind": "tor')
    new, offset = events.read_new(path, 0)
    assert [event.kind for event in new] == ["round"]
    with path.open("a") as file:
        file.write('n"}\n')
    again, _ = events.read_new(path, offset)
    assert [event.kind for event in again] == ["torn"]
