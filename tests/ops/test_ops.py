"""The operating commands' pure parts on a hand-made job directory: no cluster needed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from slurm_fake import FakeSlurm, Reply, mocked_slurm, squeue_text

from hpc_elastic import cli, events
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
    (job_dir / "job.json").chmod(0o600)
    (job_dir / "logs" / "attempt_1" / "rank_0.log").write_text("step=1\n")
    (job_dir / "logs" / "attempt_2" / "rank_0.log").write_text("step=2\n")
    (job_dir / "logs" / "attempt_2" / "rank_1.log").write_text("step=2 on rank 1\n")
    story = [
        events.Event(events.Kind.JOIN, slot="0", details={"node_id": "a"}, time=1.0),
        events.Event(
            events.Kind.ROUND,
            slot="0",
            round=1,
            details={"node_id": "a", "world_size": 1, "members": ["0"]},
            time=2.0,
        ),
        events.Event(events.Kind.CHECKPOINT, slot="0", round=1, details={"step": 20}, time=3.0),
        events.Event(
            events.Kind.FAILURE,
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
        events.Event(events.Kind.RESTART, slot="0", round=1, details={"node_id": "a"}, time=4.1),
        events.Event(
            events.Kind.ROUND,
            slot="0",
            round=2,
            details={"node_id": "a", "world_size": 2, "members": ["0", "1"], "restarts_used": 1},
            time=5.0,
        ),
        events.Event(events.Kind.PREEMPT, slot="1", details={"node_id": "b"}, time=6.0),
        events.Event(events.Kind.REQUEUE, slot="1", time=7.0),
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


def test_a_job_that_ends_while_its_state_is_read_is_never_taken_for_stopped(
    tmp_path: Path,
) -> None:
    """Its agent writes ``done`` and exits, and Slurm lets the job go, between the two reads
    of a status: asked first, Slurm's answer can only be older than the events read after."""
    job_dir = make_job(tmp_path)
    done = events.Event(events.Kind.DONE, slot="0", round=2, details={"node_id": "a"}, time=8.0)

    def ended_meanwhile(ids: Sequence[str]) -> list[JobStatus]:
        events.append(job_dir / "events.jsonl", done)
        return []  # the job left the queue

    assert status.gather(jobs.load(job_dir), ended_meanwhile).state == "succeeded"
    (job_dir / "events.jsonl").write_text(
        "".join(line + "\n" for line in (job_dir / "events.jsonl").read_text().splitlines()[:-1])
    )
    _, states, _ = status.job_states([jobs.load(job_dir)], ended_meanwhile)
    assert states == ["succeeded"]


