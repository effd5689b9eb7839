"""Sibling tasks Slurm holds (slurm/holds.py): a churn hold released under the no-progress
breaker, every other hold reported once across agents, and the last slot's own hold announced,
with Slurm faked at its one subprocess call."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from slurm_fake import array_slot as slot
from slurm_fake import mocked_slurm
from test_elastic import statuses

from hpc_elastic import events
from hpc_elastic.agent import command
from hpc_elastic.agent.api import AgentSpec
from hpc_elastic.slurm import commands, holds, queue
from hpc_elastic.slurm.departure import Departure
from hpc_elastic.slurm.elastic import ElasticSlot

# --- held tasks: release a churn hold under the no-progress breaker, announce the last ---

CHURN_HELD = "9|1|REQUEUE_HOLD|JobHoldMaxRequeue|\n9|0|RUNNING|None|n1\n"
ADMIN_HELD = "9|1|REQUEUE_HOLD|JobHeldAdmin|\n9|3|PENDING|JobHeldUser|\n9|0|RUNNING|None|n1\n"


@pytest.mark.parametrize(
    ("record", "progress", "allowed"),
    [
        (holds.HoldRecord(), None, True),
        (holds.HoldRecord(releases=1, released_at=40), 40, False),
        (holds.HoldRecord(releases=1, released_at=40), 50, True),
        (holds.HoldRecord(releases=1, released_at=None), None, False),
        (holds.HoldRecord(releases=1, released_at=None), 10, True),
    ],
)
def test_a_hold_is_released_again_only_after_a_newer_checkpoint(
    record: holds.HoldRecord, progress: int | None, allowed: bool
) -> None:
    assert holds.may_release(record, progress) is allowed


@pytest.mark.parametrize(("restarts", "held"), [(4, False), (5, True), (9, True)])
def test_a_requeue_past_max_batch_requeue_is_held(restarts: int, held: bool) -> None:
    assert holds.will_be_held(restarts, 5) is held


def test_the_site_limit_is_read_from_scontrol_show_config() -> None:
    config = commands.parse_scontrol_config("Configuration data\nMaxBatchRequeue         = 2\n")
    assert commands.max_batch_requeue(config) == 2
    assert commands.max_batch_requeue({}) == commands.DEFAULT_MAX_BATCH_REQUEUE


def test_progress_is_the_newest_committed_checkpoint_step() -> None:
    timeline = [
        events.Event(kind=events.Kind.CHECKPOINT, details={"step": 30}),
        events.Event(kind=events.Kind.CHECKPOINT, details={"step": 20}),
        events.Event(kind=events.Kind.ROUND, details={"round": 4}),
    ]
    assert holds.newest_checkpoint_step(timeline) == 30
    assert holds.newest_checkpoint_step(timeline[2:]) is None


def lowest_slot(job_dir: Path) -> ElasticSlot:
    """Task 0 of array 9, the lowest running slot in CHURN_HELD: the one that acts on holds."""
    return slot(job_dir, "n1", task=0)


def checkpoint(job_dir: Path, step: int) -> None:
    path = job_dir / "events.jsonl"
    events.append(path, events.Event(kind=events.Kind.CHECKPOINT, details={"step": step}))


def test_a_churn_hold_is_released_until_the_job_stops_progressing(tmp_path: Path) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "release")
        observe = lowest_slot(tmp_path).holds.watch(lambda kind, **d: said.append((kind, d)))
        checkpoint(tmp_path, 10)
        observe(statuses(CHURN_HELD))
        observe(statuses("9|0-1|RUNNING|None|n1\n"))
        observe(statuses(CHURN_HELD))  # held again, no checkpoint since: the breaker
        observe(statuses(CHURN_HELD))
        checkpoint(tmp_path, 20)
        observe(statuses(CHURN_HELD))  # progress again: released again
    assert fake.ran("scontrol") == [["scontrol", "release", "9_1"]] * 2
    assert [kind for kind, _ in said] == ["released", "held", "released"]
    assert said[0][1] == {"task": 1, "slurm_job": "9_1", "releases": 1, "progress": 10}
    assert said[1][1] == {"task": 1, "slurm_job": "9_1", "reason": "JobHoldMaxRequeue"}
    assert holds.load_hold_record(tmp_path / "slots" / "1.holds.json") == holds.HoldRecord(
        releases=2, released_at=20
    )


def test_an_admins_or_users_hold_is_reported_never_released(tmp_path: Path) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        observe = lowest_slot(tmp_path).holds.watch(lambda kind, **d: said.append((kind, d)))
        observe(statuses(ADMIN_HELD))
    assert fake.ran("scontrol") == []
    assert [(kind, d["task"], d["reason"]) for kind, d in said] == [
        ("held", 1, "JobHeldAdmin"),
        ("held", 3, "JobHeldUser"),
    ]


def test_a_new_agent_does_not_repeat_the_alert_for_the_same_hold(tmp_path: Path) -> None:
    said: list[str] = []
    with mocked_slurm() as fake:
        for _incarnation in range(3):  # each new agent process starts with empty memory
            lowest_slot(tmp_path).holds.watch(lambda kind, **d: said.append(kind))(
                statuses(ADMIN_HELD)
            )
    assert fake.ran("scontrol") == []
    assert said == ["held", "held"], "one alert per held task, not one per agent process"


def test_a_failed_release_is_reported_instead(tmp_path: Path) -> None:
    said: list[str] = []
    with mocked_slurm() as fake:
        fake.answer(
            "scontrol", "release", stderr="scontrol: error: Access/permission denied", returncode=1
        )
        lowest_slot(tmp_path).holds.watch(lambda kind, **d: said.append(kind))(statuses(CHURN_HELD))
    assert said == ["held"]


# What squeue showed on the dev cluster (Slurm 22.05.8), polled every 0.1 s, for a task held
# for JobHoldMaxRequeue (CHURN_HELD) after an `scontrol release`, here as task 1: the
# REQUEUE_HOLD state the release leaves behind, with no reason, then with the requeue delay's
# (BeginTime, about 5 s), until the task starts.
RELEASED_STILL_SHOWN = (
    "9|1|REQUEUE_HOLD|None|\n9|0|RUNNING|None|n1\n",
    "9|1|REQUEUE_HOLD|BeginTime|\n9|0|RUNNING|None|n1\n",
    "9|0-1|RUNNING|None|n[1-2]\n",
)


def test_a_task_released_but_still_shown_requeue_hold_is_not_a_new_hold(tmp_path: Path) -> None:
    """Slurm 22.05's release clears the hold's priority and reason but not the REQUEUE_HOLD
    state flag, which stays until the task starts: counted as held, the releasing slot raised
    a second ``held`` alert (reason BeginTime) for a hold it had just ended, and counted one
    more ended hold when the task started."""
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "release")
        observe = lowest_slot(tmp_path).holds.watch(lambda kind, **d: said.append((kind, d)))
        observe(statuses(CHURN_HELD))
        for shown in RELEASED_STILL_SHOWN:
            observe(statuses(shown))
    assert fake.ran("scontrol") == [["scontrol", "release", "9_1"]]
    assert [kind for kind, _ in said] == ["released"]
    assert holds.load_hold_record(tmp_path / "slots" / "1.holds.json") == holds.HoldRecord(
        releases=1
    )


def test_a_task_requeued_held_by_hand_is_held_whatever_its_state(tmp_path: Path) -> None:
    """``scontrol requeuehold`` leaves the task PENDING, its reason the text "job requeued in
    held state" (squeue prints the spaces): someone's decision, reported and never released."""
    shown = "9|1|PENDING|job requeued in held state|\n9|0|RUNNING|None|n1\n"
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        lowest_slot(tmp_path).holds.watch(lambda kind, **d: said.append((kind, d)))(statuses(shown))
    assert fake.ran("scontrol") == []
    assert [(kind, d["task"], d["reason"]) for kind, d in said] == [
        ("held", 1, "job_requeued_in_held_state")
    ]


