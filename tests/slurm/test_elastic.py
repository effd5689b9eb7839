"""A slot's life (slurm/elastic.py): arrival, failures, requeues, the cause a stop is settled
with, on text captured from Slurm 22.05 and fake Slurm calls. Its parts have files of their own:
test_departure, test_holds, test_ending, test_ledger (and test_drain, test_grace)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from slurm_fake import FakeSlurm, Reply, mocked_slurm
from slurm_fake import array_slot as slot

from hpc_elastic import events
from hpc_elastic.agent import command
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.cli import app
from hpc_elastic.ops import cancel
from hpc_elastic.ops.jobs import JobRecord
from hpc_elastic.slurm import commands, task
from hpc_elastic.slurm.commands import JobStatus
from hpc_elastic.slurm.departure import Departure
from hpc_elastic.slurm.elastic import ElasticSlot
from hpc_elastic.slurm.ledger import Arrival, SlotLedger, SlotLimits, load_ledger

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


@pytest.fixture
def slurm() -> Iterator[FakeSlurm]:
    """squeue answers AFTER_PREEMPTION, ``scontrol show job`` a preempted job; scancel,
    ``scontrol requeue`` and ``scontrol update`` succeed (``acts`` lists them)."""
    with mocked_slurm() as fake:
        fake.answer("squeue", stdout=AFTER_PREEMPTION)
        fake.answer(
            "scontrol",
            "-o",
            "show",
            "job",
            stdout=RUNNING_JOB.format(
                state="RUNNING", limit="UNLIMITED", preempt="2026-11-29T10:01:10"
            ),
        )
        fake.answer("scancel")
        fake.answer("scontrol", "requeue")
        fake.answer("scontrol", "update")
        yield fake


def acts(fake: FakeSlurm) -> list[list[str]]:
    """The Slurm calls that change something, in order: every scancel and every scontrol but
    ``scontrol -o show`` (a question)."""
    return [
        argv
        for argv in fake.calls
        if argv[0] == "scancel" or (argv[0] == "scontrol" and argv[1] != "-o")
    ]


REQUEUE = ["scontrol", "requeue", "9_2"]
EXCLUDE = ["scontrol", "update", "JobId=9_2", "ExcNodeList=n3"]


def test_only_array_tasks_are_elastic_slots(tmp_path: Path) -> None:
    plain = {"SLURM_JOB_ID": "4", "SLURMD_NODENAME": "n1"}
    assert ElasticSlot.from_env(plain, tmp_path, SlotLimits()) is None
    task = {**plain, "SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "2"}
    assert ElasticSlot.from_env(task, tmp_path, SlotLimits()) is not None


def test_a_preempted_slot_is_requeued_and_says_why(tmp_path: Path, slurm: FakeSlurm) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    code = slot(tmp_path).settle(75, 30.0, lambda kind, **details: said.append((kind, details)))
    assert code == 75
    assert acts(slurm) == [REQUEUE]
    evidence = {
        "JobState": "RUNNING",
        "PreemptTime": "2026-11-29T10:01:10",
        "RunTime": "00:01:10",
        "TimeLimit": "UNLIMITED",
        "asked": "after the drain",
    }
    assert said == [
        (
            "requeue",
            {"cause": "preemption", "slurm": evidence, "slurm_job": "9_2", "excluded": []},
        )
    ]
    assert load_ledger(tmp_path / "slots" / "2.json").preemptions == 1


@pytest.mark.parametrize(("restarts", "requeued"), [("1", True), ("0", False)])
def test_a_requeue_that_kills_its_own_scontrol_counts_when_slurm_did_it(
    tmp_path: Path,
    slurm: FakeSlurm,
    restarts: str,
    requeued: bool,
) -> None:
    """The requeue signals every process of the step, the scontrol that asked for it too."""
    slurm.answer("scontrol", "requeue", returncode=1)  # killed: it says nothing
    record = (
        RUNNING_JOB.format(state="RUNNING", limit="UNLIMITED", preempt="2026-11-29T10:01:10")
        .strip()
        .replace("NodeList=n3", f"Restarts={restarts} NodeList=n3")
    )
    slurm.answer("scontrol", "-o", "show", "job", stdout=record)
    said: list[str] = []
    code = slot(tmp_path).settle(75, 30.0, lambda kind, **details: said.append(kind))
    assert acts(slurm) == [REQUEUE]
    assert (code, said) == ((75, ["requeue"]) if requeued else (1, ["leave"]))


def test_a_slot_over_its_preemption_limit_is_not_requeued(tmp_path: Path, slurm: FakeSlurm) -> None:
    said: list[str] = []
    code = slot(tmp_path, limits=SlotLimits(max_preemptions=0)).settle(
        75, 30.0, lambda kind, **details: said.append(f"{kind} {details}")
    )
    assert code == 1
    assert acts(slurm) == []
    assert "preempted 1 times (--max-preemptions 0)" in said[0]


def test_a_node_that_fails_the_slot_twice_is_excluded(tmp_path: Path, slurm: FakeSlurm) -> None:
    first = slot(tmp_path)
    first.arrive()
    assert not first.count_failure()
    assert first.count_failure()
    said: list[str] = []
    assert first.settle(75, 30.0, lambda kind, **details: said.append(kind)) == 75
    assert acts(slurm) == [REQUEUE, EXCLUDE]
    assert said == ["exclude", "requeue"]


@pytest.mark.parametrize(("shown", "tries"), [("n3", 1), ("(null)", 3)])
def test_an_exclusion_that_dies_after_the_requeue_is_tried_again_and_never_loses_the_slot(
    tmp_path: Path, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch, shown: str, tries: int
) -> None:
    """The soak's requeued task came back, yet its agent said "not requeued" and exited 1:
    the ``scontrol update`` that sets ``ExcNodeList`` died as the requeue's own may. A try
    whose effect Slurm shows is done; else the slot is requeued all the same, with a warning."""
    slurm.answer("scontrol", "update", returncode=1)  # killed: it says nothing
    record = (
        RUNNING_JOB.format(state="PENDING", limit="UNLIMITED", preempt="2026-11-29T10:01:10")
        .strip()
        .replace("NodeList=n3", f"ExcNodeList={shown} NodeList=n3")
    )
    slurm.answer("scontrol", "-o", "show", "job", stdout=record)
    monkeypatch.setattr(task, "SCONTROL_PAUSE", 0.0)
    first = slot(tmp_path)
    first.arrive()
    first.count_failure()
    first.count_failure()
    said: list[tuple[str, dict[str, object]]] = []
    assert first.settle(75, 30.0, lambda kind, **details: said.append((kind, details))) == 75
    assert acts(slurm) == [REQUEUE] + [EXCLUDE] * tries
    kinds = [kind for kind, _ in said]
    if tries == 1:
        assert kinds == ["exclude", "requeue"]
    else:
        assert kinds == ["exclude", "warning", "requeue"]
        assert "requeued without keeping away from n3" in str(said[1][1]["message"])


def test_an_incarnation_that_died_with_its_node_counts_as_a_failure(tmp_path: Path) -> None:
    slot(tmp_path, "n4").arrive()
    again = slot(tmp_path, "n1")
    assert again.arrive().node_failure == "n4"
    again.leave()
    assert slot(tmp_path, "n2").arrive() == Arrival()
    assert load_ledger(again.ledger_path).node_failures == {"n4": 1}


@pytest.mark.parametrize("later", ["RUNNING", "PENDING"], ids=["preempt-time-gone", "requeued"])
def test_the_cause_is_what_slurm_said_when_the_signal_arrived(
    tmp_path: Path, slurm: FakeSlurm, later: str
) -> None:
    """After the drain Slurm may have moved on (no PreemptTime, or requeued already): the
    cause it gave when the signal arrived is the one that counts."""
    answers = [
        RUNNING_JOB.format(state="RUNNING", limit="UNLIMITED", preempt="2026-11-29T10:01:10"),
        RUNNING_JOB.format(state=later, limit="UNLIMITED", preempt="None"),
    ]
    slurm.respond("scontrol", "-o", "show", "job", responder=lambda argv: Reply(answers.pop(0)))
    preempted = slot(tmp_path)
    preempted.arrive()
    watch = preempted.departure.watch(30.0)
    watch.signalled(12)
    assert watch.answer(30.0) is not None
    said: list[tuple[str, object, object]] = []
    assert (
        preempted.settle(
            75, 30.0, lambda kind, **d: said.append((kind, d.get("cause"), d["slurm"]["asked"]))
        )
        == 75
    )
    assert said == [("requeue", "preemption", "at the signal")]
    assert acts(slurm) == [REQUEUE]


def test_a_slurm_too_busy_to_answer_at_the_signal_is_asked_again(
    tmp_path: Path, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slurmctld, busy with the very preemption, may drop a request: retry, then settle asks."""
    busy_slurm = Reply(
        stderr="slurm_load_jobs error: Socket timed out on send/recv operation\n", returncode=1
    )
    preempted = Reply(
        RUNNING_JOB.format(state="RUNNING", limit="UNLIMITED", preempt="2026-11-29T10:01:10")
    )
    answers = [busy_slurm, busy_slurm, busy_slurm, busy_slurm, preempted]
    slurm.respond("scontrol", "-o", "show", "job", responder=lambda argv: answers.pop(0))
    monkeypatch.setattr(task, "SCONTROL_PAUSE", 0.0)
    busy = slot(tmp_path)
    watch = busy.departure.watch(30.0)
    watch.signalled(12)
    assert watch.answer(30.0) is None, "three failed tries at the signal give no answer"
    said: list[tuple[str, object, object]] = []
    code = busy.settle(
        75, 30.0, lambda kind, **d: said.append((kind, d.get("cause"), d["slurm"]["asked"]))
    )
    assert code == 75
    assert said == [("requeue", "preemption", "after the drain")]


