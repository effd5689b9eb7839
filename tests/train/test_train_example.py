"""examples/train.py under plain torchrun: bitwise resume after SIGKILL, and 4 -> 2 -> 4 ranks.

These launch real processes (a few seconds each) but need no cluster. The same checks under
the hpc-elastic agent live with the agent's integration tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import ranks

pytestmark = pytest.mark.timeout(900)  # three torchrun launches each; slow on a busy 2-core box
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--hidden", "32", "--lr", "0.01", "--checkpoint-every", "5"]
STEP_LINE = re.compile(r"^step=(\d+) loss=(\S+) world=(\d+)$")
EXAMPLE = ROOT / "examples" / "train.py"


def torchrun_command(nproc: int, *example_args: str) -> list[str]:
    return ranks.torchrun_command(nproc, EXAMPLE, *SMALL, *example_args)


def run(command: list[str], cwd: Path) -> None:
    """Run torchrun to completion; on a hang, SIGTERM it so it takes its workers down too."""
    with subprocess.Popen(
        command, cwd=cwd, env=ranks.environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as launcher:
        try:
            output, _ = launcher.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            launcher.terminate()
            output, _ = launcher.communicate(timeout=60)
            pytest.fail(f"torchrun hung: {output.decode()[-3000:]}")
    assert launcher.returncode == 0, first_error(output.decode())


def first_error(output: str) -> str:
    """What a failed launch said: its first worker traceback (torchrun's own summary of a
    failed rank names only its exit code, and a C++ error's frames follow the message), then
    the output's end."""
    start = output.find("Traceback (most recent call last)")
    first = output[start : start + 3000] if start >= 0 else ""
    return f"{first}\n...\n{output[-3000:]}"


def losses(log: Path) -> dict[int, list[str]]:
    """Every loss each step logged, in order; a step redone after a crash appears twice."""
    seen: dict[int, list[str]] = {}
    for line in log.read_text().splitlines():
        if match := STEP_LINE.match(line):
            seen.setdefault(int(match.group(1)), []).append(match.group(2))
    return seen


def final_hash(log: Path) -> str:
    return log.read_text().split("weights_sha256=")[-1].strip()


def worker_pids(launcher: int) -> list[int]:
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    return [int(pid) for pid in children]


@contextmanager
def launched(
    nproc: int, args: list[str], cwd: Path, output: int
) -> Iterator[subprocess.Popen[bytes]]:
    """A torchrun the test interrupts; whatever happens, it is not left running."""
    launcher = subprocess.Popen(
        torchrun_command(nproc, *args),
        cwd=cwd,
        env=ranks.environment(),
        stdout=output,
        stderr=subprocess.STDOUT,
    )
    try:
        yield launcher
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(timeout=60)


def wait_for_step(log: Path, step: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if log.exists() and max(losses(log), default=0) >= step:
            return
        time.sleep(0.05)
    pytest.fail(f"run never reached step {step}")


def test_plain_torchrun_hands_its_ranks_the_store_it_already_listens_on(tmp_path: Path) -> None:
    """Every torchrun of these tests gives its ranks the rendezvous' own store, bound as it was
    opened. A port torchrun picks and lets go for rank 0 to bind seconds later can be taken
    meanwhile on a busy machine: rank 0 then fails with EADDRINUSE (``ranks.torchrun_command``)."""
    script = tmp_path / "where.py"
    script.write_text(
        "import os\n"
        "print('rank', os.environ['RANK'], 'store:', os.environ['TORCHELASTIC_USE_AGENT_STORE'],"
        " os.environ['MASTER_PORT'])\n"
    )
    output = ranks.torchrun_ok(script, cwd=tmp_path)
    seen = ranks.lines(output, "store")  # "<uses torchrun's store> <port>", a line a rank
    assert len(seen) == 2, seen
    assert len(set(seen)) == 1, seen
    assert seen[0].startswith("True "), seen


@pytest.mark.parametrize("asynchronous", ["0", "1"], ids=["synchronous", "asynchronous"])
def test_sigkilled_run_resumes_bitwise_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: str
) -> None:
    monkeypatch.setenv("HPC_ELASTIC_CHECKPOINT_ASYNC", asynchronous)  # every run's workers
    common = ["--steps", "50", "--batch-size", "16", "--micro-batch-size", "8"]
    common += ["--dataset-size", "320"]
    sigkill_and_compare(tmp_path, common)


def test_sigkilled_run_reading_shards_through_a_stateful_loader_resumes_bitwise_identical(
    tmp_path: Path,
) -> None:
    """The same with ElasticShards read by torchdata's StatefulDataLoader (two workers a rank)
    in place of the sampler: the loader's state, workers included, is what resumes. The kill
    comes two steps into the second epoch, whose first step is the last checkpoint's."""
    common = ["--steps", "50", "--batch-size", "16", "--micro-batch-size", "8"]
    common += ["--dataset-size", "320", "--data", "shards", "--loader", "stateful"]
    common += ["--num-workers", "2", "--lanes", "8"]
    sigkill_and_compare(tmp_path, common)


def sigkill_and_compare(tmp_path: Path, common: list[str]) -> None:
    """Run A trains 50 steps; run B is SIGKILLed at step 22 (last checkpoint: 20) and run
    again: every loss of B, the redone steps included, and the final weights equal A's."""
    run(torchrun_command(2, *common, "--checkpoint-dir", "a", "--log-file", "a.log"), tmp_path)

    log_b = tmp_path / "b.log"
    args_b = [*common, "--checkpoint-dir", "b", "--log-file", "b.log", "--sleep-per-step", "0.2"]
    with launched(2, args_b, tmp_path, subprocess.DEVNULL) as launcher:
        wait_for_step(log_b, 22, launcher)
        for pid in worker_pids(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        assert launcher.wait(timeout=60) != 0
    run(torchrun_command(2, *args_b), tmp_path)

    expected, resumed = losses(tmp_path / "a.log"), losses(log_b)
    assert sorted(expected) == sorted(resumed) == list(range(1, 51))
    assert any(len(values) > 1 for values in resumed.values()), "no step was redone"
    for step, values in resumed.items():
        assert set(values) == set(expected[step]), f"step {step} differs"
    assert final_hash(tmp_path / "a.log") == final_hash(log_b)


def test_three_ranks_stopped_and_resumed_end_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    """At three ranks the order in which an all-reduce sums the ranks' gradients depends on
    where each gradient sits in DDP's bucket; two ranks sum the same either way. So the first
    step after a restart must reduce with the same bucket layout as every other step."""
    common = ["--steps", "15", "--batch-size", "12", "--micro-batch-size", "8"]
    common += ["--dataset-size", "320"]
    run(torchrun_command(3, *common, "--checkpoint-dir", "a", "--log-file", "a.log"), tmp_path)
    resumed = [*common, "--checkpoint-dir", "b", "--log-file", "b.log"]
    run(torchrun_command(3, *resumed, "--stop-after-steps", "5"), tmp_path)
    run(torchrun_command(3, *resumed), tmp_path)

    expected, got = losses(tmp_path / "a.log"), losses(tmp_path / "b.log")
    assert sorted(got) == list(range(1, 16))
    assert {step: values[-1] for step, values in got.items()} == {
        step: values[-1] for step, values in expected.items()
    }
    assert final_hash(tmp_path / "a.log") == final_hash(tmp_path / "b.log")


def test_four_two_four_ranks_see_every_sample_once(tmp_path: Path) -> None:
    common = ["--steps", "20", "--batch-size", "24", "--micro-batch-size", "6"]
    common += ["--dataset-size", "480", "--log-indices", "indices.log"]
    run(torchrun_command(4, *common, "--stop-after-steps", "7"), tmp_path)
    run(torchrun_command(2, *common, "--stop-after-steps", "6", "--num-workers", "1"), tmp_path)
    run(torchrun_command(4, *common), tmp_path)

    per_step: dict[int, list[int]] = {}
    worlds: dict[int, int] = {}
    for line in (tmp_path / "indices.log").read_text().splitlines():
        step, _, world, _, indices = line.split(" ")
        number = int(step.removeprefix("step="))
        per_step.setdefault(number, []).extend(int(i) for i in indices.split(","))
        worlds[number] = int(world.removeprefix("world="))
    assert [worlds[step] for step in range(1, 21)] == [4] * 7 + [2] * 6 + [4] * 7
    assert all(len(indices) == 24 for indices in per_step.values())
    counts = Counter(index for indices in per_step.values() for index in indices)
    assert sorted(counts) == list(range(480))
    assert set(counts.values()) == {1}


def test_preempted_rank_stops_all_ranks_with_a_checkpoint(tmp_path: Path) -> None:
    args = ["--steps", "30", "--batch-size", "16", "--micro-batch-size", "8"]
    args += ["--dataset-size", "320", "--log-file", "run.log", "--sleep-per-step", "0.2"]
    log = tmp_path / "run.log"
    with launched(2, args, tmp_path, subprocess.PIPE) as launcher:
        wait_for_step(log, 12, launcher)
        os.kill(worker_pids(launcher.pid)[-1], signal.SIGUSR1)
        output, _ = launcher.communicate(timeout=60)
    assert "exitcode  : 75" in output.decode()
    stopped_at = max(losses(log))
    assert stopped_at < 30
    assert (tmp_path / "checkpoints" / f"step-{stopped_at:08d}").is_dir()

    run(torchrun_command(2, *args), tmp_path)
    assert sorted(losses(log)) == list(range(1, 31))