def preempted_at(job_dir: Path, restarts: int) -> ElasticSlot:
    return slot(job_dir, restarts=restarts)


OWN_HELD = "JobId=9 ArrayJobId=9 ArrayTaskId=2 JobState=PENDING Reason=JobHoldMaxRequeue Restarts=6"
OWN_PENDING = "JobId=9 ArrayJobId=9 ArrayTaskId=2 JobState=PENDING Reason=BeginTime Restarts=6"
ALONE = "9|2|PENDING|JobHoldMaxRequeue|\n"


@pytest.mark.parametrize(
    ("restarts", "after", "siblings", "announced"),
    [
        (5, OWN_HELD, ALONE, True),
        (5, OWN_PENDING, ALONE, False),  # Slurm 22.05: an scontrol requeue never holds
        (5, OWN_HELD, ALONE + "9|0|RUNNING|None|n1\n", False),  # slot 0 will see it
    ],
)
def test_the_last_slot_announces_its_own_hold_before_it_leaves(
    tmp_path: Path, restarts: int, after: str, siblings: str, announced: bool
) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "show", "config", stdout="MaxBatchRequeue = 5\n")
        fake.answer("scontrol", "-o", "show", "job", stdout=after)
        fake.answer("squeue", stdout=siblings)
        fake.answer("scontrol", "requeue")
        moving = preempted_at(tmp_path, restarts)
        moving.requeue(Departure.PREEMPTION, lambda kind, **d: said.append((kind, d)))
        moving.requeue(Departure.PREEMPTION, lambda kind, **d: said.append((kind, d)))
    held = [d for kind, d in said if kind == "held"]
    expected = {
        "task": 2,
        "slurm_job": "9_2",
        "reason": "JobHoldMaxRequeue",
        "restarts": restarts + 1,
        "limit": 5,
        "last": True,
    }
    assert held == ([expected] if announced else [])
    configs = [argv for argv in fake.ran("scontrol") if argv[1:3] == ["show", "config"]]
    assert len(configs) == 1, "the site's limit is asked once per agent"


