"""Exact data order across world-size changes, with real ranks (gloo) and real loader workers.

- Real agents on the local-mode store, examples/train.py reading ``ElasticShards`` through
  torchdata's ``StatefulDataLoader`` with two workers per rank: 4 ranks, two nodes SIGKILLed,
  2 ranks, a node back, 3 ranks; every sample of the epoch is trained once, and
  ``hpc-elastic events JOB --data`` says so from the sample log.
- 16 token shards over 3, 1 and 4 ranks (torchrun): each sample read once, at the step the
  layout gives it, whatever the world.
- A kill in the middle of an accumulation step (2 ranks of 3 micro-batches), resumed at 3
  ranks: the step is trained from its first sample.

The expected order is computed here from the documented rule (docs/training.md, "Sharded and
streaming data"): the shards end to end, cut into lanes of ``steps * B / lanes`` samples; step
``k`` takes samples ``[k*q, (k+1)*q)`` of every lane, ``q = B / lanes``; rank ``r`` of ``W``
reads lanes ``r*L/W`` on, lane after lane.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from ranks import environment, torchrun_command

from hpc_elastic.jobdir import JobRecord
from hpc_elastic.rendezvous import local_store
from hpc_elastic.rendezvous.local_store import LocalStoreServer

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train.py"
TOKENS = REPO / "tests" / "workloads" / "train_tokens.py"


def torchrun(nproc: int, script: Path, *args: str, cwd: Path, ok: bool = True) -> str:
    result = subprocess.run(
        torchrun_command(nproc, script, *args),
        cwd=cwd,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert (result.returncode == 0) == ok, output[-3000:]
    return output


def lane_step(position: int, steps: int, batch: int, lanes: int) -> int | None:
    """The step of its epoch at which the sample at ``position`` of the layout is trained;
    None for the tail, which no step trains."""
    quota = batch // lanes
    lane_length = steps * quota
    if position >= lanes * lane_length:
        return None
    return (position % lane_length) // quota


def rank_order(
    step: int, rank: int, world: int, *, steps: int, batch: int, lanes: int
) -> list[int]:
    """The ids rank ``rank`` of ``world`` trains at ``step`` (from 0), in order, when ids are
    layout positions: its lanes one after the other, ``q`` samples each."""
    quota, lane_length, per_rank = batch // lanes, steps * batch // lanes, lanes // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    return [lane * lane_length + step * quota + i for lane in mine for i in range(quota)]


# --- 16 token shards over 3 -> 1 -> 4 ranks --------------------------------------------------


def write_token_shards(directory: Path, length: int) -> list[int]:
    """16 shards of uneven lengths; every token of sample ``k`` of shard ``i`` is
    ``1000 * i + k``, so a sample's first token says where it came from."""
    directory.mkdir()
    counts = [20 + (i * 7) % 9 for i in range(16)]
    for shard, count in enumerate(counts):
        tokens = np.repeat(np.arange(count, dtype=np.uint16) + 1000 * shard, length)
        tokens.tofile(directory / f"shard-{shard:02d}.bin")
    return counts


def test_sixteen_token_shards_over_three_one_four_ranks_are_read_once_in_their_order(
    tmp_path: Path,
) -> None:
    counts = write_token_shards(tmp_path / "shards", 8)
    batch, lanes = 24, 12
    steps = sum(counts) // batch
    common = ["--shards-dir", "shards", "--checkpoint-dir", "ck", "--read-log", "read.log"]
    torchrun(3, TOKENS, *common, "--stop-after-steps", "5", "--workers", "1", cwd=tmp_path)
    torchrun(1, TOKENS, *common, "--stop-after-steps", "4", "--workers", "2", cwd=tmp_path)
    torchrun(
        4, TOKENS, *common, "--stop-after-steps", str(steps - 9), "--workers", "0", cwd=tmp_path
    )

    firsts = np.cumsum([0, *counts[:-1]])
    trained: Counter[int] = Counter()
    worlds: dict[int, int] = {}
    for line in (tmp_path / "read.log").read_text().splitlines():
        step, rank, world, read = line.split(" ")
        worlds[int(step)] = int(world)
        ids = []
        for pair in read.split(","):
            sample_id, first_token = map(int, pair.split(":"))
            shard, offset = divmod(first_token, 1000)
            assert sample_id == firsts[shard] + offset, f"id {sample_id} holds {first_token}"
            assert lane_step(sample_id, steps, batch, lanes) == int(step) - 1
            ids.append(sample_id)
        place = (int(step) - 1, int(rank), int(world))
        assert ids == rank_order(*place, steps=steps, batch=batch, lanes=lanes)
        trained.update(ids)
    assert [worlds[s] for s in range(1, steps + 1)] == [3] * 5 + [1] * 4 + [4] * (steps - 9)
    assert set(trained.values()) == {1}
    assert sorted(trained) == list(range(steps * batch))


