"""Saves and the hang detector (agent/watchdog.py's checkpoint phase).

The save phase learns its own deadline from the saves it saw, as the steps do theirs: a save
is timed from the rank's checkpoint mark to the step it writes back, and that duration is a
checkpoint sample, never a step's. First the rule, with the real ``RankWatch`` on plain
numbers; then real agents and workers on the in-memory rendezvous: a save far longer than the
learned step deadline is never taken for a hang, and a save that hangs is reported as a hang
in a save, by the deadline learned from the saves before it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from test_agent_watchdog import QUICK, run_agents

from hpc_elastic.agent.api import ExitCode
from hpc_elastic.agent.hangs import Suspicion
from hpc_elastic.agent.watchdog import (
    DEFAULT_RULES,
    DeadlineRule,
    Deadlines,
    Phase,
    RankWatch,
    Stragglers,
    Verdict,
)

SLOW_SAVE = Path(__file__).parents[1] / "workloads" / "slow_save.py"
STEP_FLOOR = DEFAULT_RULES[Phase.STEP].floor
SAVE_FLOOR = DEFAULT_RULES[Phase.CHECKPOINT].floor
SAVE_INITIAL = DEFAULT_RULES[Phase.CHECKPOINT].initial


class Rank0:
    """One rank that steps once a second and saves when told, polled as the agent polls it:
    between its writes, and with its CPU seconds so far (``ran``)."""

    def __init__(self) -> None:
        self.watch = RankWatch(Deadlines(), Stragglers(), started=0.0)
        self.now = 0.0
        self.step = 0
        self.cpu = 0.0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.now += 1.0
            self.step += 1
            self.cpu += 0.5
            assert self.poll(self.now + 0.1).hung == []

    def save(self, seconds: float, cpu: float = 1.0) -> None:
        """A save that takes ``seconds`` (and ``cpu`` CPU seconds), looked at in its middle."""
        marked = self.now + 0.5
        assert self.poll(marked + 0.1, saving=True, at=marked).hung == []
        self.cpu += cpu
        assert self.poll(marked + seconds / 2, saving=True, at=marked).hung == []
        self.now = marked + seconds
        assert self.poll(self.now + 0.1).hung == []

    def poll(self, when: float, saving: bool = False, at: float | None = None) -> Verdict:
        reading = (self.now if at is None else at, self.step)
        return self.watch.poll(when, {0: reading}, ran={0: self.cpu}, saving={0} if saving else ())


def test_a_save_is_learned_as_the_checkpoint_phase_and_never_as_a_step() -> None:
    rank = Rank0()
    rank.train(10)
    rank.save(40.0)
    rank.train(10)
    rank.save(50.0)
    rank.train(10)
    deadlines = rank.watch.deadlines
    assert deadlines.samples(Phase.CHECKPOINT) == [40.0, 50.0]
    assert max(deadlines.samples(Phase.STEP)) <= 1.0, deadlines.samples(Phase.STEP)
    assert deadlines.deadline(Phase.CHECKPOINT) == 250.0  # the longest of two saves, times 5
    assert deadlines.deadline(Phase.STEP) == STEP_FLOOR


def test_saves_among_many_steps_never_raise_the_step_deadline() -> None:
    """A save every 50 steps is 2 % of the heartbeat's gaps: counted as steps, their length
    was the 99th percentile, and the step deadline five saves long."""
    rank = Rank0()
    for _ in range(6):
        rank.train(50)
        rank.save(40.0)
    assert rank.watch.deadlines.deadline(Phase.STEP) == STEP_FLOOR
    assert rank.watch.deadlines.deadline(Phase.CHECKPOINT) == 200.0


def test_a_long_save_is_timed_by_the_learned_save_deadline_and_a_longer_one_is_a_hang() -> None:
    rank = Rank0()
    rank.train(10)
    rank.save(40.0)
    rank.train(10)
    rank.save(50.0)
    rank.train(10)
    marked = rank.now + 0.5
    # Far past the step deadline (60 s), within the save deadline (250 s): not a hang.
    assert rank.poll(marked + 240.0, saving=True, at=marked).hung == []
    [hung] = rank.poll(marked + 260.0, saving=True, at=marked).hung
    assert (hung.rank, hung.phase, hung.deadline) == (0, Phase.CHECKPOINT, 250.0)
    assert hung.sentence(overridden=False) == (
        "Rank 0 hung in a checkpoint save: no progress for 260.0 s while saving (learned save "
        "deadline 250.0 s)."
    )


def test_saves_longer_than_the_initial_save_deadline_are_learned_and_never_a_hang() -> None:
    """Two saves of a quarter hour each, within the generous initial deadline (half an hour),
    teach a deadline of more than an hour: a third save of 40 minutes is not a hang."""
    rank = Rank0()
    rank.train(10)
    rank.save(900.0)
    rank.train(10)
    rank.save(1000.0)
    rank.train(10)
    assert rank.watch.deadlines.deadline(Phase.CHECKPOINT) == 5000.0 > SAVE_INITIAL
    marked = rank.now + 0.5
    assert rank.poll(marked + 2400.0, saving=True, at=marked).hung == []


def test_short_saves_keep_the_save_floor() -> None:
    rank = Rank0()
    for _ in range(3):
        rank.train(10)
        rank.save(2.0)
    assert rank.watch.deadlines.samples(Phase.CHECKPOINT) == [2.0, 2.0, 2.0]
    assert rank.watch.deadlines.deadline(Phase.CHECKPOINT) == SAVE_FLOOR


def test_the_cpu_a_save_used_is_no_spin_once_the_save_is_over() -> None:
    """A save serialises on the CPU; the wait after it counts the CPU from its end, so a rank
    that then sleeps in a collective does not look like a rank that spins."""
    rank = Rank0()
    rank.train(10)
    rank.save(40.0, cpu=30.0)
    wait = rank.poll(rank.now + 30.0).waits[0]
    assert wait.cpu == 0.0
    assert wait.cpu_per_step == 0.5, "the save's CPU is not a step's"


def test_a_peer_that_waits_for_a_saving_rank_is_timed_by_the_save_deadline() -> None:
    watch = RankWatch(Deadlines(), Stragglers(), started=0.0)
    for second in range(1, 11):
        watch.poll(second + 0.1, {0: (float(second), second), 1: (float(second), second)})
    # Rank 0 saves (a rank-0 checkpoint); rank 1 waits for it and does not beat either.
    readings = {0: (10.5, 10), 1: (10.0, 10)}
    later = 10.5 + SAVE_INITIAL / 2
    assert watch.poll(later, readings, saving={0}).hung == []
    hung = watch.poll(later, readings).hung
    assert [(h.rank, h.phase) for h in hung] == [(0, Phase.STEP), (1, Phase.STEP)], "unsaved"


def test_a_hang_caught_in_a_save_says_so_in_its_own_words() -> None:
    assert Suspicion(0, "checkpoint", 312.0, 250.0).clause() == (
        "the job hung in a checkpoint save: no progress for 312.0 s while saving (learned save "
        "deadline 250.0 s)"
    )
    assert (
        Suspicion(0, "checkpoint", 312.0, 300.0, overridden=True)
        .clause()
        .endswith("while saving (--hang-timeout 300.0 s)")
    )
    assert Suspicion(0, "step", 61.0, 60.0).clause() == (
        "the job made no progress for 61.0 s in step (learned deadline 60.0 s)"
    )


# --- real agents and workers ------------------------------------------------------------------


def test_a_save_far_longer_than_a_step_is_never_killed_as_a_hang(tmp_path: Path) -> None:
    # Steps of 0.2 s learn a step deadline of about a second (floor 0.5 s); each save takes
    # 6 s, while the heartbeat says "checkpoint" and the checkpoint phase's deadline applies.
    command = (sys.executable, str(SLOW_SAVE), "--steps=24", "--every=8")
    job, codes, _, recorded = run_agents(
        tmp_path,
        (*command, "--step-seconds=0.2", "--save-seconds=6"),
        rules=QUICK,
        nproc=1,
        max_restarts=0,
    )
    assert codes == {0: ExitCode.SUCCESS}
    assert job.root_cause is None
    assert [event.kind for event in recorded if event.kind in ("failure", "hang")] == []


def test_a_save_that_hangs_is_reported_as_a_hang_in_a_save(tmp_path: Path) -> None:
    rules = {**QUICK, Phase.CHECKPOINT: DeadlineRule(initial=3.0, floor=0.5, min_samples=2)}
    command = (sys.executable, str(SLOW_SAVE), "--steps=24", "--every=2")
    job, codes, _, recorded = run_agents(
        tmp_path,
        (*command, "--step-seconds=0.2", "--save-seconds=600"),
        rules=rules,
        nproc=1,
        max_restarts=0,
    )
    assert codes == {0: ExitCode.FAILED}
    root = job.root_cause
    assert root is not None
    assert "the job hung in a checkpoint save: no progress for" in root.message, root.message
    assert [event.details.get("hung") for event in recorded if event.kind == "failure"] == [True]


def test_a_save_that_hangs_after_saves_were_seen_is_caught_by_their_learned_deadline(
    tmp_path: Path,
) -> None:
    """Three saves of 2 s teach the save phase a deadline of about 10 s (two would do: one
    may go unseen on a busy machine); the fourth save never ends and is caught by it.
    Unlearned, the save deadline would be the initial 600 s here, and the run would outlast
    the test."""
    rules = {**QUICK, Phase.CHECKPOINT: DeadlineRule(initial=600.0, floor=0.5, min_samples=2)}
    command = (sys.executable, str(SLOW_SAVE), "--steps=40", "--every=4", "--hang-at-save=4")
    job, codes, _, recorded = run_agents(
        tmp_path,
        (*command, "--step-seconds=0.2", "--save-seconds=2"),
        rules=rules,
        nproc=1,
        max_restarts=0,
    )
    assert codes == {0: ExitCode.FAILED}
    root = job.root_cause
    assert root is not None
    found = re.search(r"while saving \(learned save deadline ([0-9.]+) s\)", root.message)
    assert found is not None, root.message
    assert float(found.group(1)) < 600.0, "learned from the saves, not the initial deadline"
    assert [event.details.get("hung") for event in recorded if event.kind == "failure"] == [True]