def test_below_the_limit_slurm_is_not_even_asked(tmp_path: Path) -> None:
    said: list[str] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "show", "config", stdout="MaxBatchRequeue = 5\n")
        fake.answer("scontrol", "requeue")
        preempted_at(tmp_path, 4).requeue(Departure.PREEMPTION, lambda k, **d: said.append(k))
    assert fake.ran("squeue") == []
    assert [argv[1] for argv in fake.ran("scontrol")] == ["requeue", "show"]
    assert said == []


def test_a_hold_the_last_slot_announced_is_not_announced_again_by_the_slot_that_sees_it(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    with mocked_slurm() as fake:
        fake.answer("scontrol", "show", "config", stdout="MaxBatchRequeue = 5\n")
        fake.answer("scontrol", "-o", "show", "job", stdout=OWN_HELD)
        fake.answer("squeue", stdout=ALONE)
        fake.answer("scontrol", "requeue")
        fake.answer("scontrol", "release", returncode=1, stderr="Access/permission denied")
        moving = preempted_at(tmp_path, 5)
        assert moving.requeue(Departure.PREEMPTION, lambda k, **d: said.append(k)) is None
        # Slurm starts slot 0 later; it cannot release the hold, and must not alert again.
        lowest_slot(tmp_path).holds.watch(lambda kind, **d: said.append(kind))(
            statuses(ALONE + "9|0|RUNNING|None|n1\n")
        )
    assert said == ["held"]


def test_a_hold_the_slot_reports_is_posted_to_the_notify_url_and_its_other_events_are_not(
    tmp_path: Path,
) -> None:
    # The slot's own events reach the notifier through the agent's emitter, not the Agent's
    # observers: the held report comes from the squeue thread, or from settle after the Agent.
    from hpc_elastic import notify  # noqa: PLC0415

    posted: list[bytes] = []
    delivered = threading.Event()

    def send(url: str, body: bytes, timeout: float) -> int:
        posted.append(body)
        delivered.set()
        return 200

    notifier = notify.Notifier("http://127.0.0.1:9/hook", send=send)
    emit = command._emitter(
        AgentSpec(job_dir=tmp_path, command=("train",)), "job", slot(tmp_path), notifier
    )
    emit(events.Kind.REQUEUE, cause="bad_node", slurm_job="9_2", excluded=["n3"])
    emit(events.Kind.HELD, task=1, slurm_job="9_1", reason=queue.CHURN_HOLD)
    assert delivered.wait(10), "the held alert was never posted"
    notifier.close()
    assert len(posted) == 1, posted
    body = json.loads(posted[0])
    assert (body["kind"], body["details"]["slurm_job"]) == ("held", "9_1")
    # The agent has no TORCHELASTIC_RUN_ID of its own: the job and slot are the event's.
    assert (body["job"], body["slot"]) == ("job", "2")
    assert [e.kind for e in events.read(tmp_path / "events.jsonl")] == ["requeue", "held"]