# --- a kill in the middle of an accumulation step -------------------------------------------


def test_a_world_size_change_in_the_middle_of_an_accumulation_step_resumes_at_its_first_sample(
    tmp_path: Path,
) -> None:
    """At 2 ranks a step is 3 micro-batches of 4; step 5's are drawn, a checkpoint is saved
    and the ranks die. At 3 ranks (2 micro-batches of 4) step 5 starts at its first sample."""
    common = ["--steps", "20", "--batch-size", "24", "--micro-batch-size", "4"]
    common += ["--dataset-size", "480", "--data", "shards", "--loader", "stateful"]
    common += ["--num-workers", "1", "--checkpoint-every", "100", "--hidden", "16"]
    common += ["--log-indices", "indices.log", "--checkpoint-dir", "ck"]
    torchrun(2, EXAMPLE, *common, "--crash-mid-step", "5", cwd=tmp_path, ok=False)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-")) == [
        "step-00000004"
    ]
    torchrun(3, EXAMPLE, *common, cwd=tmp_path)

    per_step: dict[int, dict[int, list[int]]] = {}
    for line in (tmp_path / "indices.log").read_text().splitlines():
        step, rank, world, _, indices = line.split(" ")
        number = int(step.removeprefix("step="))
        ranks = per_step.setdefault(number, {})
        ranks[int(rank.removeprefix("rank="))] = [int(i) for i in indices.split(",")]
        expected_world = 2 if number < 5 else 3
        assert world == f"world={expected_world}", line
    assert sorted(per_step) == list(range(1, 21))
    for number in range(3):
        assert per_step[5][number] == rank_order(4, number, 3, steps=20, batch=24, lanes=12)
    counts = Counter(i for ranks in per_step.values() for ids in ranks.values() for i in ids)
    assert sorted(counts) == list(range(480))
    assert set(counts.values()) == {1}


# --- agents: 4 -> 2 -> 3 ranks with a SIGKILL ----------------------------------------------


@dataclass
class Job:
    """Agents of one job as processes of their own, on a local-mode store the test serves."""

    root: Path
    address: str
    agents: dict[str, subprocess.Popen[bytes]]

    @property
    def job_dir(self) -> Path:
        return self.root / "job"

    def start(self, slot: str) -> None:
        options = {
            "run-id": "data-job",
            "job-dir": str(self.job_dir),
            "zk": self.address,
            "nodes": "2:4",
            "nproc-per-node": "1",
            "grace": "30",
            "last-call": "1",
            "slot": slot,
            "host": "127.0.0.1",
        }
        argv = [
            sys.executable,
            "-m",
            "hpc_elastic",
            "agent",
            *(f"--{key}={value}" for key, value in options.items()),
            "--no-preflight",
            "--",
            sys.executable,
            "-u",
            str(EXAMPLE),
            *WORKLOAD,
            "--log-indices",
            str(self.root / "indices.log"),
            "--slow-file",
            str(self.slow_file),
        ]
        with (self.root / f"agent-{slot}.log").open("ab") as log:
            self.agents[slot] = subprocess.Popen(
                argv,
                cwd=self.root,
                env=environment(HPC_ELASTIC_SAMPLE_LOG="1"),
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def lines(self) -> list[tuple[int, int, int, int, list[int]]]:
        """(step, rank, world, round, ids) of every index line so far."""
        path = self.root / "indices.log"
        found = []
        for line in path.read_text().splitlines() if path.exists() else []:
            words = line.split(" ")
            try:
                step, rank, world, round_ = (int(w.split("=")[1]) for w in words[:4])
                found.append((step, rank, world, round_, [int(i) for i in words[4].split(",")]))
            except (ValueError, IndexError):
                continue  # a line a SIGKILL cut short
        return found

    def wait_for(self, what: str, condition: Callable[[], bool], timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            ended = all(agent.poll() is not None for agent in self.agents.values())
            if ended or time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                    for p in sorted(self.root.glob("agent-*.log"))
                )
                pytest.fail(f"never saw {what}; the agents said:\n{logs}")
            time.sleep(0.2)

    @property
    def slow_file(self) -> Path:
        return self.root / "slow"

    def round_of(self, world: int, after: int) -> Callable[[], bool]:
        """Whether a round of ``world`` formed after one of ``after``."""

        def formed() -> bool:
            path = self.job_dir / "events.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            sizes = [
                event["details"].get("world_size")
                for event in map(json.loads, lines)
                if event["kind"] == "round"
            ]
            return after in sizes and world in sizes[sizes.index(after) :]

        return formed

    def reached(self, world: int, step: int) -> Callable[[], bool]:
        return lambda: any(w == world and s >= step for s, _, w, _, _ in self.lines())