def test_an_agent_that_arrived_after_the_job_finished_shows_as_exited(tmp_path: Path) -> None:
    job_dir = make_job(tmp_path, job_id=None)
    for event in (
        events.Event(events.Kind.DONE, slot="0", round=2, details={"node_id": "a"}, time=8.0),
        events.Event(events.Kind.JOIN, slot="2", details={"node_id": "c"}, time=9.0),
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
    events.append(path, events.Event(events.Kind.ROUND, round=1, time=1.0))
    with path.open("a") as file:
        file.write('{"kind": "tor')
    new, offset = events.read_new(path, 0)
    assert [event.kind for event in new] == ["round"]
    with path.open("a") as file:
        file.write('n"}\n')
    again, _ = events.read_new(path, offset)
    assert [event.kind for event in again] == ["torn"]


@dataclass
class Calls:
    """What cancel asked of Slurm (the fake Slurm's record), ZooKeeper and the kernel, instead
    of doing it."""

    slurm: FakeSlurm
    close: list[str] = field(default_factory=list)
    kill: list[tuple[int, int]] = field(default_factory=list)

    @property
    def scancel(self) -> list[str]:
        """The job ids scancel was run on, in order."""
        return [argv[-1] for argv in self.slurm.ran("scancel")]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """A Slurm that lists no job and takes every scancel; ZooKeeper's close recorded."""
    from hpc_elastic.ops import cancel  # noqa: PLC0415

    with mocked_slurm() as fake:
        fake.answer("squeue")
        fake.answer("scancel")
        seen = Calls(fake)
        monkeypatch.setattr(
            cancel, "close_rendezvous", lambda record: seen.close.append(record.run_id)
        )
        yield seen


def ops(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


def assert_one_sentence(code: int, err: str) -> None:
    assert code in (1, 2), err
    assert err.startswith("error: "), err
    assert err.count("\n") == 1, err
    assert "Internal error" not in err


def write_record(log_dir: Path, run_id: str = "train-1", **fields: object) -> Path:
    job_dir = log_dir / run_id
    job_dir.mkdir(parents=True, exist_ok=True)
    record = {"run_id": run_id, "job_id": "4242", "spec": {"nodes": "1:2"}, **fields}
    (job_dir / "job.json").write_text(json.dumps(record))
    (job_dir / "job.json").chmod(0o600)
    return job_dir


@pytest.mark.parametrize("job_id", ["--me", "-1", "0", "4242 --me", "4242;id", True, -5, 1.5])
def test_a_forged_slurm_job_id_never_reaches_scancel(
    tmp_path: Path, calls: Calls, job_id: object
) -> None:
    write_record(tmp_path, job_id=job_id)
    code, _, err = ops("cancel", "train-1", "--log-dir", str(tmp_path))
    assert_one_sentence(code, err)
    assert "job_id" in err
    assert calls.scancel == []
    assert calls.close == []


@pytest.mark.parametrize("pid", [-1, 0, 1, True, "4242", 1.5, 2**80])
def test_a_forged_pid_is_refused_before_anything_is_signalled(
    tmp_path: Path, calls: Calls, monkeypatch: pytest.MonkeyPatch, pid: object
) -> None:
    monkeypatch.setattr(os, "kill", lambda *args: calls.kill.append(args))
    write_record(tmp_path, job_id=None, mode="local", pid=pid)
    for command in ("cancel", "status", "list"):
        code, out, err = ops(
            command, *(["train-1"] if command != "list" else []), "--log-dir", str(tmp_path)
        )
        if command == "list":
            assert code == 0, err
            assert "train-1" not in out
        else:
            assert_one_sentence(code, err)
            assert "pid" in err
    assert calls.kill == []


def test_cancel_never_signals_a_pid_that_no_longer_runs_the_job(
    tmp_path: Path, calls: Calls
) -> None:
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        write_record(tmp_path, job_id=None, mode="local", pid=stranger.pid)
        code, out, err = ops("cancel", "train-1", "--log-dir", str(tmp_path))
        assert code == 0, err
        assert "nothing was running" in out
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


MARKED_PARENT = """
import os, subprocess, sys
child = subprocess.Popen(["sleep", "60"], env={**os.environ, "HPC_ELASTIC_RUN_ID": sys.argv[1]})
print(child.pid, flush=True)
child.wait()
"""


def test_cancel_stops_a_local_runner_whose_agents_carry_the_jobs_marker(
    tmp_path: Path, calls: Calls
) -> None:
    runner = subprocess.Popen(
        [sys.executable, "-c", MARKED_PARENT, "train-1"], stdout=subprocess.PIPE, text=True
    )
    assert runner.stdout is not None
    agent = int(runner.stdout.readline())
    try:
        write_record(tmp_path, job_id=None, mode="local", pid=runner.pid)
        other = write_record(tmp_path, run_id="train-2", job_id=None, mode="local", pid=runner.pid)
        code, out, err = ops("cancel", str(other), "--log-dir", str(tmp_path))
        assert code == 0, err
        assert runner.poll() is None, "the marker names train-1, not train-2"
        code, out, err = ops("cancel", "train-1", "--log-dir", str(tmp_path))
        assert code == 0, err
        assert f"stopped the local run (pid {runner.pid})" in out
        assert runner.wait(timeout=30) == -signal.SIGTERM
    finally:
        runner.kill()
        runner.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent, signal.SIGKILL)


def test_one_bad_job_never_breaks_list_for_the_others(tmp_path: Path, calls: Calls) -> None:
    make_job(tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "job.json").write_text('{"run_id": ["x"]')
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "job.json").symlink_to(tmp_path / "nowhere")
    write_record(tmp_path, run_id="forged", job_id="--me")
    with (tmp_path / "train-1" / "events.jsonl").open("a") as file:
        file.write('{"kind": 5, "time": "x"}\n[]\n{"kind": "round", "time": NaN}\n')
    code, out, err = ops("list", "--log-dir", str(tmp_path))
    assert code == 0, err
    assert out.count("\n") == 1
    assert out.startswith("train-1 ")


