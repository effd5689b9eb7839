"""Guaranteed MIN, scavenged growth (``--grow-partition``, ``--grow-qos``): the slots above MIN
are a second array job of the same run. The rules, with Slurm faked at its one subprocess call
(``slurm_fake``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from slurm_fake import Reply, mocked_slurm, mocked_submit
from test_cli import invoke

from hpc_elastic import events
from hpc_elastic.errors import UsageError
from hpc_elastic.events import Event, Kind
from hpc_elastic.jobdir import JobRecord
from hpc_elastic.ops import cancel, status
from hpc_elastic.render import RenderContext, render, render_growth
from hpc_elastic.slurm import queue
from hpc_elastic.slurm.commands import JobStatus, SlurmJobId, parse_squeue
from hpc_elastic.slurm.departure import Departure, departure
from hpc_elastic.slurm.elastic import ElasticSlot
from hpc_elastic.slurm.env import SlurmContext
from hpc_elastic.slurm.ledger import SlotLedger, save_ledger
from hpc_elastic.spec import ArrayPart, JobSpec, NodeRange

RUN_ID = "train-20261203-101500-beef"
CONTEXT = RenderContext(
    version="0.1.0",
    command_line=("hpc-elastic", "submit", "--nodes", "2:4", "train.py"),
    python="/opt/venv/bin/python",
    run_id=RUN_ID,
    job_dir=Path("/scratch/runs") / RUN_ID,
)
GROWING = JobSpec(
    script=Path("/home/ada/train.py"),
    nodes=NodeRange(2, 4),
    job_name="train",
    partition="gpu",
    qos="normal",
    grow_qos="scavenger",
)


def sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_the_slots_above_min_are_a_second_array_with_the_growth_qos() -> None:
    assert GROWING.array_parts() == (ArrayPart("core", 0, 1), ArrayPart("grow", 2, 3))
    core, grow = render(GROWING, CONTEXT), render_growth(GROWING, CONTEXT)
    assert grow is not None
    assert "#SBATCH --array=0-1" in sbatch_lines(core.text)
    assert "#SBATCH --qos=normal" in sbatch_lines(core.text)
    assert "#SBATCH --array=2-3" in sbatch_lines(grow.text)
    assert "#SBATCH --qos=scavenger" in sbatch_lines(grow.text)
    assert "#SBATCH --partition=gpu" in sbatch_lines(grow.text)
    # One rendezvous: the same agent command (run id, range, job directory) in both.
    launch = [line for line in core.text.splitlines() if "--run-id" in line]
    assert launch
    assert launch == [line for line in grow.text.splitlines() if "--run-id" in line]


def test_hot_spares_are_growth_slots_and_a_growth_partition_keeps_the_qos() -> None:
    spec = JobSpec(
        script=Path("/home/ada/train.py"),
        nodes=NodeRange(1, 3),
        spares=1,
        qos="normal",
        grow_partition="scavenge",
    )
    assert spec.array_parts() == (ArrayPart("core", 0, 0), ArrayPart("grow", 1, 3))
    grow = render_growth(spec, CONTEXT)
    assert grow is not None
    lines = sbatch_lines(grow.text)
    assert {"#SBATCH --array=1-3", "#SBATCH --partition=scavenge", "#SBATCH --qos=normal"} <= set(
        lines
    )


def test_a_job_without_growth_elsewhere_is_one_array_as_before() -> None:
    spec = JobSpec(script=Path("/home/ada/train.py"), nodes=NodeRange(1, 4))
    assert spec.array_parts() == (ArrayPart("all", 0, 3),)
    assert render_growth(spec, CONTEXT) is None
    assert "#SBATCH --array=0-3" in sbatch_lines(render(spec, CONTEXT).text)


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"nodes": NodeRange(4, 4)}, "--grow-qos 'scavenger' places the slots above MIN, but "),
        ({"grow_qos": "normal"}, "--grow-qos 'normal' is where the guaranteed slots run already"),
        ({"grow_qos": "bad qos"}, "--grow-qos 'bad qos' is empty or contains spaces"),
    ],
)
def test_growth_without_slots_above_min_or_anywhere_else_is_one_sentence(
    changes: dict[str, object], said: str
) -> None:
    values = {**GROWING.values(), **changes}
    with pytest.raises(UsageError, match=said.replace("(", r"\(")):
        JobSpec(**values)  # type: ignore[arg-type]


def test_submit_sends_both_arrays_and_records_both_jobs(workdir: Path) -> None:
    with mocked_submit() as slurm:
        code, out, err = invoke("submit", "--nodes", "2:4", "--grow-qos", "scavenger", "train.py")
    assert (code, err) == (0, "")
    [job_dir] = (workdir / "hpc-elastic-runs").iterdir()
    assert "Growth slots: slots 2-3 with QoS scavenger, as Slurm job 43." in out.splitlines()
    assert slurm.submitted == [
        (job_dir / "sbatch.sh").read_text(),
        (job_dir / "sbatch-grow.sh").read_text(),
    ]
    record = json.loads((job_dir / "job.json").read_text())
    assert (record["job_id"], record["grow_job_id"]) == ("42", "43")
    loaded = JobRecord.load(job_dir)
    assert loaded.job_ids == ("42", "43")
    assert [loaded.placement(task) for task in range(4)] == [
        (None, None),
        (None, None),
        (None, "scavenger"),
        (None, "scavenger"),
    ]


def test_a_refused_growth_array_takes_the_first_one_back(workdir: Path) -> None:
    refused = "sbatch: error: Batch job submission failed: Invalid qos specification\n"
    replies = iter([Reply(stdout="42\n"), Reply(stderr=refused, returncode=1)])
    with mocked_submit() as slurm:
        slurm.respond("sbatch", responder=lambda argv: next(replies))
        slurm.answer("scancel")
        code, _, err = invoke("submit", "--nodes", "2:4", "--grow-qos", "nope", "train.py")
    assert code == 1
    assert "Invalid qos specification" in err
    assert slurm.ran("scancel") == [["scancel", "42"]]
    assert len(slurm.submitted) == 2
    assert not list((workdir / "hpc-elastic-runs").iterdir())


def test_render_prints_both_arrays(workdir: Path) -> None:
    with mocked_slurm() as slurm:  # told nothing: render calls nothing on Slurm
        code, out, _ = invoke("render", "--nodes", "2:4", "--grow-partition", "scav", "train.py")
    assert slurm.calls == []
    assert code == 0
    core, separator, grow = out.partition("# ---- the growth slots' array")
    assert separator
    assert "#SBATCH --array=0-1" in core
    assert "--partition" not in core
    assert "#SBATCH --array=2-3" in grow
    assert "#SBATCH --partition=scav" in grow


def squeue_lines(*lines: str) -> list[JobStatus]:
    return parse_squeue("\n".join(lines))


def test_each_task_is_known_by_its_own_array() -> None:
    statuses = squeue_lines(
        "9|0|RUNNING|None|n1",
        "9|1|RUNNING|None|n2",
        "10|2|RUNNING|None|n3",
        "10|3|PENDING|Resources|",
    )
    assert queue.task_arrays(statuses) == {0: "9", 1: "9", 2: "10", 3: "10"}


def test_the_coming_slots_count_both_arrays_in_one_squeue() -> None:
    asked: list[list[str]] = []

    def squeue(ids: Sequence[str]) -> list[JobStatus]:
        asked.append(list(ids))
        return squeue_lines("9|0|RUNNING|None|n1", "10|2|RUNNING|None|n3", "10|3|PENDING|None|")

    coming = queue.ComingSlots("9", squeue, spawn=lambda work: work(), also=lambda: ("10",))
    assert coming() == 3
    assert asked == [["9", "10"]]


def write_record(job_dir: Path, grow_job_id: str | None = "10") -> None:
    """A job of core array 9 (slots 0-1, QoS normal) and growth array 10 (slots 2-3)."""
    JobRecord(
        run_id=RUN_ID,
        job_dir=job_dir,
        job_id="9",
        local=False,
        zk="127.0.0.1:2181",
        nodes="2:4",
        nproc_per_node=1,
        max_restarts=3,
        spec={"qos": "normal", "grow_qos": "scavenger"},
        grow_job_id=grow_job_id,
    ).write()


def slot_of(job_dir: Path, array: str, task: int, node: str) -> ElasticSlot:
    context = SlurmContext(
        job_id=str(100 + task),
        node_name=node,
        node_id=0,
        num_nodes=1,
        nodelist=node,
        array_job_id=array,
        array_task_id=task,
    )
    return ElasticSlot(context, job_dir)


QUEUE = "\n".join(
    [
        "9|0|RUNNING|None|n1",
        "9|1|PENDING|Priority|",
        "10|2|RUNNING|None|n3",
        "10|3|PENDING|Resources|",
        "",
    ]
)


def test_a_slot_finds_the_other_array_in_the_job_record_once_submit_wrote_it(
    tmp_path: Path,
) -> None:
    write_record(tmp_path, grow_job_id=None)
    core = slot_of(tmp_path, "9", 0, "n1")
    assert core.arrays.ids() == ["9"]  # submit has not written the growth array's id yet
    write_record(tmp_path)
    assert core.arrays.ids() == ["9", "10"]
    assert slot_of(tmp_path, "10", 2, "n3").arrays.ids() == ["10", "9"]


def test_the_end_of_the_job_cancels_the_siblings_of_both_arrays_each_by_its_own_id(
    tmp_path: Path,
) -> None:
    write_record(tmp_path)
    said: list[tuple[str, dict[str, object]]] = []
    # Task 0's ledger says its agent left cleanly: it is never cancelled.
    save_ledger(tmp_path / "slots" / "0.json", SlotLedger())
    with mocked_slurm() as slurm:
        slurm.answer("squeue", stdout=QUEUE)
        slurm.answer("scancel")
        slot = slot_of(tmp_path, "10", 2, "n3")
        assert slot.settle(0, 30.0, lambda kind, **d: said.append((kind, d))) == 0
    assert ["squeue", "-h", "-o", "%F|%K|%T|%r|%N", "-j", "10,9"] in slurm.calls
    assert slurm.ran("scancel") == [["scancel", "10_[3]"], ["scancel", "9_[1]"]]
    assert said == [("cancel_pending", {"tasks": [3, 1], "running": []})]


def test_status_asks_slurm_for_both_arrays_and_says_where_each_slot_runs(tmp_path: Path) -> None:
    write_record(tmp_path)
    asked: list[list[str]] = []

    def squeue(ids: Sequence[str]) -> list[JobStatus]:
        asked.append(list(ids))
        return squeue_lines("9|0-1|PENDING|Priority|", "10|2|RUNNING|None|n3")

    view = status.gather(JobRecord.load(tmp_path), squeue)
    assert asked == [["9", "10"]]
    where = {slot.slot: (slot.partition, slot.qos) for slot in view.slots}
    assert where == {"2": ("-", "scavenger"), "[0-1]": ("-", "normal")}
    assert status.placed_apart(view.slots)


def test_cancel_ends_both_arrays(tmp_path: Path) -> None:
    write_record(tmp_path)
    cancelled: list[str] = []
    done = cancel.cancel(JobRecord.load(tmp_path), cancelled.append, lambda record: None)
    assert cancelled == ["9", "10"]
    assert done[0] == "cancelled Slurm job 9 and 10 (every slot)"


def test_a_hold_in_the_other_array_is_released_by_its_own_job_id(tmp_path: Path) -> None:
    write_record(tmp_path)
    held = squeue_lines(
        "9|0|RUNNING|None|n1", "10|2|RUNNING|None|n3", f"10|3|PENDING|{queue.CHURN_HOLD}|"
    )
    with mocked_slurm() as slurm:
        slurm.answer("scontrol", "release")
        slot_of(tmp_path, "10", 2, "n3").holds.watch(lambda kind, **details: None)(held)
        assert slurm.calls == []  # the lowest running slot (0) releases, not slot 2
        slot_of(tmp_path, "9", 0, "n1").holds.watch(lambda kind, **details: None)(held)
    assert slurm.ran("scontrol") == [["scontrol", "release", "10_3"]]


def test_squeue_lines_name_their_array(tmp_path: Path) -> None:
    assert [status.job_id for status in squeue_lines("10|2|RUNNING|None|n3")] == [SlurmJobId("10")]


def test_backfill_growth_asks_for_its_time_min_in_the_growth_array_only() -> None:
    spec = JobSpec(
        script=Path("/home/ada/train.py"), nodes=NodeRange(2, 4), time="4:00:00", grow_time_min="30"
    )
    grow = render_growth(spec, CONTEXT)
    assert grow is not None
    assert {"#SBATCH --array=2-3", "#SBATCH --time-min=30", "#SBATCH --time=4:00:00"} <= set(
        sbatch_lines(grow.text)
    )
    assert "--time-min" not in render(spec, CONTEXT).text
    with pytest.raises(UsageError, match="--grow-time-min 'soon' is not a Slurm time"):
        JobSpec(script=Path("/home/ada/train.py"), nodes=NodeRange(2, 4), grow_time_min="soon")


def test_a_backfill_slots_time_limit_requeues_it_for_the_next_hole_without_spending_a_budget() -> (
    None
):
    job = {"JobState": "RUNNING", "PreemptTime": "None", "RunTime": "00:29:10"}
    job |= {"TimeLimit": "00:30:00", "TimeMin": "00:30:00"}
    assert departure(job, 90.0) is Departure.BACKFILL_END
    assert departure({**job, "TimeMin": "N/A"}, 90.0) is Departure.TIME_LIMIT
    ledger = SlotLedger().requeued(Departure.BACKFILL_END)
    assert (ledger.time_limits, ledger.preemptions) == (0, 0)


def test_status_counts_the_node_hours_the_backfill_slots_ran(tmp_path: Path) -> None:
    JobRecord(
        run_id=RUN_ID,
        job_dir=tmp_path,
        job_id="9",
        local=False,
        zk="127.0.0.1:2181",
        nodes="2:4",
        nproc_per_node=1,
        max_restarts=3,
        spec={"grow_time_min": "30"},
        grow_job_id="10",
    ).write()
    history = [
        Event(kind=Kind.JOIN, slot="0", time=0.0),  # a guaranteed slot: not counted
        Event(kind=Kind.JOIN, slot="2", time=0.0),
        Event(kind=Kind.REQUEUE, slot="2", time=1800.0),  # its hole ended after half an hour
        Event(kind=Kind.JOIN, slot="2", time=3600.0),
        Event(kind=Kind.JOIN, slot="3", time=5400.0),
        Event(kind=Kind.DONE, slot="3", time=7200.0),
        Event(kind=Kind.DONE, slot="2", time=7200.0),
    ]
    for event in history:
        events.append(tmp_path / "events.jsonl", event)
    view = status.gather(JobRecord.load(tmp_path), lambda ids: [])
    assert view.backfill_node_hours == pytest.approx(0.5 + 1.0 + 0.5)
    assert status.node_hours(history, {"2"}, now=None) == pytest.approx(1.5)
