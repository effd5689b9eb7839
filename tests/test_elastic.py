"""The Slurm side of elastic slots, on text captured from Slurm 22.05 and fake Slurm calls."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hpc_elastic.cli import app
from hpc_elastic.errors import SlurmError
from hpc_elastic.ops import cancel
from hpc_elastic.ops.jobs import JobRecord
from hpc_elastic.slurm import commands, elastic
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.slurm.elastic import (
    ComingSlots,
    Departure,
    ElasticSlot,
    SlotLedger,
    SlotLimits,
)
from hpc_elastic.slurm.env import SlurmContext

# A 1:4 array while another job holds 3 nodes: one task runs, three wait for resources.
HELD_BACK = """\
9|1-3|PENDING|Resources|
9|0|RUNNING|None|n1
"""
# After a preemption: two requeued tasks wait out the requeue delay, one was just granted.
AFTER_PREEMPTION = """\
9|2-3|PENDING|BeginTime|
9|1|PENDING|None|
9|0|RUNNING|None|n1
"""
RUNNING_JOB = (
    "JobId=9 ArrayJobId=9 ArrayTaskId=2 JobName=train JobState={state} Reason=None "
    "RunTime=00:01:10 TimeLimit={limit} PreemptEligibleTime=2026-11-29T10:00:00 "
    "PreemptTime={preempt} SuspendTime=None NodeList=n3\n"
)


def statuses(text: str) -> list[JobStatus]:
    return commands.parse_squeue(text)


@pytest.mark.parametrize(
    ("text", "indices"),
    [("3", [3]), ("0-3", [0, 1, 2, 3]), ("1,3-4", [1, 3, 4]), ("0-3%2", [0, 1, 2, 3])],
)
def test_task_indices(text: str, indices: list[int]) -> None:
    assert elastic.task_indices(text) == indices


def test_task_indices_refuses_garbage() -> None:
    with pytest.raises(SlurmError, match="'x-1'"):
        elastic.task_indices("x-1")


def test_slots_waiting_for_resources_are_not_coming() -> None:
    assert elastic.coming_slots(statuses(HELD_BACK)) == 1


def test_just_granted_slots_come_requeued_ones_do_not() -> None:
    assert elastic.coming_slots(statuses(AFTER_PREEMPTION)) == 2
    assert elastic.pending_tasks(statuses(AFTER_PREEMPTION)) == [1, 2, 3]


def test_a_task_held_after_too_many_requeues_is_cancelled_at_the_end() -> None:
    held = "9|1|REQUEUE_HOLD|JobHoldMaxRequeue|\n9|0|RUNNING|None|n1\n"
    assert elastic.pending_tasks(statuses(held)) == [1]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:01:10", 70.0), ("1-02:00:00", 93600.0), ("05:00", 300.0), ("UNLIMITED", None)],
)
def test_parse_duration(text: str, seconds: float | None) -> None:
    assert elastic.parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("limit", "preempt", "why"),
    [
        ("UNLIMITED", "2026-11-29T10:01:10", Departure.PREEMPTION),
        ("00:02:00", "None", Departure.TIME_LIMIT),
        ("01:00:00", "None", Departure.BY_HAND),
        ("UNLIMITED", "None", Departure.BY_HAND),
    ],
)
def test_departure_tells_causes_apart(limit: str, preempt: str, why: Departure) -> None:
    record = commands.parse_scontrol_record(
        RUNNING_JOB.format(state="RUNNING", limit=limit, preempt=preempt)
    )
    assert elastic.departure(record, warning_s=30) is why


def test_ledger_counts_each_cause_against_its_own_limit() -> None:
    limits = SlotLimits(max_preemptions=1, max_time_limits=0)
    once = SlotLedger().requeued(Departure.PREEMPTION)
    assert once.over_limit(limits) is None
    assert "preempted 2 times" in str(once.requeued(Departure.PREEMPTION).over_limit(limits))
    assert "time limit 1 times" in str(
        SlotLedger().requeued(Departure.TIME_LIMIT).over_limit(limits)
    )


def test_coming_slots_asks_squeue_at_most_once_per_interval() -> None:
    calls: list[list[str]] = []
    now = [0.0]

    def squeue(ids: object) -> list[JobStatus]:
        calls.append(list(ids))  # type: ignore[call-overload]
        return statuses(HELD_BACK)

    coming = ComingSlots("9", squeue, interval=2.0, clock=lambda: now[0])
    assert [coming(), coming()] == [1, 1]
    now[0] = 2.5
    assert coming() == 1
    assert calls == [["9"], ["9"]]


def test_coming_slots_falls_back_to_the_last_call_when_squeue_fails() -> None:
    def broken(ids: object) -> list[JobStatus]:
        raise SlurmError("squeue failed.")

    assert ComingSlots("9", broken)() is None


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every Slurm call, as text; squeue answers AFTER_PREEMPTION, scontrol a preempted job."""
    made: list[str] = []
    monkeypatch.setattr(commands, "squeue", lambda ids, env=None: statuses(AFTER_PREEMPTION))
    monkeypatch.setattr(
        commands, "cancel", lambda job_id, signal=None, env=None: made.append(f"scancel {job_id}")
    )
    monkeypatch.setattr(
        commands, "requeue", lambda job_id, env=None: made.append(f"requeue {job_id}")
    )
    monkeypatch.setattr(
        commands,
        "update_job",
        lambda job_id, env=None, **fields: made.append(f"update {job_id} {fields}"),
    )
    record = commands.parse_scontrol_record(
        RUNNING_JOB.format(state="RUNNING", limit="UNLIMITED", preempt="2026-11-29T10:01:10")
    )
    monkeypatch.setattr(commands, "scontrol_show_job", lambda job_id, env=None: record)
    return made


