"""A slot's ledger (slurm/ledger.py): its counts by cause and node, how the next incarnation
judges the last one's end, and the file a killed agent never leaves half written."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from hpc_elastic.errors import SlurmError
from hpc_elastic.slurm.departure import Departure
from hpc_elastic.slurm.ledger import Arrival, SlotLedger, SlotLimits, load_ledger, save_ledger


def test_ledger_counts_each_cause_against_its_own_limit() -> None:
    limits = SlotLimits(max_preemptions=1, max_time_limits=0)
    once = SlotLedger().requeued(Departure.PREEMPTION)
    assert once.over_limit(limits) is None
    assert "preempted 2 times" in str(once.requeued(Departure.PREEMPTION).over_limit(limits))
    assert "time limit 1 times" in str(
        SlotLedger().requeued(Departure.TIME_LIMIT).over_limit(limits)
    )


@pytest.mark.parametrize("why", [Departure.PREEMPTION, Departure.TIME_LIMIT])
def test_a_slot_killed_after_gracetime_while_leaving_is_no_node_failure(why: Departure) -> None:
    """Slurm SIGKILLs a slot still saving when GraceTime ends: its node did nothing wrong."""
    leaving = SlotLedger(running_on="n4", leaving_for=why.value)
    ledger, arrival = leaving.arrived("n1")
    assert arrival == Arrival(crashed_on="n4", killed_leaving=why)
    assert arrival.node_failure is None
    assert ledger.node_failures == {}
    assert ledger == replace(SlotLedger().requeued(why), running_on="n1")


def test_a_slot_that_died_while_running_is_a_node_failure() -> None:
    ledger, arrival = SlotLedger(running_on="n4").arrived("n1")
    assert arrival.node_failure == "n4"
    assert ledger.node_failures == {"n4": 1}
    assert ledger.running_on == "n1"


def test_an_unreadable_ledger_is_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / "2.json"
    path.write_text("{not json")
    with pytest.raises(SlurmError, match="start afresh") as raised:
        load_ledger(path)
    assert f"'{path}'" in str(raised.value)


def test_the_ledger_is_on_disk_before_and_after_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync the new record, rename it over the old one, fsync the directory that holds it."""
    steps: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        steps.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        steps.append(("rename", str(target)))
        rename(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    path = tmp_path / "slots" / "2.json"
    save_ledger(path, SlotLedger(preemptions=3))
    [(first, scratch), second, third] = steps
    assert first == "fsync"
    assert Path(scratch).parent == path.parent
    assert scratch != str(path)
    assert [second, third] == [("rename", str(path)), ("fsync", str(path.parent))]
    assert load_ledger(path) == SlotLedger(preemptions=3)
