"""The Python API as a user meets it: ``hpc_elastic.submit``, ``jobs()`` and a ``Job`` handle,
on a fake Slurm (``slurm_fake``: only the Slurm layer's subprocess call is swapped; everything
else is the real code the CLI runs)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_fake import FakeSlurm, Reply, mocked_submit

import hpc_elastic
from hpc_elastic import events
from hpc_elastic.api import Job, RankOutput
from hpc_elastic.errors import UsageError, WaitTimeoutError


@pytest.fixture
def slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSlurm]:
    """Partitions low and high; sbatch takes job 41, then 42...; squeue lists nothing until a
    test says otherwise."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPC_ELASTIC_ZK", raising=False)
    monkeypatch.setenv("HPC_ELASTIC_INDEX", str(tmp_path / "index"))  # this test's jobs only
    (tmp_path / "train.py").write_text("print('training')\n")
    with mocked_submit(first_job=41) as fake:
        fake.answer("squeue")
        yield fake


def pending(job: Job) -> str:
    """squeue's line for ``job``'s four slots, pending for resources."""
    assert job.job_id is not None
    return f"{job.job_id}|0-3|PENDING|Resources|\n"


def test_submit_takes_the_option_tables_options_as_python_values(slurm: FakeSlurm) -> None:
    job = hpc_elastic.submit(
        "train.py", "--lr", "3e-4", nodes="1:4", nproc_per_node=8, partition="low",
        env={"WANDB_PROJECT": "demo"}, setup="module load cuda", time=90,
    )  # fmt: skip
    assert job.job_id == "41"
    assert job.job_dir == Path("hpc-elastic-runs").absolute() / job.run_id
    script = slurm.submitted[0]
    assert (job.job_dir / "sbatch.sh").read_text() == script
    for line in ("#SBATCH --array=0-3", "#SBATCH --partition=low", "#SBATCH --time=90"):
        assert line in script
    assert "--nproc-per-node 8" in script or "--nproc-per-node=8" in script
    assert "WANDB_PROJECT=demo" in script
    assert "module load cuda" in script
    assert "--lr 3e-4" in script


def test_the_callers_values_beat_the_config_file_which_beats_the_defaults(
    slurm: FakeSlurm, tmp_path: Path
) -> None:
    (tmp_path / "hpc-elastic.toml").write_text('partition = "high"\nnodes = "2:8"\n')
    job = hpc_elastic.submit("train.py", partition="low")
    assert "#SBATCH --partition=low" in slurm.submitted[0]
    assert "#SBATCH --array=0-7" in slurm.submitted[0]
    assert job.record.nodes == "2:8"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nodez": 4}, "submit() has no option 'nodez'; use one of"),
        ({"nodes": "4:2"}, "'4:2'"),
        ({"partition": "gpu"}, "--partition 'gpu' does not exist on this cluster"),
        ({"nproc_per_node": 0}, "--nproc-per-node"),
    ],
)
def test_a_bad_option_is_a_usage_error_that_quotes_it_and_submits_nothing(
    slurm: FakeSlurm, options: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError) as error:
        hpc_elastic.submit("train.py", **options)
    assert message in str(error.value)
    assert slurm.submitted == []


def test_jobs_lists_what_submit_made_and_find_knows_it_by_any_name(slurm: FakeSlurm) -> None:
    first = hpc_elastic.submit("train.py", nodes=2)
    second = hpc_elastic.submit("train.py", nodes="1:2")
    assert [job.run_id for job in hpc_elastic.jobs()] == [first.run_id, second.run_id]
    for name in (second.run_id, "42", str(second.job_dir)):
        assert Job.find(name).run_id == second.run_id


def test_status_and_wait_follow_the_jobs_events_to_its_end(slurm: FakeSlurm) -> None:
    job = hpc_elastic.submit("train.py", nodes="1:4")
    slurm.answer("squeue", stdout=pending(job))
    assert job.state() == "pending"
    with pytest.raises(WaitTimeoutError, match=f"Job '{job.run_id}' is still pending after 0 s"):
        job.wait(timeout=0)
    slurm.answer("squeue")
    round_event = events.Event(
        events.Kind.ROUND, job.run_id, "0", round=1, details={"world_size": 4}
    )
    events.append(job.record.events_file, round_event)
    events.append(job.record.events_file, events.Event(events.Kind.DONE, job.run_id, "0", round=1))
    view = job.wait(timeout=60, poll=0.01)
    assert (view.state, view.world_size, view.round) == ("succeeded", 4, 1)
    assert [event.kind for event in job.events()] == ["round", "done"]