def test_without_a_signal_slurm_is_asked_when_the_slot_settles(
    tmp_path: Path, slurm: FakeSlurm
) -> None:
    """Workers that stopped by themselves (exit 75), or the bad-node watch, send no signal."""
    quiet = slot(tmp_path)
    quiet.departure.watch(30.0)
    said: list[tuple[str, object]] = []
    assert quiet.settle(75, 30.0, lambda kind, **d: said.append((kind, d.get("cause")))) == 75
    assert said == [("requeue", "preemption")]


def test_a_preemption_noted_at_the_signal_survives_slurms_sigkill(
    tmp_path: Path, slurm: FakeSlurm
) -> None:
    """The watch notes the cause in the ledger as soon as Slurm answers, before any drain."""
    first = slot(tmp_path, "n4")
    first.arrive()
    watch = first.departure.watch(30.0)
    watch.signalled(12)
    assert watch.answer(30.0) is not None
    # SIGKILLed here, after GraceTime: neither requeue() nor leave() ran.
    arrival = slot(tmp_path, "n1").arrive()
    assert arrival == Arrival(crashed_on="n4", killed_leaving=Departure.PREEMPTION)
    assert load_ledger(first.ledger_path).preemptions == 1


def test_when_the_job_is_over_pending_slots_are_cancelled(tmp_path: Path, slurm: FakeSlurm) -> None:
    said: list[tuple[str, dict[str, object]]] = []
    assert slot(tmp_path).settle(0, 30.0, lambda kind, **d: said.append((kind, d))) == 0
    assert acts(slurm) == [["scancel", "9_[1,3]"]]
    assert said == [("cancel_pending", {"tasks": [1, 3], "running": []})]