WORKLOAD = [
    *("--steps", "20", "--batch-size", "24", "--micro-batch-size", "4", "--dataset-size", "480"),
    *("--data", "shards", "--loader", "stateful", "--num-workers", "2", "--lanes", "12"),
    *("--checkpoint-every", "3", "--sleep-per-step", "0.3", "--hidden", "16"),
]


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    socket_dir = Path(tempfile.mkdtemp(prefix="data-"))  # a unix socket's path must be short
    server = LocalStoreServer(socket_dir / "rendezvous.sock")
    server.start()
    job = Job(tmp_path, f"{local_store.SCHEME}{server.path}", {})
    job.job_dir.mkdir(mode=0o700)
    JobRecord(
        run_id="data-job",
        job_dir=job.job_dir,
        job_id=None,
        local=True,
        zk=job.address,
        nodes="2:4",
        nproc_per_node=1,
        max_restarts=3,
        runner_pid=os.getpid(),
    ).write()
    try:
        yield job
    finally:
        for agent in job.agents.values():
            if agent.poll() is None:
                agent.kill()
            agent.wait()
        server.stop()


def kept(lines: list[tuple[int, int, int, int, list[int]]]) -> dict[int, list[tuple[int, int]]]:
    """Step -> (rank, world) and ids of the last round that trained it: a round voids what
    older rounds logged from its first step on (it resumed from a checkpoint before them)."""
    first: dict[int, int] = {}
    for step, _, _, round_, _ in lines:
        first[round_] = min(first.get(round_, step), step)
    steps: dict[int, list[tuple[int, int]]] = {}
    for step, rank, world, round_, ids in lines:
        if any(later > round_ and start <= step for later, start in first.items()):
            continue
        steps.setdefault(step, []).extend((world, i) for i in ids)
        assert rank < world
    return steps


def test_a_stateful_loader_with_two_workers_goes_4_2_3_ranks_through_a_sigkill_once_per_sample(
    job: Job,
) -> None:
    for slot in ("node0", "node1", "node2", "node3"):
        job.start(slot)
    job.wait_for("step 7 at world 4", job.reached(4, 7))
    for slot in ("node2", "node3"):
        job.agents[slot].send_signal(signal.SIGKILL)  # their workers die with them
    for slot in ("node2", "node3"):
        job.agents[slot].wait()
    # Rank 0 takes 1.5 s more a step until the third round forms, so that the two ranks are
    # still training when node2 comes back, however long its agent takes to start.
    job.slow_file.write_text("0 1.5")
    job.wait_for("step 10 at world 2", job.reached(2, 10))
    job.start("node2")
    job.wait_for("a round of 3 after the round of 2", job.round_of(3, after=2))
    job.slow_file.unlink()
    for slot in ("node0", "node1", "node2"):
        assert job.agents[slot].wait(600) == 0, (job.root / f"agent-{slot}.log").read_text()[-3000:]

    lines = job.lines()
    steps = kept(lines)
    assert sorted(steps) == list(range(1, 21))
    worlds = [steps[s][0][0] for s in range(1, 21)]
    collapsed = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    assert collapsed == [4, 2, 3], worlds
    assert len(lines) > sum(w for w in worlds), "the SIGKILL lost no step: nothing was redone"
    counts = Counter(i for trained in steps.values() for _, i in trained)
    assert sorted(counts) == list(range(480))
    assert set(counts.values()) == {1}

    checked = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "events", str(job.job_dir), "--data"],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Epoch 0: 20 steps, 480 samples, each trained once." in checked.stdout
    records = [
        json.loads(line)
        for path in (job.job_dir / "samples").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert {record["world"] for record in records} == {4, 2, 3}