def test_logs_are_typed_per_rank_and_attempt(slurm: FakeSlurm) -> None:
    job = hpc_elastic.submit("train.py", nodes="1:2")
    for attempt, rank in ((1, 0), (1, 1), (2, 0)):
        log = job.record.paths.attempt(attempt) / f"rank_{rank}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"attempt {attempt} rank {rank}\n")
    assert job.logs(rank=0) == [
        RankOutput(1, 0, job.record.paths.attempt(1) / "rank_0.log", "attempt 1 rank 0\n"),
        RankOutput(2, 0, job.record.paths.attempt(2) / "rank_0.log", "attempt 2 rank 0\n"),
    ]
    assert [(log.attempt, log.rank) for log in job.logs(attempt=1)] == [(1, 0), (1, 1)]
    with pytest.raises(UsageError, match="--rank '5' has no log"):
        job.logs(rank=5)


def test_cancel_scancels_the_job_and_says_what_it_did(
    slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpc_elastic.ops import cancel  # noqa: PLC0415

    closed: list[str] = []
    monkeypatch.setattr(cancel, "close_rendezvous", lambda record: closed.append(record.run_id))
    job = hpc_elastic.submit("train.py", nodes="1:4")
    slurm.answer("squeue", stdout=pending(job))

    def scancel(argv: list[str]) -> Reply:
        slurm.answer("squeue")  # the job is gone from the queue
        return Reply()

    slurm.respond("scancel", responder=scancel)
    done = job.cancel()
    assert slurm.ran("scancel") == [["scancel", job.job_id]]
    assert done[0] == f"cancelled Slurm job {job.job_id} (every slot)"
    assert closed == [job.run_id]
    assert job.state() == "stopped"


def test_importing_hpc_elastic_loads_neither_torch_nor_the_cli() -> None:
    code = (
        "import sys, hpc_elastic; "
        "print(sorted(m for m in ('torch', 'click', 'jinja2', 'hpc_elastic.api') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_hpc_elastic_submit_stays_the_api_function_after_the_cli_imported_the_submit_path(
    slurm: FakeSlurm,
) -> None:
    import hpc_elastic.cli  # noqa: PLC0415  (what the CLI's submit and render import)
    import hpc_elastic.commands.submit  # noqa: PLC0415
    import hpc_elastic.submission  # noqa: PLC0415

    assert hpc_elastic.submit is hpc_elastic.api.submit
    job = hpc_elastic.submit("train.py", nodes=1)
    assert isinstance(job, Job)


def test_after_chains_a_job_behind_another_whatever_its_end(slurm: FakeSlurm) -> None:
    first = hpc_elastic.submit("train.py", nodes=1)
    second = hpc_elastic.submit("train.py", nodes="1:2", after=first.job_id)
    assert "#SBATCH --dependency=afterany:41" not in slurm.submitted[0]
    assert "#SBATCH --dependency=afterany:41" in slurm.submitted[1]
    assert second.job_id == "42"
    with pytest.raises(UsageError, match="--after 'train-1' is not a Slurm job id"):
        hpc_elastic.submit("train.py", after="train-1")


def test_a_jobs_status_shows_its_snapshots_commit_and_its_goodput(slurm: FakeSlurm) -> None:
    """Outside git: the copy of the script's directory, no commit; goodput from the events."""
    job = hpc_elastic.submit("train.py", nodes="1:2")
    for event in (
        events.Event(events.Kind.ROUND, slot="0", round=1, details={"world_size": 1}, time=10.0),
        events.Event(events.Kind.TRAINING, slot="0", round=1, time=12.0),
        events.Event(events.Kind.DONE, slot="0", round=1, time=20.0),
    ):
        events.append(job.record.events_file, event)
    view = job.status()
    assert view.code is not None
    assert (view.code.git, view.code.commit, view.code.dirty) == (False, None, None)
    assert view.code.dir == job.job_dir / "code"
    assert (view.code.dir / "train.py").read_text() == "print('training')\n"
    assert view.goodput.productive == 8.0
    assert view.goodput.ratio == 0.8
    assert view.to_json()["goodput"]["lost_s"]["start-up"] == 2.0
    assert view.to_json()["code"]["dir"] == str(job.job_dir / "code")


def test_jobs_finds_every_indexed_job_whatever_its_log_directory(slurm: FakeSlurm) -> None:
    here = hpc_elastic.submit("train.py", nodes=1)
    there = hpc_elastic.submit("train.py", nodes=1, log_dir="elsewhere/runs")
    assert [job.run_id for job in hpc_elastic.jobs()] == [here.run_id, there.run_id]
    assert [job.run_id for job in hpc_elastic.jobs("elsewhere/runs")] == [there.run_id]
