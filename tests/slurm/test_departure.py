"""Why a slot is asked to stop (slurm/departure.py), on text captured from Slurm 22.05: the
rule that tells preemption, time limit, backfill's end and a stop by hand apart."""

from __future__ import annotations

import pytest
from test_elastic import RUNNING_JOB

from hpc_elastic.slurm import commands
from hpc_elastic.slurm.departure import Departure, departure, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:01:10", 70.0), ("1-02:00:00", 93600.0), ("05:00", 300.0), ("UNLIMITED", None)],
)
def test_parse_duration(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


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
    assert departure(record, warning_s=30) is why


@pytest.mark.parametrize(
    ("state", "preempt", "why"),
    [
        ("SIGNALING", "2026-12-01T07:31:03", Departure.PREEMPTION),
        ("SIGNALING", "None", Departure.BY_HAND),
        ("COMPLETING", "None", Departure.CANCELLED),
        ("CANCELLED", "None", Departure.CANCELLED),
    ],
)
def test_a_task_signalled_for_its_preemption_is_preempted_whatever_its_state_says(
    state: str, preempt: str, why: Departure
) -> None:
    """The 30-min soak's task read ``JobState=SIGNALING`` with a ``PreemptTime``: taken for a
    cancel, it was not requeued and the job lost the slot for good."""
    record = commands.parse_scontrol_record(
        RUNNING_JOB.format(state=state, limit="UNLIMITED", preempt=preempt)
    )
    assert departure(record, warning_s=30) is why
