"""The preemption drill's rules (ops/drill.py) on plain values, and its refusals with Slurm
faked at its one subprocess call."""

from __future__ import annotations

import os
import pwd
import re
from pathlib import Path

import pytest
from slurm_fake import mocked_slurm

from hpc_elastic import events
from hpc_elastic.commands import drill as command
from hpc_elastic.errors import UsageError
from hpc_elastic.events import Event, Kind
from hpc_elastic.jobdir import JobRecord
from hpc_elastic.ops import drill


def test_a_resume_from_one_past_a_checkpoint_is_clean_and_counts_the_redone_steps() -> None:
    steps = [1, 2, 3, 4, 5, 6, 7, 6, 7, 8]
    found = drill.check_steps(steps, {5})
    assert found.clean
    assert found.redone == 2


def test_a_step_missing_or_repeated_without_a_checkpoint_is_a_problem() -> None:
    missing = drill.check_steps([1, 2, 3, 6, 7], {2})
    assert missing.problems == ("steps 4..5 are missing (the log went 3 -> 6)",)
    repeated = drill.check_steps([1, 2, 3, 4, 3, 4], {1})
    assert not repeated.clean
    assert "step 3 was logged again after step 4" in repeated.problems[0]


def test_only_the_log_since_the_drill_is_judged() -> None:
    steps = [1, 2, 3, 2, 3, 4, 5, 4, 5]  # an old fault before the drill, a clean resume after
    assert drill.check_steps(steps, {3}, since=5).clean
    assert drill.check_steps(steps, {3}, since=5).redone == 2


def test_the_step_lines_are_read_from_the_log() -> None:
    assert drill.log_steps("step=1 loss=0.5 world=2\nnoise\nstep=2 loss=0.4 world=2\n") == [1, 2]


def round_event(number: int, size: int, at: float) -> Event:
    details = {"world_size": size, "members": [], "restarts_used": 0}
    return Event(kind=Kind.ROUND, round=number, details=details, time=at)


def test_the_recovery_is_the_first_step_of_the_first_full_round_after_the_act() -> None:
    history = [
        round_event(3, 3, 10.0),
        Event(kind=Kind.CHECKPOINT, details={"step": 40, "path": "x"}, time=105.0),
        round_event(4, 2, 110.0),
        round_event(5, 3, 150.0),
        Event(kind=Kind.FIRST_STEP, round=5, time=158.0),
        Event(kind=Kind.FIRST_STEP, round=5, time=157.0),
    ]
    assert drill.world_size(history, 100.0) == 3
    found = drill.recovery(history, 100.0, 3)
    assert (found.full_round, found.stepped_at) == (5, 157.0)
    assert drill.save_after(history, 100.0) == 105.0
    report = drill.Report(
        job="j",
        slot="1",
        kind="preempt",
        acted_at=100.0,
        full_size=3,
        time_to_full_step_s=57.0,
        full_round=5,
        steps_redone=2,
        grace_lead_s=15.0,
        save_after_signal_s=5.0,
        step_log="clean",
    )
    assert report.grace_margin_s == 10.0
    assert (
        report.lines()[3] == "Grace margin: 10.0 s (signal lead 15 s, save committed 5.0 s after)"
    )


def job(tmp_path: Path, *, checkpoint: bool = True) -> JobRecord:
    record = JobRecord(
        run_id="train-1",
        job_dir=tmp_path,
        job_id="9",
        local=False,
        zk="127.0.0.1:2181",
        nodes="2:3",
        nproc_per_node=1,
        max_restarts=3,
        spec={"signal": "USR2@15"},
    )
    record.write()
    if checkpoint:
        events.append(record.events_file, Event(kind=Kind.CHECKPOINT, details={"step": 5}))
    return JobRecord.load(tmp_path)


def test_a_job_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    record = job(tmp_path, checkpoint=False)
    with pytest.raises(UsageError, match="has committed no checkpoint yet"):
        command._pick(record, record.events(), seed=1)


def test_a_job_with_no_running_task_is_refused(tmp_path: Path) -> None:
    record = job(tmp_path)
    with mocked_slurm() as fake:
        fake.answer("squeue", stdout="9|0-2|PENDING|Resources|\n")
        with pytest.raises(UsageError, match="has no running array task to drill"):
            command._pick(record, record.events(), seed=1)


def test_another_users_slurm_job_is_never_acted_on(tmp_path: Path) -> None:
    record = job(tmp_path)
    with mocked_slurm() as fake:
        fake.answer("squeue", stdout="9|1|RUNNING|None|n2\n")
        fake.answer("scontrol", "-o", "show", "job", stdout="JobId=10 UserId=mallory(4242)\n")
        with pytest.raises(UsageError, match=re.escape("belongs to 'mallory(4242)', not to you")):
            command._pick(record, record.events(), seed=1)
    assert not fake.ran("scancel")


def test_the_users_own_running_task_is_picked(tmp_path: Path) -> None:
    record = job(tmp_path)
    me = pwd.getpwuid(os.getuid()).pw_name
    with mocked_slurm() as fake:
        fake.answer(
            "squeue", stdout="9|0|RUNNING|None|n1\n9|1|RUNNING|None|n2\n9|2|PENDING|None|\n"
        )
        fake.answer(
            "scontrol", "-o", "show", "job", stdout=f"JobId=10 UserId={me}({os.getuid()})\n"
        )
        task, task_job = command._pick(record, record.events(), seed=1)
    assert task in ("0", "1")
    assert task_job == f"9_{task}"