def test_markup_and_escape_codes_in_the_events_are_shown_as_text(
    tmp_path: Path, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    job_dir = write_record(tmp_path)
    message = "[/bold] [red]boom\x1b[2J"
    events.append(
        job_dir / "events.jsonl",
        events.Event(events.Kind.FAILURE, slot="[/]", details={"node_id": "a", "message": message}),
    )
    code, out, err = ops("status", "train-1", "--log-dir", str(tmp_path))
    assert code == 0, err
    assert "[/bold] [red]boom\\x1b[2J" in out
    assert "  [/]  " in out
    assert "\x1b" not in out
    code, out, err = ops("events", "train-1", "--all", "--log-dir", str(tmp_path))
    assert code == 0, err
    assert "\x1b" not in out


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_job_record_others_may_write_is_never_acted_on(
    tmp_path: Path, calls: Calls, mode: int
) -> None:
    """Its job id would reach scancel: a planted record could name another of your jobs."""
    job_dir = write_record(tmp_path)
    (job_dir / "job.json").chmod(mode)
    code, _, err = ops("cancel", "train-1", "--log-dir", str(tmp_path))
    assert_one_sentence(code, err)
    assert "group or others may write it" in err
    assert calls.scancel == []
    code, out, _ = ops("list", "--log-dir", str(tmp_path))
    assert code == 0
    assert "train-1" not in out


def test_a_job_record_of_another_user_is_never_acted_on(tmp_path: Path) -> None:
    job_dir = write_record(tmp_path)
    someone_else = (job_dir / "job.json").stat().st_uid + 1000
    with pytest.raises(UsageError, match="it is owned by user id"):
        jobs.load(job_dir, uid=someone_else)
    assert jobs.load(job_dir).run_id == "train-1"


def test_one_preemption_of_three_slots_is_one_preemption_and_three_requeues() -> None:
    story = [
        events.Event(
            events.Kind.ROUND, slot="0", round=1, details={"node_id": "a", "world_size": 3}
        ),
        *(
            events.Event(
                events.Kind.PREEMPT, slot=slot, round=1, details={"node_id": slot}, time=2.0
            )
            for slot in "012"
        ),
        *(
            events.Event(
                events.Kind.REQUEUE, slot=slot, round=1, details={"cause": "preemption"}, time=3.0
            )
            for slot in "012"
        ),
        *(
            events.Event(events.Kind.JOIN, slot=slot, details={"node_id": slot + "'"}, time=4.0)
            for slot in "012"
        ),
        events.Event(
            events.Kind.ROUND, slot="0", round=2, details={"node_id": "a", "world_size": 3}
        ),
    ]
    summary = timeline.summarize(story)
    assert (summary.preemptions, summary.requeues) == (1, 3)


def test_a_slot_that_rejoins_after_preemption_without_a_requeue_event_is_one_requeue() -> None:
    story = [
        events.Event(events.Kind.PREEMPT, slot="1", round=4, details={"node_id": "b"}, time=1.0),
        events.Event(events.Kind.JOIN, slot="1", details={"node_id": "b2"}, time=2.0),
        events.Event(events.Kind.JOIN, slot="1", details={"node_id": "b2"}, time=3.0),
    ]
    summary = timeline.summarize(story)
    assert (summary.preemptions, summary.requeues) == (1, 1)


def test_a_slot_that_lost_zookeeper_for_good_leaves_its_sentence_as_the_last_failure() -> None:
    sentence = "ZooKeeper at 'zk:2181' stayed out of reach for 300 s (--zk-outage-limit), ..."
    story = [
        events.Event(events.Kind.ROUND, slot="0", round=1, details={"node_id": "a"}, time=1.0),
        events.Event(
            events.Kind.ERROR,
            slot="0",
            details={"node_id": "a", "reason": "a bug", "exit_code": 1},
            time=2.0,
        ),
        events.Event(
            events.Kind.ERROR,
            slot="1",
            details={"node_id": "b", "reason": sentence, "exit_code": 69},
            time=3.0,
        ),
    ]
    summary = timeline.summarize(story)
    assert summary.last_failure == sentence
    assert summary.outcome == "running", "not failed for the others: they may still reach it"
    assert timeline.summarize(story[:2]).last_failure is None, "an agent's own error is not"


@pytest.mark.parametrize(
    ("queue", "state"),
    [
        ([], "stopped"),  # cancelled: Slurm lists nothing, though no agent said done or failed
        ([JobStatus(SlurmJobId("4242"), "0", "RUNNING", "None", "n1")], "running"),
        ([JobStatus(SlurmJobId("4242"), "0-1", "PENDING", "Priority", "")], "pending"),
        ([JobStatus(SlurmJobId("4242"), "1", "REQUEUE_HOLD", "JobHoldMaxRequeue", "")], "held"),
    ],
)
def test_list_and_status_say_the_same_state_from_the_same_rule(
    tmp_path: Path,
    calls: Calls,
    queue: list[JobStatus],
    state: str,
) -> None:
    calls.slurm.answer("squeue", stdout=squeue_text(*queue))
    make_job(tmp_path)
    code, out, err = ops("list", "--log-dir", str(tmp_path))
    assert code == 0, err
    assert f" {state} " in out
    code, out, err = ops("status", "--json", "--log-dir", str(tmp_path), "train-1")
    assert code == 0, err
    assert json.loads(out)["state"] == state
    asked = ["squeue", "-h", "-o", "%F|%K|%T|%r|%N", "-j", "4242"]
    assert calls.slurm.ran("squeue") == [asked, asked]  # list asks Slurm once for all its jobs


def test_a_job_is_found_by_run_id_or_slurm_id_whatever_log_dir_it_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPC_ELASTIC_INDEX", str(tmp_path / "index"))
    job_dir = make_job(tmp_path / "elsewhere", run_id="train-9", job_id="6")
    jobs.load(job_dir).write()  # what submit and local mode do: the record notes its directory
    assert jobs.resolve("train-9", tmp_path / "default").job_dir == job_dir
    assert jobs.resolve("6", tmp_path / "default").job_dir == job_dir
    assert jobs.resolve("6_2", tmp_path / "default").run_id == "train-9"
    with pytest.raises(UsageError, match="Job '7' is unknown"):
        jobs.resolve("7", tmp_path / "default")


def test_an_index_entry_that_is_gone_or_not_the_users_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = tmp_path / "index"
    monkeypatch.setenv("HPC_ELASTIC_INDEX", str(index))
    job_dir = make_job(tmp_path / "shared", run_id="train-9", job_id="6")
    (job_dir / "job.json").chmod(0o666)  # anyone could have written it: never trusted
    index.write_text(f"{tmp_path / 'gone' / 'train-9'}\n{job_dir}\nnot-a-path\n")
    with pytest.raises(UsageError, match="Job 'train-9' is unknown"):
        jobs.resolve("train-9", tmp_path / "default")


def test_list_shows_every_indexed_job_whatever_its_log_dir_with_the_state_status_gives(
    tmp_path: Path, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPC_ELASTIC_INDEX", str(tmp_path / "index"))
    monkeypatch.chdir(tmp_path)  # the default log directory, ./hpc-elastic-runs, is empty
    running = JobStatus(SlurmJobId("4242"), "0", "RUNNING", "None", "n1")

    def squeue(argv: list[str]) -> Reply:
        """Slurm lists job 4242, running, whenever it is asked about it."""
        asked = argv[argv.index("-j") + 1].split(",")
        return Reply(stdout=squeue_text(running) if "4242" in asked else "")

    calls.slurm.respond("squeue", responder=squeue)
    for log_dir, run_id, job_id in (("a", "train-1", "4242"), ("b", "train-2", "4243")):
        jobs.load(make_job(tmp_path / log_dir, run_id=run_id, job_id=job_id)).write()
    code, out, err = ops("list")
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["train-1", "train-2"]
    for line, run_id in zip(lines, ("train-1", "train-2"), strict=True):
        code, shown, err = ops("status", "--json", run_id)
        assert code == 0, err
        assert f" {json.loads(shown)['state']} " in line
    assert " running " in lines[0]
    assert " stopped " in lines[1]
    code, out, _ = ops("list", "--log-dir", str(tmp_path / "b"))
    assert [line.split()[0] for line in out.splitlines()] == ["train-2"]


def test_status_text_and_json_show_the_goodput_and_the_code_snapshot(
    tmp_path: Path, calls: Calls
) -> None:
    job_dir = make_job(tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = {
        "dir": f"{job_dir}/code",
        "source": "/home/ada/llm",
        "git": True,
        "commit": commit,
        "dirty": True,
        "files": 12,
        "bytes": 3400,
    }
    record = json.loads((job_dir / "job.json").read_text())
    (job_dir / "job.json").write_text(json.dumps({**record, "snapshot": snapshot}))
    code, out, err = ops("status", "--json", "--log-dir", str(tmp_path), "train-1")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["code"] == snapshot
    assert shown["goodput"]["wall_s"] == 6.0  # first event to last: the job is stopped
    assert set(shown["goodput"]["lost_s"]) == {
        "waiting for nodes",
        "rendezvous",
        "start-up",
        "checkpoint",
        "restart",
    }
    code, out, err = ops("status", "--log-dir", str(tmp_path), "train-1")
    assert code == 0, err
    words = " ".join(out.split())  # rich wraps the long lines at the terminal's width
    assert "Goodput 17% (1 s of 6 s); lost: waiting for nodes 2 s, restart 2 s, rendezvous" in words
    assert "Code commit 0123456789ab, with uncommitted changes, copied from /home/ada/llm" in words


def test_status_says_when_a_job_runs_without_a_snapshot(tmp_path: Path, calls: Calls) -> None:
    make_job(tmp_path)
    code, out, err = ops("status", "--log-dir", str(tmp_path), "train-1")
    assert code == 0, err
    assert "not snapshotted" in out


def test_the_slot_table_of_a_large_job_is_a_row_for_each_run_of_alike_slots() -> None:
    """A job of 4,096 slots is a few rows, and the slot in trouble stands out."""
    slots = [status.Slot(str(i), "RUNNING", f"n{i}", "start") for i in range(100)]
    slots[50] = status.Slot("50", "PENDING", "-", "-")
    rows = status.slot_rows(slots)
    assert rows == [
        status.Slot("0-49", "RUNNING", "50 nodes", "start"),
        status.Slot("50", "PENDING", "-", "-"),
        status.Slot("51-99", "RUNNING", "49 nodes", "start"),
    ]
    assert status.slot_rows(slots[:4]) == slots[:4]
