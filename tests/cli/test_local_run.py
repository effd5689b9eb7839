"""`hpc-elastic run` end to end: real agents as local processes, churn, and the operating
commands (status, events, logs, the metrics endpoint) read against that real run.

The workload is a torch-free stand-in (``STEPPER``) so the churn test takes seconds; one test
runs ``examples/train.py`` as a newcomer would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from cluster import free_port_block

from hpc_elastic.local import LocalRun, run_local
from hpc_elastic.spec import NodeRange

REPO = Path(__file__).resolve().parents[2]

STEPPER = """\
import os, signal, sys, time
from pathlib import Path
from hpc_elastic import events
from hpc_elastic.train.heartbeat import write

steps = int(sys.argv[1])
ckpt = Path(os.environ["HPC_ELASTIC_CHECKPOINT_DIR"]) / "step"
ckpt.parent.mkdir(parents=True, exist_ok=True)
rank = int(os.environ["RANK"])
step = int(ckpt.read_text()) if ckpt.exists() else 0
print(f"rank {rank} of {os.environ['WORLD_SIZE']} resumes at step {step}", flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
while step < steps:
    time.sleep(0.05)  # a step's work, so churn lands mid-training
    step += 1
    write(os.environ["HPC_ELASTIC_HEARTBEAT_FILE"], step)
    if rank == 0 and step % 10 == 0:
        (ckpt.parent / "tmp").write_text(str(step))
        (ckpt.parent / "tmp").replace(ckpt)
        events.emit("checkpoint", step=step)
print(f"rank {rank} done at step {step}", flush=True)
"""


def hpc_elastic(
    *args: str, cwd: Path, timeout: float = 60, env: Mapping[str, str] = os.environ
) -> subprocess.CompletedProcess[str]:
    """The CLI of this checkout, run as a user would, in ``env`` (a test cluster's, say)."""
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class Run:
    """A background ``hpc-elastic run`` in a scratch directory."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.cwd = tmp_path
        (tmp_path / "stepper.py").write_text(STEPPER)
        self.output = (tmp_path / "run.out").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hpc_elastic", "run", *args],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=self.output,
            stderr=subprocess.STDOUT,
        )

    @property
    def job_dir(self) -> Path:
        found = list((self.cwd / "hpc-elastic-runs").glob("*/job.json"))
        assert found, "the run made no job directory"
        return found[0].parent

    def events(self) -> list[dict[str, Any]]:
        found = list((self.cwd / "hpc-elastic-runs").glob("*/events.jsonl"))
        lines = found[0].read_text().splitlines() if found else []
        return [json.loads(line) for line in lines]

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if self.process.poll() is not None:
                return predicate()
            time.sleep(0.2)
        return False

    def finish(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self.output.close()

    def text(self) -> str:
        return (self.cwd / "run.out").read_text()

    def story(self) -> str:
        """What a failed run's assertion shows: its output, and the end of every agent's own
        log (an agent that exits non-zero without an event says why only there)."""
        found = list((self.cwd / "hpc-elastic-runs").glob("*/logs/agent_*.log"))
        tails = [
            f"--- {log.name}:\n" + "".join(log.read_text().splitlines(True)[-40:]) for log in found
        ]
        return "\n".join([self.text(), *tails])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(30)
        self.output.close()


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        run.stop()


def leftover_agents(job_dir: Path) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return [line for line in ps.stdout.splitlines() if str(job_dir) in line]


def assert_serves_the_job_gauges(run: Run, ports: list[int]) -> None:
    """Once a round formed, the metrics endpoint of an agent in it has every gauge the
    dashboards use. Every node's port is scraped: under churn any one node (node0 included)
    may be out of every round for as long as the test looks."""

    def scrape(port: int) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
                return str(reply.read().decode())
        except OSError:
            return ""

    def in_a_round(text: str) -> bool:
        return any(
            line.startswith("hpc_elastic_world_size{") and not line.endswith(" 0.0")
            for line in text.splitlines()
        )

    scraped: list[str] = []

    def a_member_scraped() -> bool:
        scraped[:] = [text for text in map(scrape, ports) if in_a_round(text)]
        return bool(scraped)

    assert run.wait_for(a_member_scraped, 60), run.text()
    for name in (
        "hpc_elastic_round",
        "hpc_elastic_restarts_total",
        "hpc_elastic_preemptions_total",
        "hpc_elastic_last_checkpoint_age_seconds",
        "hpc_elastic_steps_per_second",
        "hpc_elastic_goodput_ratio",
    ):
        assert name in scraped[0]


def test_churn_kills_and_adds_nodes_while_training_goes_on(tmp_path: Path, runs: list[Run]) -> None:
    port = free_port_block(3)
    run = Run(
        tmp_path,
        "--nodes=1:3",
        "--simulate-churn",
        "--churn-every=4:6",
        "--churn-downtime=4",  # longer than the 2-s last call, so a smaller round forms
        "--seed=1",
        f"--metrics-port={port}",
        "stepper.py",
        "--",
        "150",
    )
    runs.append(run)
    # `run` gives node i the port PORT+i.
    assert_serves_the_job_gauges(run, [port + node for node in range(3)])

    status = hpc_elastic("status", "--json", str(run.job_dir), cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    live = json.loads(status.stdout)
    assert live["state"] == "running"
    assert live["mode"] == "local"
    assert live["round"] >= 1

    assert run.finish(200) == 0, run.story()
    kinds = [(event["kind"], event.get("details", {})) for event in run.events()]
    kills = [d for k, d in kinds if k == "churn" and d.get("action") == "kill"]
    adds = [d for k, d in kinds if k == "churn" and d.get("action") == "add"]
    assert kills, run.text()
    assert adds, run.text()
    sizes = {d.get("world_size") for k, d in kinds if k == "round"}
    timeline = "\n".join(
        f"{event.get('time', 0):.1f} {event.get('slot')} round {event.get('round')} "
        f"{event['kind']} {event.get('details', {})}"
        for event in run.events()
    )
    assert len(sizes) >= 2, f"round sizes {sizes}; events:\n{timeline}\n{run.story()}"
    assert any(k == "done" for k, _ in kinds)
    assert "succeeded" in run.text()
    assert not leftover_agents(run.job_dir)

    done = json.loads(hpc_elastic("status", "--json", run.job_dir.name, cwd=tmp_path).stdout)
    assert done["state"] == "succeeded"
    assert done["last_checkpoint_step"] == 150
    assert done["restarts"] >= 1
    assert done["restarts_used"] == 0

    table = hpc_elastic("status", run.job_dir.name, cwd=tmp_path)
    assert "SUCCEEDED" in table.stdout
    assert "node0" in table.stdout

    # Round 1 may be superseded before rank 0's agent runs it (the other nodes join at once),
    # so the first round whose rank 0 started is the one every view must show.
    first = min(
        event["round"]
        for event in run.events()
        if event["kind"] == "start" and 0 in event["details"]["ranks"]
    )
    timeline = hpc_elastic("events", run.job_dir.name, cwd=tmp_path).stdout
    assert "simulated churn: kill node" in timeline
    assert f"round {first}: world size" in timeline
    assert "checkpoint step 150 committed" in timeline

    logs = hpc_elastic("logs", run.job_dir.name, "--rank", "0", cwd=tmp_path).stdout
    assert f"==> attempt {first}, rank 0 <==" in logs
    assert "rank 0 done at step 150" in logs
    assert logs.count("==> attempt") >= 2

    png = tmp_path / "timeline.png"
    plotted = hpc_elastic("events", run.job_dir.name, "--plot", str(png), cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    listing = hpc_elastic("list", cwd=tmp_path).stdout
    assert run.job_dir.name in listing
    assert "succeeded" in listing


def test_ctrl_c_stops_every_agent_and_worker(tmp_path: Path, runs: list[Run]) -> None:
    run = Run(tmp_path, "--nodes=2", "stepper.py", "--", "100000")
    runs.append(run)
    assert run.wait_for(lambda: any(e["kind"] == "start" for e in run.events()), 60)
    run.process.send_signal(signal.SIGINT)
    assert run.finish(60) == 130
    assert "Stopping" in run.text()
    assert not leftover_agents(run.job_dir)


def test_a_failing_script_exits_1_with_the_root_cause(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("raise SystemExit('the data is missing')\n")
    result = hpc_elastic("run", "--max-restarts=0", "bad.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stderr
    status = hpc_elastic(
        "status", "--json", str(next((tmp_path / "hpc-elastic-runs").iterdir())), cwd=tmp_path
    )
    view = json.loads(status.stdout)
    assert view["state"] == "failed"
    assert "the data is missing" in (view["last_failure"] or "")


def test_an_agent_killed_by_a_signal_is_named_with_its_signal(tmp_path: Path) -> None:
    """An agent that dies by a signal has a negative return code; the run says which agent
    and which signal, and exits as a shell would (128 + N), not with a bare "exit code 1"."""
    (tmp_path / "stepper.py").write_text(STEPPER)
    python = tmp_path / "python"  # node1's agent aborts at once; node0's runs the job alone
    python.write_text(
        f'#!/bin/sh\ncase "$*" in *"--slot node1 "*) kill -ABRT $$;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    said: list[str] = []
    run = LocalRun(
        script=tmp_path / "stepper.py",
        nodes=NodeRange(1, 2),
        script_args=("20",),
        log_dir=tmp_path / "runs",
        prewarm=False,
        python=str(python),
    )
    assert run_local(run, said.append) == 128 + signal.SIGABRT, said
    assert "(node1's agent was killed by SIGABRT)" in said[-1], said


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (["run", "--nodes=3:1", "x.py"], "--nodes '3:1'"),
        (["run", "missing.py"], "Script 'missing.py' does not exist"),
        (["run", "--simulate-churn", "--churn-every=9:1", "s.py"], "--churn-every '9:1'"),
        (["status", "nope"], "Job 'nope' is unknown"),
        (["events", "12345"], "Job '12345' is unknown"),
        (["logs", "nope"], "Job 'nope' is unknown"),
    ],
)
def test_bad_input_is_one_sentence(tmp_path: Path, args: list[str], sentence: str) -> None:
    (tmp_path / "s.py").write_text("")
    (tmp_path / "x.py").write_text("")
    result = hpc_elastic(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ")
    assert sentence in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_examples_train_runs_on_two_local_nodes(tmp_path: Path, runs: list[Run]) -> None:
    """The real DDP example under local mode; churn with it is shown in docs/local-mode.md."""
    run = Run(
        tmp_path,
        "--nodes=2",
        str(REPO / "examples" / "train.py"),
        "--",
        "--steps=60",
        "--checkpoint-every=20",
    )
    runs.append(run)
    assert run.finish(240) == 0, run.story()
    assert "round 1: world size 2" in run.text()
    assert "checkpoint step 60 committed" in run.text()
    logs = hpc_elastic("logs", run.job_dir.name, "--rank", "0", cwd=tmp_path).stdout
    assert "step=60 " in logs
    assert "world=2" in logs
    assert "done step=60" in logs


def test_in_place_reaches_the_agents_and_a_survivor_keeps_its_process(
    tmp_path: Path, runs: list[Run]
) -> None:
    """``run --in-place`` passes ``--in-place`` to every agent: when one node's worker is
    SIGKILLed, the other node's worker goes on in its own process (tests/agent/test_inplace.py has
    the same case with agents in one process)."""
    out = tmp_path / "out"
    out.mkdir()
    run = Run(
        tmp_path,
        "--nodes=2",
        "--in-place",
        "--no-prewarm",  # the kill comes mid-training either way; standbys only add load
        str(REPO / "tests" / "workloads" / "train_inplace.py"),
        "--",
        f"--out={out}",
        "--steps=40",
    )
    runs.append(run)

    def trace() -> list[list[str]]:
        path = out / "trace"
        return [line.split() for line in path.read_text().splitlines()] if path.exists() else []

    assert run.wait_for(lambda: any(int(line[1]) >= 10 for line in trace()), 180), run.text()
    pids = {line[6]: line[5] for line in trace()}  # slot -> pid of its worker (one each so far)
    os.kill(int(pids["node1"]), signal.SIGKILL)
    assert run.finish(240) == 0, run.story()

    survivors = {line[5] for line in trace() if line[6] == "node0"}
    assert survivors == {pids["node0"]}, f"node0's worker was restarted: pids {survivors}"
    kinds = [(event["kind"], event.get("slot")) for event in run.events()]
    assert ("workers_kept", "node0") in kinds
    assert ("workers_stopped", "node0") not in kinds
