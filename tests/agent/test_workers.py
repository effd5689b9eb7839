"""Worker processes on this machine: every process a worker leaves behind is ended with it,
and no signal ever reaches a process group that is no longer the worker's."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import wait_until

from hpc_elastic.agent import workers
from hpc_elastic.agent.api import AgentSpec
from hpc_elastic.agent.workers import WorkerGroup, WorkerPaths, waits_for
from hpc_elastic.train import heartbeat

LEAVES_A_CHILD = """
import os, signal, sys, time
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(300)  # outlives its parent until the group is killed
    os._exit(0)
with open(sys.argv[1], "w") as out:
    out.write(str(child))
"""
"""A worker that succeeds at once, leaving a child (think: a dataloader) that ignores SIGTERM."""


def start(tmp_path: Path, *command: str) -> WorkerGroup:
    spec = AgentSpec(job_dir=tmp_path, command=(sys.executable, *command))
    paths = WorkerPaths(
        log=tmp_path / "rank_0.log",
        error_file=tmp_path / "error_0.json",
        heartbeat=tmp_path / "heartbeat_0",
    )
    return WorkerGroup.start(spec, [{**os.environ, "RANK": "0"}], [paths])


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie waiting for whoever adopted it to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.fixture
def child_of_worker(tmp_path: Path) -> Iterator[Path]:
    """Where the worker writes its child's pid; the child is SIGKILLed afterwards if it lives."""
    pid_file = tmp_path / "child.pid"
    yield pid_file
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_child_left_by_a_worker_that_succeeded_ends_with_the_worker(
    tmp_path: Path, child_of_worker: Path
) -> None:
    group = start(tmp_path, "-c", LEAVES_A_CHILD, str(child_of_worker))
    assert group.wait(60)
    assert [worker.returncode for worker in group.workers] == [0]
    child = int(child_of_worker.read_text())
    assert wait_until(lambda: gone(child), 30), f"the worker's child {child} outlived it"


def test_the_group_of_a_reaped_worker_is_never_signalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once reaped, the worker's pid may be reused as another process's group id."""
    group = start(tmp_path, "-c", "pass")
    assert group.wait(60)
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda pid, signum: signalled.append((pid, signum)))
    group.forward(signal.SIGTERM)
    group.stop(0.0)
    assert signalled == []


def test_a_worker_that_ignores_sigterm_is_killed_with_its_group_after_the_grace(
    tmp_path: Path, child_of_worker: Path
) -> None:
    stubborn = LEAVES_A_CHILD + "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(300)\n"
    group = start(tmp_path, "-c", stubborn, str(child_of_worker))
    assert wait_until(lambda: child_of_worker.exists() and child_of_worker.read_text() != "", 60)
    group.stop(0.5)
    assert group.workers[0].returncode == -signal.SIGKILL
    child = int(child_of_worker.read_text())
    assert wait_until(lambda: gone(child), 30), f"the worker's child {child} outlived it"


def test_a_rank_is_timed_from_its_first_heartbeat_until_it_says_its_loop_is_over(
    tmp_path: Path,
) -> None:
    """A final save, a last barrier or a slow shutdown after the loop is no hang."""
    group = start(tmp_path, "-c", "pass")
    assert group.wait(60)
    [worker] = group.workers
    beat = worker.paths.heartbeat
    assert worker.heartbeat_age(time.time()) is None, "no heartbeat yet: not timed"
    heartbeat.write(beat, 7)
    assert worker.heartbeat_age(os.stat(beat).st_mtime + 5.0) == pytest.approx(5.0)
    heartbeat.Heartbeat(beat).finish()
    assert worker.heartbeat_age(os.stat(beat).st_mtime + 5.0) is None


IGNORES_SIGTERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").close()
time.sleep(300)  # blocked, as in a collective: only SIGKILL ends it
"""
"""A rank blocked in a collective with a dead peer: SIGTERM changes nothing."""

SAVES_ON_SIGTERM = """
import os, signal, sys, time
beat, saved = sys.argv[1], sys.argv[2]
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
with open(beat + ".tmp", "w") as mark:
    mark.write("5 checkpoint\\n")  # What the training helpers' saving() writes.
os.replace(beat + ".tmp", beat)
while not stop:
    time.sleep(0.01)
time.sleep(0.5)  # the save takes a while after SIGTERM
open(saved, "w").close()
os._exit(0)
"""
"""A rank in the middle of a checkpoint (its saving marker exists) that finishes it on SIGTERM."""


def stop_in_thread(group: WorkerGroup, grace: float, peer_dead: bool) -> threading.Thread:
    thread = threading.Thread(target=group.stop, args=(grace,), kwargs={"peer_dead": peer_dead})
    thread.start()
    return thread


def test_a_stop_waits_for_a_rank_only_while_it_can_still_save() -> None:
    assert waits_for(peer_dead=False, saving=False)
    assert waits_for(peer_dead=True, saving=True)
    assert waits_for(peer_dead=False, saving=True)
    assert not waits_for(peer_dead=True, saving=False)


def test_with_a_dead_peer_a_blocked_rank_is_killed_without_waiting_out_the_grace(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    group = start(tmp_path, "-c", IGNORES_SIGTERM, str(ready))
    assert wait_until(ready.exists, 60)
    thread = stop_in_thread(group, 3600.0, peer_dead=True)
    thread.join(60)
    assert not thread.is_alive(), "the stop waited out an hour of grace for a blocked rank"
    assert [worker.returncode for worker in group.workers] == [-signal.SIGKILL]


def test_with_a_dead_peer_a_saving_rank_still_gets_its_grace(tmp_path: Path) -> None:
    beat, saved = tmp_path / "heartbeat_0", tmp_path / "saved"
    group = start(tmp_path, "-c", SAVES_ON_SIGTERM, str(beat), str(saved))
    assert group.workers[0].paths.heartbeat == beat
    assert wait_until(lambda: group.workers[0].saving, 60)
    thread = stop_in_thread(group, 3600.0, peer_dead=True)
    thread.join(120)
    assert not thread.is_alive(), "the saving rank never finished"
    assert saved.exists()  # Killed at once, it could not have written this 0.5 s into its save.


def test_a_worker_gets_the_open_files_limit_its_agent_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the agent raised its own to since (the centre of a round of thousands)."""
    monkeypatch.setattr(workers, "USER_FILES", 512)
    said = tmp_path / "files"
    code = (
        "import resource, sys\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], file=open(sys.argv[1], 'w'))"
    )
    group = start(tmp_path, "-c", code, str(said))
    assert group.wait(60)
    assert said.read_text() == "512\n"
