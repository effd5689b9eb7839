"""A caught hang explains itself (issue 16 §3): faulthandler's stack dump, read back into the
root-cause line, and the NCCL flight-recorder defaults in every worker's environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from cluster import wait_until

from hpc_elastic.agent import rootcause
from hpc_elastic.agent.api import AgentSpec
from hpc_elastic.agent.standby import hand_off, standby_command
from hpc_elastic.agent.workers import (
    NCCL_TRACE_ENTRIES,
    Worker,
    WorkerGroup,
    WorkerPaths,
    attempt_paths,
    hang_debug_defaults,
    launch,
    worker_env,
)
from hpc_elastic.jobdir import JobDir
from hpc_elastic.rendezvous.api import NodeInfo, Round

HUNG = textwrap.dedent(
    """
    import threading, time

    def heartbeat_thread():
        while True:
            time.sleep(1.0)

    def all_reduce_step():
        print("hung", flush=True)
        time.sleep(60.0)

    threading.Thread(target=heartbeat_thread, daemon=True).start()
    all_reduce_step()
    """
)
"""A worker with a second thread, hung in a function: the dump lists both threads."""


def sleeping_line() -> int:
    return HUNG.splitlines().index("    time.sleep(60.0)") + 1


def abort_when_hung(process: subprocess.Popen[bytes], log: Path) -> str:
    """SIGABRT the process once it printed that it hangs; its log afterwards."""
    try:
        assert wait_until(lambda: "hung" in log.read_text(), timeout=30.0)
        process.send_signal(signal.SIGABRT)
        assert process.wait(30.0) == -signal.SIGABRT
    finally:
        process.kill()
        process.wait()
    return log.read_text()


def dump_of_a_hung_process(tmp_path: Path, env: dict[str, str]) -> str:
    script = tmp_path / "train.py"
    script.write_text(HUNG)
    log = tmp_path / "rank_0.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(script)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    return abort_when_hung(process, log)


def test_the_root_cause_names_the_main_threads_innermost_frame_of_a_real_dump(
    tmp_path: Path,
) -> None:
    text = dump_of_a_hung_process(tmp_path, {**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert "in heartbeat_thread" in text  # the other thread is in the dump too
    assert rootcause.hung_frame(text) == f"train.py:{sleeping_line()} in all_reduce_step"
    log = tmp_path / "rank_0.log"
    sentence = rootcause.hung_sentence(3, log)
    assert sentence.startswith(f"Rank 3 hung in train.py:{sleeping_line()} in all_reduce_step")


def test_a_rank_hung_inside_a_library_is_placed_at_the_users_call_too(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(HUNG.replace("time.sleep(60.0)", "threading.Event().wait(60.0)"))
    log = tmp_path / "rank_0.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(script)],
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    where = rootcause.hung_frame(abort_when_hung(process, log))
    assert where is not None
    assert where.startswith("threading.py:")  # the standard library's wait ...
    assert where.endswith(f", called from train.py:{sleeping_line()} in all_reduce_step")


def test_only_the_last_dump_of_a_log_counts_and_what_follows_it_is_ignored() -> None:
    older = (
        "Fatal Python error: Aborted\n\n"
        "Current thread 0x1 (most recent call first):\n"
        '  File "old.py", line 1 in old\n'
    )
    newer = (
        "Fatal Python error: Aborted\n\n"
        "Thread 0x00007f80fe7dc6c0 (most recent call first):\n"
        '  File "/x/threading.py", line 982 in run\n\n'
        "Current thread 0x00007f80ff23bb80 (most recent call first):\n"
        '  File "/job/code/train.py", line 42 in all_reduce_step\n'
        '  File "/job/code/train.py", line 50 in <module>\n'
        "bash: line 1: 31763 Aborted\n"
        '  File "later.py", line 9 in unrelated\n'
    )
    assert rootcause.hung_frame(older + "step 5\n" + newer) == "train.py:42 in all_reduce_step"


def test_a_log_without_a_dump_says_so_instead_of_guessing(tmp_path: Path) -> None:
    log = tmp_path / "rank_1.log"
    log.write_text("step 1\nstep 2\n")
    assert rootcause.hung_frame(log.read_text()) is None
    assert rootcause.hung_sentence(1, log) == (
        f"Rank 1 left no stack dump in {log} (started without faulthandler?)."
    )


def test_a_prewarmed_standby_dumps_its_stacks_too(tmp_path: Path) -> None:
    """PYTHONFAULTHANDLER is read at interpreter start, long before a standby gets its rank."""
    script = tmp_path / "train.py"
    script.write_text(HUNG)
    log = tmp_path / "rank_0.log"
    log.touch()  # as the agent does before a hand-off
    argv = standby_command((sys.executable, str(script)), ("json",))
    assert argv is not None
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    process = launch(argv, environ, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert hand_off(process, {**environ, "PYTHONFAULTHANDLER": "1"}, log)
    text = abort_when_hung(process, log)
    assert rootcause.hung_frame(text) == f"train.py:{sleeping_line()} in all_reduce_step"


def test_a_hung_group_dumps_even_a_stopped_rank_and_leaves_no_process(tmp_path: Path) -> None:
    """The fault matrix hangs a rank with SIGSTOP: the SIGABRT waits until the SIGCONT."""
    script = tmp_path / "train.py"
    script.write_text(HUNG)
    paths = WorkerPaths(tmp_path / "rank_0.log", tmp_path / "error", tmp_path / "heartbeat")
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with paths.log.open("wb") as out:
        process = launch([sys.executable, str(script)], env, stdin=subprocess.DEVNULL, stdout=out)
    group = WorkerGroup([Worker(0, 0, paths, process, 0.0)])
    try:
        assert wait_until(lambda: "hung" in paths.log.read_text(), timeout=30.0)
        process.send_signal(signal.SIGSTOP)
        group.dump_stacks(30.0)
    finally:
        group.stop(0.0, signal.SIGKILL)
    assert process.returncode == -signal.SIGABRT
    text = paths.log.read_text()
    assert rootcause.hung_frame(text) == f"train.py:{sleeping_line()} in all_reduce_step"


def test_the_hang_defaults_are_set_but_never_override_the_users_values(tmp_path: Path) -> None:
    trace = tmp_path / "nccl_trace_rank_"
    assert hang_debug_defaults({}, trace) == {
        "PYTHONFAULTHANDLER": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
        "TORCH_FR_DUMP_TEMP_FILE": str(trace),
    }
    users = {"PYTHONFAULTHANDLER": "", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert set(hang_debug_defaults(users, trace)).isdisjoint(users)


def test_a_flight_recorder_setting_under_its_old_name_is_the_users_too(tmp_path: Path) -> None:
    """torch reads the new name first: ours would silently beat the user's old spelling."""
    users = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/fr_"}
    defaults = hang_debug_defaults(users, tmp_path / "nccl_trace_rank_")
    assert "TORCH_FR_BUFFER_SIZE" not in defaults
    assert "TORCH_FR_DUMP_TEMP_FILE" not in defaults


def test_every_worker_gets_the_defaults_with_its_flight_recorder_beside_its_log(
    tmp_path: Path,
) -> None:
    spec = AgentSpec(job_dir=tmp_path / "job", command=("true",))
    node = NodeInfo(node_id="n0", host="127.0.0.1", nproc=1, slot="0")
    rdzv_round = Round(1, (node,), "127.0.0.1", 29500, 0, 3)
    paths = attempt_paths(spec, tmp_path / "run", 4, 0)
    env = worker_env(
        {"TORCH_FR_BUFFER_SIZE": "50"},
        spec,
        rdzv_round,
        node=node,
        run_id="r",
        local_rank=0,
        paths=paths,
    )
    assert env["PYTHONFAULTHANDLER"] == "1"
    assert env["TORCH_FR_BUFFER_SIZE"] == "50"
    trace = Path(env["TORCH_FR_DUMP_TEMP_FILE"])
    assert trace == JobDir(spec.job_dir).nccl_trace_prefix(4)
    assert trace.parent == paths.log.parent