def test_a_stopped_slot_cancels_nothing(tmp_path: Path, slurm: FakeSlurm) -> None:
    assert slot(tmp_path).settle(143, 30.0, lambda kind, **d: None) == 143
    assert acts(slurm) == []


def test_a_slot_that_lost_zookeeper_for_good_is_neither_requeued_nor_ends_the_job(
    tmp_path: Path, slurm: FakeSlurm
) -> None:
    """Exit 69 (``--zk-outage-limit``): a requeue would only join the same dead ensemble, and
    a partition of this node alone looks the same, so the job is left to the others."""
    said: list[str] = []
    code = slot(tmp_path).settle(ExitCode.UNREACHABLE, 30.0, lambda kind, **d: said.append(kind))
    assert code == ExitCode.UNREACHABLE
    assert acts(slurm) == [], "no scontrol requeue, no scancel of the pending tasks"
    assert said == []


@pytest.mark.parametrize("text", ["{not json", "[]", '{"preemptions": "x"}', "\udcff"])
def test_an_unreadable_ledger_starts_the_slot_afresh_with_a_warning(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "slots" / "2.json"
    path.parent.mkdir()
    path.write_text(text, errors="surrogateescape")
    fresh = slot(tmp_path)
    assert fresh.ledger == SlotLedger()
    assert fresh.problem is not None
    assert f"'{path}' is not a readable slot record" in fresh.problem
    assert fresh.arrive() == Arrival()
    assert load_ledger(path) == SlotLedger(running_on="n3")


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


def test_pending_slots_already_gone_are_no_error(tmp_path: Path, slurm: FakeSlurm) -> None:
    slurm.answer(
        "scancel",
        stderr="scancel: error: Kill job error on job id 9_[1,3]: Job has already finished\n",
        returncode=1,
    )
    assert slot(tmp_path).settle(0, 30.0, lambda kind, **d: None) == 0
    assert acts(slurm) == [["scancel", "9_[1,3]"]]


def test_a_cancelled_slot_is_not_requeued(tmp_path: Path, slurm: FakeSlurm) -> None:
    """scancel sends SIGTERM, which the workers also answer by saving and exiting 75."""
    cancelled = RUNNING_JOB.format(state="CANCELLED", limit="UNLIMITED", preempt="None")
    slurm.answer("scontrol", "-o", "show", "job", stdout=cancelled)
    said: list[tuple[str, object]] = []
    assert slot(tmp_path).settle(75, 30.0, lambda kind, **d: said.append((kind, d))) == 75
    assert acts(slurm) == []
    [(kind, details)] = said
    assert kind == "cancelled"
    assert details["slurm"]["JobState"] == "CANCELLED"  # type: ignore[index]


def test_an_unreadable_ledger_is_a_warning_event_and_the_agent_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "slots" / "2.json"
    path.parent.mkdir()
    path.write_text("{not json")
    spec = AgentSpec(job_dir=tmp_path, command=("train",))
    command._arrive(slot(tmp_path), spec, "run-1")
    [warning] = [event for event in events.read(spec.events_file) if event.kind == "warning"]
    assert f"'{path}' is not a readable slot record" in str(warning.details["message"])
    assert load_ledger(path).running_on == "n3"


# --- hot spares (submit --spares) -------------------------------------------------------------


def _rendered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> str:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPC_ELASTIC_ZK", raising=False)
    (tmp_path / "train.py").write_text("print('training')\n")
    result = CliRunner().invoke(app, ["render", *flags, "train.py"])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_spares_add_array_slots_beyond_max_and_make_a_fixed_job_an_array(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _rendered(tmp_path, monkeypatch, "--nodes", "2", "--spares", "1")
    assert "#SBATCH --array=0-2\n" in script
    assert "--no-kill" not in script
    assert "--nodes 2:2 \\\n" in script, "a fixed job with spares starts at N, not at 1"
    elastic_job = _rendered(tmp_path, monkeypatch, "--nodes", "1:4", "--spares", "2")
    assert "#SBATCH --array=0-5\n" in elastic_job
    assert "--nodes 1:4 \\\n" in elastic_job


def test_no_spares_leave_the_script_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "--no-kill" in _rendered(tmp_path, monkeypatch, "--nodes", "2", "--spares", "0")
    assert "#SBATCH --array=0-3\n" in _rendered(tmp_path, monkeypatch, "--nodes", "1:4")


def test_negative_spares_are_refused_in_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('training')\n")
    result = CliRunner().invoke(app, ["render", "--spares", "-1", "train.py"])
    assert result.exit_code != 0
    assert "--spares '-1'" in result.output
    assert "Traceback" not in result.output