def slot(job_dir: Path, node: str = "n3", limits: SlotLimits | None = None) -> ElasticSlot:
    context = SlurmContext(
        job_id="12",
        node_name=node,
        node_id=0,
        num_nodes=1,
        nodelist=node,
        array_job_id="9",
        array_task_id=2,
    )
    return ElasticSlot(context, job_dir, limits or SlotLimits())


def test_only_array_tasks_are_elastic_slots(tmp_path: Path) -> None:
    plain = {"SLURM_JOB_ID": "4", "SLURMD_NODENAME": "n1"}
    assert ElasticSlot.from_env(plain, tmp_path, SlotLimits()) is None
    task = {**plain, "SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "2"}
    assert ElasticSlot.from_env(task, tmp_path, SlotLimits()) is not None


def test_a_preempted_slot_is_requeued_and_says_why(tmp_path: Path, calls: list[str]) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    code = slot(tmp_path).settle(75, 30.0, lambda kind, **details: said.append((kind, details)))
    assert code == 75
    assert calls == ["requeue 9_2"]
    evidence = {
        "JobState": "RUNNING",
        "PreemptTime": "2026-11-29T10:01:10",
        "RunTime": "00:01:10",
        "TimeLimit": "UNLIMITED",
    }
    assert said == [
        (
            "requeue",
            {"cause": "preemption", "slurm": evidence, "slurm_job": "9_2", "excluded": []},
        )
    ]
    assert elastic.load_ledger(tmp_path / "slots" / "2.json").preemptions == 1


def test_a_slot_over_its_preemption_limit_is_not_requeued(tmp_path: Path, calls: list[str]) -> None:
    said: list[str] = []
    code = slot(tmp_path, limits=SlotLimits(max_preemptions=0)).settle(
        75, 30.0, lambda kind, **details: said.append(f"{kind} {details}")
    )
    assert code == 1
    assert calls == []
    assert "preempted 1 times (--max-preemptions 0)" in said[0]


def test_a_node_that_fails_the_slot_twice_is_excluded(tmp_path: Path, calls: list[str]) -> None:
    first = slot(tmp_path)
    first.arrive()
    assert not first.count_failure()
    assert first.count_failure()
    said: list[str] = []
    assert first.settle(75, 30.0, lambda kind, **details: said.append(kind)) == 75
    assert calls == ["requeue 9_2", "update 9_2 {'ExcNodeList': 'n3'}"]
    assert said == ["exclude", "requeue"]


def test_an_incarnation_that_died_with_its_node_counts_as_a_failure(tmp_path: Path) -> None:
    slot(tmp_path, "n4").arrive()
    again = slot(tmp_path, "n1")
    assert again.arrive() == "n4"
    again.leave()
    assert slot(tmp_path, "n2").arrive() is None
    assert elastic.load_ledger(again.ledger_path).node_failures == {"n4": 1}


def test_when_the_job_is_over_pending_slots_are_cancelled(tmp_path: Path, calls: list[str]) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    assert slot(tmp_path).settle(0, 30.0, lambda kind, **d: said.append((kind, d))) == 0
    assert calls == ["scancel 9_[1,3]"]
    assert said == [("cancel_pending", {"tasks": [1, 3]})]


def test_a_stopped_slot_cancels_nothing(tmp_path: Path, calls: list[str]) -> None:
    assert slot(tmp_path).settle(143, 30.0, lambda kind, **d: None) == 143
    assert calls == []


def test_an_unreadable_ledger_is_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / "2.json"
    path.write_text("{not json")
    with pytest.raises(SlurmError, match="delete it"):
        elastic.load_ledger(path)


def test_cancel_ends_the_array_then_closes_the_rendezvous(tmp_path: Path) -> None:
    record = JobRecord(
        run_id="train-1",
        job_dir=tmp_path,
        job_id="9",
        local=False,
        zk="127.0.0.1:2181",
        nodes="1:4",
        nproc_per_node=2,
        max_restarts=3,
    )
    order: list[str] = []
    done = cancel.cancel(
        record,
        lambda job_id: order.append(f"scancel {job_id}"),
        lambda rec: order.append(f"close {rec.run_id}"),
    )
    assert order == ["scancel 9", "close train-1"]
    assert done == ["cancelled Slurm job 9 (every slot)", "closed the rendezvous"]
    assert [event.kind for event in record.events()] == ["cancel"]


def test_cancel_of_an_unknown_job_is_one_sentence(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["cancel", "nope", "--log-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "Job 'nope' is unknown" in result.output


def test_pending_slots_already_gone_are_no_error(
    tmp_path: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def gone(job_id: str, signal: str | None = None, env: object = None) -> None:
        raise SlurmError("`scancel 9_[1,3]` failed: Job has already finished.")

    monkeypatch.setattr(commands, "cancel", gone)
    assert slot(tmp_path).settle(0, 30.0, lambda kind, **d: None) == 0


def test_a_cancelled_slot_is_not_requeued(
    tmp_path: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """scancel sends SIGTERM, which the workers also answer by saving and exiting 75."""
    cancelled = RUNNING_JOB.format(state="CANCELLED", limit="UNLIMITED", preempt="None")
    record = commands.parse_scontrol_record(cancelled)
    monkeypatch.setattr(commands, "scontrol_show_job", lambda job_id, env=None: record)
    said: list[str] = []
    assert slot(tmp_path).settle(75, 30.0, lambda kind, **d: said.append(kind)) == 75
    assert calls == []
    assert said == []
