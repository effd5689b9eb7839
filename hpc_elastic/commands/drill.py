"""``hpc-elastic drill``: the click command, the checks before acting, the act and the wait;
``hpc_elastic.ops.drill`` holds the rules and the figures."""

from __future__ import annotations

import json
import os
import pwd
import random
import time
from dataclasses import asdict
from pathlib import Path

import click

from hpc_elastic.clicktools import exit_with
from hpc_elastic.commands._job import job_argument, log_dir_of, log_dir_option, seconds_option
from hpc_elastic.errors import SlurmError, UsageError, one_line
from hpc_elastic.events import Event
from hpc_elastic.jobdir import JobRecord
from hpc_elastic.ops import drill, jobs
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.spec import PreemptSignal

POLL_S = 2.0
"""Seconds between two looks at the job's events while the drill waits."""
REQUEUE_MARGIN_S = 30.0
"""A preempt drill requeues the slot itself when the slot has not requeued itself within its
signal lead and this margin, as Slurm does after GraceTime."""


@click.command("drill")
@job_argument
@log_dir_option
@click.option("--kind", default="preempt", metavar="preempt|requeue|node-kill", help="What to act.")
@click.option(
    "--step-log",
    type=click.Path(path_type=Path),
    metavar="FILE",
    help="The job's step log (lines 'step=N ...'), checked for a missing or repeated step.",
)
@seconds_option(
    "--timeout",
    "How long to wait for the job to train at full size again.",
    default=900.0,
)
@click.option("--seed", type=int, metavar="N", help="Pick the slot with this seed.")
@click.option("--json", "json_output", is_flag=True, help="Print the figures as JSON.")
def drill_command(
    job: str,
    log_dir: Path | None,
    *,
    kind: str,
    step_log: Path | None,
    timeout: float,
    seed: int | None,
    json_output: bool,
) -> None:
    """Act a preemption (or a requeue, or a node's death) on a random running slot of JOB,
    wait until it trains at full size again, and report the time that took, the steps redone,
    the grace margin and whether the step log is clean. Exit 1 if it is not, or if the job
    did not recover within --timeout."""
    if kind not in drill.KINDS:
        raise UsageError(
            f"--kind '{kind}' is not one of {', '.join(drill.KINDS)}; give e.g. 'preempt'."
        )
    record = jobs.resolve(job, log_dir_of(log_dir))
    history = record.events()
    task, task_job = _pick(record, history, seed)
    full = drill.world_size(history, time.time())
    if full is None:
        raise UsageError(f"Job '{record.run_id}' has formed no round yet; drill it once it trains.")
    logged = len(drill.log_steps(step_log.read_text())) if step_log and step_log.exists() else 0
    click.echo(f"Drilling job {record.run_id}: {kind} of slot {task} ({task_job}).", err=True)
    acted = _act(kind, task_job, record, task)
    report = _wait(
        record,
        kind=kind,
        task=task,
        acted=acted,
        full=full,
        timeout=timeout,
        step_log=step_log,
        logged=logged,
    )
    if json_output:
        click.echo(json.dumps({**asdict(report), "grace_margin_s": report.grace_margin_s}))
    else:
        for line in report.lines():
            click.echo(one_line(line))
    recovered = report.time_to_full_step_s is not None
    exit_with(0 if recovered and not report.problems else 1)


def _pick(record: JobRecord, history: list[Event], seed: int | None) -> tuple[str, str]:
    """A random running slot of the user's own job that has a checkpoint; one sentence why not."""
    if record.local or not record.job_ids:
        raise UsageError(
            f"Job '{record.run_id}' is a local run; a drill acts through Slurm, on a submitted job."
        )
    if not drill.checkpoints(history):
        raise UsageError(
            f"Job '{record.run_id}' has committed no checkpoint yet, so a drill would lose its "
            "work; run it once `hpc-elastic status` shows a checkpoint."
        )
    running = [
        status
        for status in commands.squeue(list(record.job_ids))
        if status.state == "RUNNING"
        and status.array_task is not None
        and status.array_task.isdigit()
    ]
    if not running:
        raise UsageError(
            f"Job '{record.run_id}' has no running array task to drill (a fixed job has none, "
            "and a job that waits in the queue has none yet); try again when it trains."
        )
    chosen = random.Random(seed).choice(running)  # a drill's pick, not a secret
    task_job = f"{chosen.job_id}_{chosen.array_task}"
    _refuse_others(task_job)
    return str(chosen.array_task), task_job


