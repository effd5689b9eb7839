"""One job directory, one job record: what submit and local mode write, ops reads back."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from hpc_elastic.jobdir import JobDir, JobRecord


def record(tmp_path: Path, *, local: bool) -> JobRecord:
    job_dir = tmp_path / "train-1"
    job_dir.mkdir(parents=True)
    return JobRecord(
        run_id="train-1",
        job_dir=job_dir,
        job_id=None if local else "42",
        local=local,
        zk="local:///tmp/x.sock" if local else "zk1:2181",
        nodes="1:3",
        nproc_per_node=2,
        max_restarts=4,
        runner_pid=1234 if local else None,
        version="0.1.0",
        command_line=("hpc-elastic", "run"),
        spec={"script": "/w/train.py"},
    )


def test_a_written_record_loads_back_the_same_for_slurm_and_local_runs(tmp_path: Path) -> None:
    for local in (False, True):
        written = record(tmp_path / str(local), local=local)
        written.write()
        loaded = JobRecord.load(written.job_dir)
        for name in ("run_id", "job_id", "local", "zk", "nodes", "nproc_per_node", "runner_pid"):
            assert getattr(loaded, name) == getattr(written, name), name
        assert stat.S_IMODE(written.paths.record.stat().st_mode) == 0o600


def test_a_slurm_jobs_zk_stays_in_spec_where_older_tools_edit_it(tmp_path: Path) -> None:
    written = record(tmp_path, local=False)
    written.write()
    raw = json.loads(written.paths.record.read_text())
    assert "zk" not in raw
    assert raw["spec"]["zk"] == "zk1:2181"
    assert raw["spec"]["script"] == "/w/train.py"


def test_a_record_written_before_jobrecord_existed_still_loads(tmp_path: Path) -> None:
    old_local = {
        "run_id": "train-1",
        "job_id": None,
        "job_dir": str(tmp_path),
        "mode": "local",
        "zk": "local:///tmp/s.sock",
        "pid": 99,
        "spec": {"nodes": "2", "nproc_per_node": 1, "max_restarts": 3, "churn": [20.0, 40.0]},
    }
    loaded = JobRecord.from_json(old_local, tmp_path)
    assert (loaded.local, loaded.runner_pid, loaded.nodes) == (True, 99, "2")


def test_every_path_of_a_job_directory_has_one_name() -> None:
    paths = JobDir(Path("/runs/r1"))
    assert paths.record == Path("/runs/r1/job.json")
    assert paths.events == Path("/runs/r1/events.jsonl")
    assert paths.secret == Path("/runs/r1/secret")
    assert paths.sbatch_script == Path("/runs/r1/sbatch.sh")
    assert paths.checkpoints == Path("/runs/r1/checkpoints")
    assert paths.slot_ledger(3) == Path("/runs/r1/slots/3.json")
    assert (paths.attempt(2) / "rank_0.log").relative_to(paths.logs).match(paths.rank_logs)
    assert paths.agent_log("node0") == Path("/runs/r1/logs/agent_node0.log")
    assert paths.slurm_output("7", elastic=True) == Path("/runs/r1/slurm-7_*.out")
