"""Saves and the hang detector (agent/watchdog.py's checkpoint phase), with real agents and
workers on the in-memory rendezvous: a save far longer than the learned step deadline is never
taken for a hang, and a save that hangs is reported as a hang, in the checkpoint phase."""

from __future__ import annotations

import sys
from pathlib import Path

from test_agent_watchdog import QUICK, run_agents

from hpc_elastic.agent.api import ExitCode
from hpc_elastic.agent.watchdog import DeadlineRule, Phase

SLOW_SAVE = Path(__file__).parent / "workloads" / "slow_save.py"


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


def test_a_save_that_hangs_is_reported_as_a_hang_in_the_checkpoint_phase(tmp_path: Path) -> None:
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
    assert "in checkpoint" in root.message, root.message
    assert [event.details.get("hung") for event in recorded if event.kind == "failure"] == [True]