def _refuse_others(task_job: str) -> None:
    """The Slurm job must be the user's own: a job.json that names another user's job id
    (planted, or copied) must never make us signal it."""
    owner = commands.scontrol_show_job(task_job).get("UserId", "")
    me = pwd.getpwuid(os.getuid()).pw_name
    if owner.split("(", 1)[0] != me:
        raise UsageError(
            f"Slurm job {task_job} belongs to '{owner}', not to you ('{me}'); a drill acts only "
            "on your own jobs."
        )


def _act(kind: str, task_job: str, record: JobRecord, task: str) -> float:
    """Do to the slot what Slurm would; returns when the act began."""
    acted = time.time()
    if kind == "preempt":
        signal = PreemptSignal.parse(record.signal or "USR2@90")
        commands.cancel(task_job, signal=signal.name)
        deadline = time.monotonic() + signal.seconds + REQUEUE_MARGIN_S
        while time.monotonic() < deadline and _running(record, task):
            time.sleep(POLL_S)
        if _running(record, task):
            commands.requeue(task_job)  # Slurm's requeue after GraceTime
    elif kind == "requeue":
        commands.requeue(task_job)
    else:
        commands.cancel(task_job, signal="KILL", full=True)
        _requeue_when_ended(task_job)
    return acted


def _running(record: JobRecord, task: str) -> bool:
    statuses: list[JobStatus] = commands.squeue(list(record.job_ids))
    return any(s.array_task == task and s.state == "RUNNING" for s in statuses)


def _requeue_when_ended(task_job: str, patience: float = 60.0) -> None:
    """Requeue a task whose every process was killed, as Slurm requeues the task of a dead
    node; ``scontrol requeue`` refuses a task still completing, so it is tried again."""
    deadline = time.monotonic() + patience
    while True:
        try:
            commands.requeue(task_job)
            return
        except SlurmError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(POLL_S)


def _wait(
    record: JobRecord,
    *,
    kind: str,
    task: str,
    acted: float,
    full: int,
    timeout: float,
    step_log: Path | None,
    logged: int,
) -> drill.Report:
    """Wait for the first step at full size after ``acted`` (or ``timeout``), then measure."""
    deadline = time.monotonic() + timeout
    history = record.events()
    found = drill.recovery(history, acted, full)
    while found.stepped_at is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
        history = record.events()
        found = drill.recovery(history, acted, full)
    lead = PreemptSignal.parse(record.signal or "USR2@90").seconds if kind == "preempt" else None
    saved = drill.save_after(history, acted) if kind == "preempt" else None
    redone: int | None = None
    problems: list[str] = []
    verdict = "not checked (give --step-log FILE)"
    if step_log is not None:
        steps = drill.log_steps(step_log.read_text()) if step_log.exists() else []
        checked = drill.check_steps(steps, drill.checkpoints(history), since=max(0, logged - 1))
        redone, problems = checked.redone, list(checked.problems)
        verdict = (
            "clean: no step missing, none repeated but the redone ones"
            if checked.clean
            else (f"{len(problems)} problem(s)")
        )
    return drill.Report(
        job=record.run_id,
        slot=task,
        kind=kind,
        acted_at=acted,
        full_size=full,
        time_to_full_step_s=None if found.stepped_at is None else found.stepped_at - acted,
        full_round=found.full_round,
        steps_redone=redone,
        grace_lead_s=None if lead is None else float(lead),
        save_after_signal_s=None if saved is None else saved - acted,
        step_log=verdict,
        problems=problems,
    )
