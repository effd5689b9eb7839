"""Does a save still fit? (slurm/grace.py): the save clock on heartbeat readings, the limits
from Slurm's records, the verdict, and the watch on real heartbeat files."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from slurm_fake import array_slot, mocked_slurm

from hpc_elastic import doctor
from hpc_elastic.events import Event, Kind
from hpc_elastic.jobdir import JobDir
from hpc_elastic.ops.status import save_warning
from hpc_elastic.slurm import grace
from hpc_elastic.slurm.commands import parse_qos_table
from hpc_elastic.slurm.departure import Departure, departure
from hpc_elastic.train.local_tier import local_first_requested

CONFIG = {"PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE"}
GRACE5 = {"PartitionName": "grace5", "PreemptMode": "REQUEUE", "GraceTime": "5"}
JOB = {"Partition": "grace5", "QOS": "normal", "TimeLimit": "01:00:00"}


def test_a_save_is_timed_from_its_mark_to_the_step_written_back() -> None:
    clock = grace.SaveClock()
    assert clock.observe("0", grace.parse_beat("10", 100.0)) is None
    assert clock.observe("0", grace.parse_beat("12", 101.0)) is None  # two steps in 1 s
    assert clock.observe("0", grace.parse_beat("12 checkpoint", 101.5)) is None
    assert clock.observe("0", grace.parse_beat("12 checkpoint", 101.5)) is None  # unchanged
    assert clock.observe("0", grace.parse_beat("12", 109.5)) == 8.0
    assert clock.save_s() == 8.0
    assert clock.step_s() == 0.5


def test_the_slowest_recent_save_is_the_one_planned_for() -> None:
    clock = grace.SaveClock()
    for start, seconds in ((0.0, 3.0), (100.0, 9.0), (200.0, 4.0)):
        clock.observe("0", grace.parse_beat("1 checkpoint", start))
        clock.observe("0", grace.parse_beat("1", start + seconds))
    assert clock.save_s() == 9.0


def test_partition_preemption_leaves_the_partitions_gracetime() -> None:
    limits = grace.limits_from(90.0, JOB, CONFIG, GRACE5, {})
    assert (limits.grace_s, limits.where, limits.preempt_mode) == (
        5.0,
        "partition 'grace5'",
        "REQUEUE",
    )
    off = grace.limits_from(90.0, JOB, CONFIG, {**GRACE5, "PreemptMode": "OFF"}, {})
    assert off.grace_s is None


def test_qos_preemption_leaves_the_qoss_gracetime_and_only_to_a_preemptible_qos() -> None:
    rows = parse_qos_table(
        "normal|00:00:00|cluster|scavenger\nscavenger|00:00:20|requeue|\nhigh||cluster|scavenger\n"
    )
    table = {name: grace.QosRow(name, *row) for name, row in rows.items()}
    config = {"PreemptType": "preempt/qos", "PreemptMode": "REQUEUE"}
    scavenger = grace.limits_from(90.0, {**JOB, "QOS": "scavenger"}, config, GRACE5, table)
    assert (scavenger.grace_s, scavenger.where, scavenger.preempt_mode) == (
        20.0,
        "QoS 'scavenger'",
        "REQUEUE",
    )
    assert grace.limits_from(90.0, JOB, config, GRACE5, table).grace_s is None


def test_a_save_longer_than_the_gracetime_is_said_with_its_figures() -> None:
    limits = grace.limits_from(90.0, JOB, CONFIG, GRACE5, {})
    fit = grace.check(8.0, 0.5, limits)
    assert fit.grace_short
    assert not fit.lead_short
    assert fit.sentence() == (
        "a save of 8.0 s plus a step of 0.5 s outgrow the GraceTime of 5 s of partition "
        "'grace5' (PreemptMode REQUEUE): a preemption kills the save"
    )
    assert "ask for a GraceTime of 23 s or more" in fit.advice()
    assert grace.check(3.0, 0.5, limits).fits


def test_a_save_longer_than_the_signal_lead_moves_the_lead() -> None:
    limits = grace.limits_from(15.0, JOB, CONFIG, {**GRACE5, "PreemptMode": "OFF"}, {})
    fit = grace.check(12.0, 4.0, limits)
    assert fit.lead_short
    assert "outgrow the --signal lead of 15 s" in fit.sentence()
    assert fit.advice() == "submit with --signal USR2@34"
    assert grace.moved_lead(16.0) == 34.0
    no_limit = grace.limits_from(15.0, {**JOB, "TimeLimit": "UNLIMITED"}, CONFIG, GRACE5, {})
    assert not grace.check(12.0, 4.0, no_limit).lead_short


@pytest.mark.parametrize(
    ("text", "seconds"), [("5", 5.0), ("00:00:20", 20.0), ("1-00:00:00", 86400.0)]
)
def test_gracetime_is_read_as_slurm_prints_it(text: str, seconds: float) -> None:
    assert grace.seconds(text) == seconds


def beat(path: Path, text: str, mtime: float) -> None:
    path.write_text(text + "\n")
    os.utime(path, (mtime, mtime))


def test_the_watch_warns_once_and_moves_the_lead_when_allowed(tmp_path: Path) -> None:
    warned: list[grace.Fit] = []
    leads: list[float] = []
    limits = grace.limits_from(15.0, JOB, CONFIG, GRACE5, {})
    watch = grace.GraceWatch(
        tmp_path, limits=lambda: limits, warn=warned.append, stop_at=leads.append
    )
    heartbeat = tmp_path / "heartbeat_0"
    (tmp_path / "heartbeat_0.collective").write_text("in all_reduce #3 1.0 7")  # not a beat
    for start in (1000.0, 2000.0):
        beat(heartbeat, "5", start)
        assert watch.poll() is None
        beat(heartbeat, "5 checkpoint", start + 1)
        assert watch.poll() is None
        beat(heartbeat, "5", start + 21)
        verdict = watch.poll()
        assert verdict is not None
        assert not verdict.fits
    assert len(warned) == 1, "warned once"
    assert leads == [grace.moved_lead(20.0)]


def test_a_time_limit_stop_within_the_moved_lead_is_the_time_limits(tmp_path: Path) -> None:
    job = {"JobState": "RUNNING", "PreemptTime": "None", "RunTime": "00:58:40"}
    job["TimeLimit"] = "01:00:00"
    assert departure(job, 15.0) is Departure.BY_HAND
    assert departure(job, 40.0) is Departure.TIME_LIMIT


def test_only_the_first_agent_of_the_job_writes_the_grace_event(tmp_path: Path) -> None:
    said: list[tuple[str, dict[str, object]]] = []

    def emit(kind: str, **details: object) -> None:
        said.append((kind, details))

    partition = "PartitionName=grace5 PreemptMode=REQUEUE GraceTime=5\n"
    with mocked_slurm() as slurm:
        slurm.answer("scontrol", "-o", "show", "job", stdout="JobId=12 Partition=grace5 QOS=normal "
                     "TimeLimit=UNLIMITED EndTime=Unknown\n")  # fmt: skip
        slurm.answer("scontrol", "show", "config", stdout="PreemptType = preempt/partition_prio\n")
        slurm.answer("scontrol", "-o", "show", "partition", stdout=partition)
        for node in ("n1", "n2"):
            run_dir = tmp_path / node
            run_dir.mkdir()
            watch = array_slot(tmp_path, node=node).grace.watch(
                run_dir, 15.0, "warn", lambda: None, emit
            )
            watch.stop()
            beat(run_dir / "heartbeat_0", "5 checkpoint", 1000.0)
            watch.poll()
            beat(run_dir / "heartbeat_0", "5", 1008.0)
            fit = watch.poll()
            assert fit is not None
            assert fit.grace_short
    [(kind, details)] = said
    assert kind == Kind.GRACE
    assert details["save_s"] == 8.0
    assert details["grace_s"] == 5.0


PARTITION_GRACE5 = (
    "PartitionName=grace5 AllowGroups=ALL Default=NO GraceTime=5 Nodes=n[1-4] PriorityTier=1 "
    "PreemptMode=REQUEUE State=UP TotalNodes=4\n"
)


def test_doctor_warns_of_a_save_longer_than_the_partitions_gracetime_with_the_figures() -> None:
    with mocked_slurm() as fake:
        fake.answer("scontrol", "show", "config", stdout="PreemptType = preempt/partition_prio\n")
        fake.answer("scontrol", "-o", "show", "partition", "grace5", stdout=PARTITION_GRACE5)
        found = doctor.save_fit_check("grace5", None, 90.0, 8.0, "as given")
    assert found.level is doctor.Level.WARN
    assert found.message == (
        "a save of 8.0 s plus a step of 0.0 s outgrow the GraceTime of 5 s of partition "
        "'grace5' (PreemptMode REQUEUE): a preemption kills the save (as given)"
    )
    assert found.hint.startswith("ask for a GraceTime of 22 s or more")


def test_doctor_times_a_test_save_in_the_checkpoint_directory(tmp_path: Path) -> None:
    with mocked_slurm() as fake:
        fake.answer("scontrol", "show", "config", stdout="PreemptType = preempt/partition_prio\n")
        fake.answer("scontrol", "-o", "show", "partition", "grace5", stdout=PARTITION_GRACE5)
        found = doctor.SavePlan(lead_s=90.0, size=1024 * 1024).check("grace5", tmp_path)
    assert "a test save of 1 MB to" in found.message
    assert not list(tmp_path.iterdir()), "the test save is removed"


def test_a_moved_lead_stops_the_slot_before_its_end_and_is_read_as_the_time_limit(
    tmp_path: Path,
) -> None:
    stopped: list[str] = []
    said: list[tuple[str, dict[str, object]]] = []
    soon = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 20))
    with mocked_slurm() as slurm:
        slurm.answer(
            "scontrol", "-o", "show", "job",
            stdout=f"JobId=12 JobState=RUNNING TimeLimit=00:30:00 EndTime={soon}\n",
        )  # fmt: skip
        slot = array_slot(tmp_path)
        slot.grace.moved_lead = 34.0
        slot.grace._stop_before_the_end(
            34.0, lambda: stopped.append("stop"), lambda kind, **d: said.append((kind, d))
        )
    assert stopped == ["stop"], "20 s before the end is within the moved lead of 34 s"
    assert said == [
        (Kind.GRACE, {"message": "stopping 34 s before the time limit", "action": "lead"})
    ]
    job = {"JobState": "RUNNING", "PreemptTime": "None", "RunTime": "00:29:40"}
    job["TimeLimit"] = "00:30:00"
    assert departure(job, max(15.0, slot.grace.moved_lead)) is Departure.TIME_LIMIT


def test_a_job_without_a_time_limit_never_moves_its_lead(tmp_path: Path) -> None:
    stopped: list[str] = []
    with mocked_slurm() as slurm:
        slurm.answer(
            "scontrol", "-o", "show", "job",
            stdout="JobId=12 JobState=RUNNING TimeLimit=UNLIMITED EndTime=Unknown\n",
        )  # fmt: skip
        array_slot(tmp_path).grace._stop_before_the_end(34.0, lambda: stopped.append("stop"), print)
    assert stopped == []


@pytest.mark.parametrize(("action", "published"), [("local", True), ("warn", False)])
def test_with_grace_action_local_a_save_that_outgrows_the_gracetime_sends_stop_saves_local(
    tmp_path: Path, action: str, published: bool
) -> None:
    """The agent publishes the decision in the job directory, where every worker of the job
    (and of every later incarnation) reads it when its loop stops (train/local_tier.py)."""
    said: list[tuple[str, dict[str, object]]] = []
    partition = "PartitionName=grace5 PreemptMode=REQUEUE GraceTime=5\n"
    with mocked_slurm() as slurm:
        slurm.answer("scontrol", "-o", "show", "job", stdout="JobId=12 Partition=grace5 QOS=normal "
                     "TimeLimit=UNLIMITED EndTime=Unknown\n")  # fmt: skip
        slurm.answer("scontrol", "show", "config", stdout="PreemptType = preempt/partition_prio\n")
        slurm.answer("scontrol", "-o", "show", "partition", stdout=partition)
        run_dir = tmp_path / "n1"
        run_dir.mkdir()
        stops: list[str] = []
        watch = array_slot(tmp_path).grace.watch(
            run_dir, 15.0, action, lambda: stops.append("stop"), lambda k, **d: said.append((k, d))
        )
        watch.stop()
        beat(run_dir / "heartbeat_0", "5", 990.0)
        watch.poll()
        beat(run_dir / "heartbeat_0", "5 checkpoint", 1000.0)
        watch.poll()
        assert not JobDir(tmp_path).local_first.exists(), "not before a save is known"
        beat(run_dir / "heartbeat_0", "5", 1008.0)
        assert watch.poll() is not None
    assert JobDir(tmp_path).local_first.exists() is published
    assert local_first_requested(signal.SIGUSR2, {"HPC_ELASTIC_JOB_DIR": str(tmp_path)}) is (
        published
    )
    [(kind, details)] = said
    assert (kind, details["action"]) == (Kind.GRACE, action)
    assert stops == [], "nothing is stopped: only the next stop's save changes"


def test_status_says_what_grace_action_local_does() -> None:
    warned = Event(
        kind=Kind.GRACE,
        details={"message": "a save of 8.0 s plus a step of 0.5 s outgrow ...", "advice": "x"},
    )
    local = Event(kind=Kind.GRACE, details={**warned.details, "action": "local"})
    assert "--grace-action local" not in (save_warning([warned]) or "")
    assert (save_warning([local]) or "").endswith(
        "; a stop's save goes to the node-local tier only, and to the shared tier at the next "
        "start (--grace-action local)"
    )
