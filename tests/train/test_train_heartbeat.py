"""The heartbeat's checkpoint mark as the agent sees it: a save longer than the learned step
deadline is timed by the checkpoint deadline, so it is not taken for a hang (issue 16)."""

from __future__ import annotations

from pathlib import Path

from test_agent_watchdog import QUICK, learned_worker, run_agents

from hpc_elastic.agent.api import ExitCode


def test_a_save_far_longer_than_the_learned_step_deadline_is_not_killed(tmp_path: Path) -> None:
    worker = learned_worker(
        tmp_path,
        """
        with beat.saving():
            time.sleep(4.0)  # the learned step deadline is about half a second
        for step in range(20, 40):
            beat.beat(step)
            time.sleep(0.05)  # a step's work
        print("saved and went on", flush=True)
        """,
    )
    job, codes, _, recorded = run_agents(tmp_path, worker, rules=QUICK)
    assert codes == {0: ExitCode.SUCCESS}
    assert job.root_cause is None
    assert [event.kind for event in recorded if event.kind == "failure"] == []


def test_a_hang_after_a_save_is_still_caught_by_the_step_deadline(tmp_path: Path) -> None:
    worker = learned_worker(
        tmp_path,
        """
        with beat.saving():
            time.sleep(0.1)  # a short save
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            time.sleep(30.0)  # the first round hangs after the save; the watchdog must kill it
        """,
    )
    job, codes, _, recorded = run_agents(tmp_path, worker, rules=QUICK)
    assert codes == {0: ExitCode.SUCCESS}
    root = job.root_cause
    assert root is not None
    assert "in step (learned deadline" in root.message
    assert [e.details["hung"] for e in recorded if e.kind == "failure"] == [True]
