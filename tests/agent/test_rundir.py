"""An agent's run directory goes with it, even when the agent was SIGKILLed."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from hpc_elastic.agent.rundir import RunDir, sweep

HOLDS = """
import signal, sys
from pathlib import Path
from hpc_elastic.agent.rundir import RunDir
print(RunDir("job1", Path(sys.argv[1])).path, flush=True)
signal.pause()  # until the test kills it
"""
"""An agent's life in one line: it makes its run directory and lives until it is killed."""


def agent_holding_a_run_dir(parent: Path) -> tuple[subprocess.Popen[str], Path]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDS, str(parent)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    return process, Path(process.stdout.readline().strip())


def test_the_next_agent_sweeps_the_run_directory_a_killed_agent_left(tmp_path: Path) -> None:
    process, left = agent_holding_a_run_dir(tmp_path)
    (left / "lease").touch()
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert left.is_dir()  # nobody could remove it
    mine = RunDir("job2", tmp_path)
    try:
        assert not left.exists()
        assert [path.name for path in tmp_path.iterdir()] == [mine.path.name]
        assert mine.path.name.startswith("hpc-elastic-job2-")
    finally:
        mine.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_live_agents_run_directory_is_never_swept(tmp_path: Path) -> None:
    process, alive = agent_holding_a_run_dir(tmp_path)
    try:
        assert sweep(tmp_path) == []
        other = RunDir("job1", tmp_path)  # a second agent of the same job on this node
        assert alive.is_dir()
        assert sweep(tmp_path) == []
        other.remove()
    finally:
        process.kill()
        process.wait()
    assert sweep(tmp_path) == [alive]


def test_a_directory_without_a_lock_is_not_ours_to_remove(tmp_path: Path) -> None:
    """An older version's run directory, or someone's file that happens to share the prefix."""
    foreign = tmp_path / "hpc-elastic-notes"
    foreign.mkdir()
    (tmp_path / "hpc-elastic-file").write_text("x")
    assert sweep(tmp_path) == []
    assert foreign.is_dir()
