"""The watcher outside the job (ops/watch.py): its rules on plain values, its memory, and its
scrontab entry with Slurm faked at its one subprocess call."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from slurm_fake import Reply, mocked_slurm

from hpc_elastic import jobdir
from hpc_elastic.commands import watch as command
from hpc_elastic.errors import SlurmError
from hpc_elastic.jobdir import JobRecord
from hpc_elastic.ops import watch

LIMITS = watch.Thresholds(dead_after=600.0, heartbeat_after=300.0, min_goodput=0.5)


def record(tmp_path: Path) -> JobRecord:
    return JobRecord(
        run_id="train-1",
        job_dir=tmp_path,
        job_id="9",
        local=False,
        zk="127.0.0.1:2181",
        nodes="1:2",
        nproc_per_node=1,
        max_restarts=3,
    )


def run(
    tmp_path: Path, memory: dict[str, watch.JobWatch], now: float, look: watch.Look | None
) -> list[tuple[str, str]]:
    posted: list[tuple[str, str]] = []
    seen = watch.Seen(record(tmp_path), look, {} if look is None else {"stalled": look.quiet_since})
    watch.watch([seen], memory, now, LIMITS, lambda job, kind, text: posted.append((kind, text)))
    return posted


def held(quiet_since: float) -> watch.Look:
    return watch.Look(running=0, quiet_since=quiet_since, beat=None, goodput=None)


def test_a_job_with_no_slot_running_is_alerted_once_after_the_delay_and_once_when_it_recovers(
    tmp_path: Path,
) -> None:
    memory: dict[str, watch.JobWatch] = {}
    assert run(tmp_path, memory, 1300.0, held(1000.0)) == []  # quiet for 300 s of 600
    [(kind, text)] = run(tmp_path, memory, 1700.0, held(1000.0))
    assert kind == "stalled"
    assert text.startswith("no slot of the job has run for 700 s")
    assert run(tmp_path, memory, 2500.0, held(1000.0)) == [], "said once"
    back = watch.Look(running=1, quiet_since=2600.0, beat=jobdir.Beat(2600.0, 10), goodput=None)
    assert run(tmp_path, memory, 2610.0, back) == [("recovered", "stalled is over after 1610 s")]
    assert run(tmp_path, memory, 2620.0, back) == []


def test_a_condition_that_ends_before_its_delay_is_never_said(tmp_path: Path) -> None:
    memory: dict[str, watch.JobWatch] = {}
    assert run(tmp_path, memory, 1100.0, held(1000.0)) == []
    back = watch.Look(running=1, quiet_since=1100.0, beat=jobdir.Beat(1100.0, 1), goodput=None)
    assert run(tmp_path, memory, 1200.0, back) == []
    assert memory["train-1"].incidents == {}


def test_a_heartbeat_that_stops_or_a_step_that_stays_is_the_dead_mans_switch(
    tmp_path: Path,
) -> None:
    memory: dict[str, watch.JobWatch] = {}

    def running(beat_at: float, step: int) -> watch.Look:
        return watch.Look(running=2, quiet_since=0.0, beat=jobdir.Beat(beat_at, step), goodput=None)

    assert run(tmp_path, memory, 1000.0, running(995.0, 10)) == []
    assert run(tmp_path, memory, 1200.0, running(1195.0, 11)) == []
    [(kind, text)] = run(tmp_path, memory, 1600.0, running(1595.0, 11))
    assert (kind, text) == (
        "heartbeat",
        "the job's step has stayed at 11 for 400 s while its slots run",
    )
    assert run(tmp_path, memory, 1700.0, running(1695.0, 12)) == [
        ("recovered", "heartbeat is over after 100 s")
    ]
    [(kind, text)] = run(tmp_path, memory, 2100.0, running(1695.0, 12))
    assert kind == "heartbeat"
    assert "heartbeat stopped 405 s ago" in text


def test_a_job_just_released_from_a_hold_is_no_dead_man(tmp_path: Path) -> None:
    memory: dict[str, watch.JobWatch] = {}
    run(tmp_path, memory, 5000.0, held(1000.0))  # long held, alerted
    released = watch.Look(running=1, quiet_since=1000.0, beat=None, goodput=None)
    assert [kind for kind, _ in run(tmp_path, memory, 5010.0, released)] == ["recovered"]
    assert run(tmp_path, memory, 5100.0, released) == []


def test_low_goodput_is_alerted_once(tmp_path: Path) -> None:
    memory: dict[str, watch.JobWatch] = {}
    low = watch.Look(running=1, quiet_since=0.0, beat=jobdir.Beat(100.0, None), goodput=0.3)
    [(kind, text)] = run(tmp_path, memory, 100.0, low)
    assert (kind, text.split(":")[0]) == ("goodput", "goodput is 30 %, under 50 %")
    assert run(tmp_path, memory, 110.0, low) == []


def test_a_job_that_is_over_has_its_incidents_ended_and_is_forgotten(tmp_path: Path) -> None:
    memory: dict[str, watch.JobWatch] = {}
    run(tmp_path, memory, 5000.0, held(1000.0))
    assert run(tmp_path, memory, 5100.0, None) == [("recovered", "stalled is over after 4100 s")]
    assert memory == {}


def test_the_memory_survives_a_run_and_is_private(tmp_path: Path) -> None:
    memory: dict[str, watch.JobWatch] = {}
    run(tmp_path, memory, 5000.0, held(1000.0))
    path = tmp_path / "state" / "watch.json"
    watch.save_state(path, memory)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = watch.load_state(path)
    assert again == memory
    assert run(tmp_path, again, 5100.0, held(1000.0)) == [], "not said again by the next run"
    path.write_text("not json")
    assert watch.load_state(path) == {}


def test_the_job_heartbeat_is_read_back_and_garbage_is_none(tmp_path: Path) -> None:
    jobdir.write_beat(tmp_path, 1234.5, 77, "0")
    assert jobdir.read_beat(tmp_path) == jobdir.Beat(1234.5, 77)
    (tmp_path / jobdir.BEAT_FILE).write_text('{"at": "soon"}')
    assert jobdir.read_beat(tmp_path) is None


def test_install_writes_one_scrontab_entry_and_uninstall_removes_only_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    written: list[str] = []

    def keep(argv: list[str]) -> Reply:
        written.append(Path(argv[1]).read_text())
        return Reply()

    monkeypatch.chdir(tmp_path)
    mine = "0 * * * * echo mine\n"
    with mocked_slurm() as fake:
        fake.install("scrontab")
        fake.answer("scrontab", "-l", stdout=mine)
        fake.respond("scrontab", responder=keep)  # `scrontab FILE`; `-l` answers as told
        command._scrontab(True, 5, ["watch", "--install", "--every", "5", "--dead-after", "60"])
        fake.answer("scrontab", "-l", stdout=written[-1])
        command._scrontab(True, 5, ["watch", "--install"])
        fake.answer("scrontab", "-l", stdout=written[-1])
        command._scrontab(False, 10, [])
    first = written[0].splitlines()
    assert first[0] == "0 * * * * echo mine"
    assert first[1] == command.BEGIN
    assert first[2] == "#SCRON --job-name=hpc-elastic-watch --time=5"
    assert first[3].startswith("*/5 * * * * cd ")
    assert first[3].endswith("-m hpc_elastic watch --dead-after 60")
    assert written[1].count(command.BEGIN) == 1, "installing again replaces the entry"
    assert written[2] == mine


def test_a_cluster_without_scrontab_is_one_sentence() -> None:
    with mocked_slurm() as fake:
        fake.install("scrontab")
        fake.answer(
            "scrontab",
            "-l",
            returncode=1,
            stderr="scrontab: error: scrontab is disabled on this cluster\n",
        )
        with pytest.raises(SlurmError, match="ask the admins for ScronParameters=enable"):
            command._scrontab(True, 10, ["watch", "--install"])
