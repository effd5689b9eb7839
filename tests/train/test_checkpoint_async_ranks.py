"""Asynchronous checkpoints on two real gloo ranks: resume, resharding, and failures seen by all.

One torchrun launch (a launch costs seconds on a busy machine) goes through: an asynchronous
replicated save and a sharded one, each loaded back; a background commit that fails on rank 0,
which ``should_stop()`` then raises on both ranks at the same call; a sharded commit that fails,
which ``wait()`` raises on both; and a stale round's background commit, refused on both. The
process group's timeout (120 s) is far longer than any of these needs, so a rank left waiting
would show as a timeout error, not as a line.
"""

from __future__ import annotations

import pytest
from ranks import lines, run_on_gloo_ranks

SCRIPT = """

def report(name, action):
    try:
        print(f"rank={rank} {name}: ok {action()}", flush=True)
    except CheckpointError as error:
        print(f"rank={rank} {name}: {type(error).__name__}: {error}", flush=True)
    except Exception as error:
        print(f"rank={rank} {name}: other {type(error).__name__}: {error}", flush=True)


def replicated():
    checkpointer = Checkpointer(Path("replicated"), round=None, asynchronous=True)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(3.0)
    state = elastic.TrainState(model)
    state.step = 5
    checkpointer.save(state)
    with torch.no_grad():
        model.weight.fill_(-1.0)  # after save returned: not in the checkpoint
    checkpointer.wait()
    fresh = torch.nn.Linear(4, 4)
    loaded = checkpointer.load(elastic.TrainState(fresh))
    return f"{loaded.name} {bool(torch.equal(fresh.weight, torch.full((4, 4), 3.0)))}"


def sharded(directory="sharded", value=2.0):
    checkpointer = Checkpointer(Path(directory), round=None, asynchronous=True)
    weight = distribute_tensor(torch.full((4, 2), value), mesh, [Shard(0)])
    elastic.save_sharded({"weight": weight}, 7, checkpointer=checkpointer)
    with torch.no_grad():
        weight.to_local().fill_(-1.0)
    checkpointer.wait()
    target = {"weight": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])}
    loaded = elastic.load_sharded(target, directory)
    full = target["weight"].full_tensor()
    return f"{loaded.name} {bool(torch.equal(full, torch.full((4, 2), value)))}"


def stop_raises():
    checkpointer = Checkpointer(Path("failing"), round=None, asynchronous=True)
    checkpointer.save(elastic.TrainState(torch.nn.Linear(2, 2), extras={"hook": lambda: None}))
    for call in range(100000):
        try:
            elastic.should_stop(call)
        except CheckpointError as error:
            return f"raised {type(error).__name__}: {error}"
    return "never raised"


def fail(self, *args):
    raise ValueError("simulated failure")


report("replicated", replicated)
report("sharded", sharded)
report("stop", stop_raises)
commit = Checkpointer.commit
Checkpointer.commit = fail
report("sharded-commit", lambda: sharded("sharded-failing"))
Checkpointer.commit = commit

os.environ["HPC_ELASTIC_ROUND"] = "3"
if rank == 0:
    Checkpointer(Path("fenced"), round=4).choose()  # round 4 resumed there
dist.barrier()
fenced = Checkpointer(Path("fenced"), asynchronous=True)


def stale_save():
    fenced.save(elastic.TrainState(torch.nn.Linear(2, 2)))
    fenced.wait()


report("fenced", stale_save)
del os.environ["HPC_ELASTIC_ROUND"]
report("after", lambda: sharded("sharded-after", 4.0))
"""


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> str:
    return run_on_gloo_ranks(tmp_path_factory, "async", SCRIPT)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("replicated", "ok step-00000005 True"),
        ("sharded", "ok step-00000007 True"),
        ("after", "ok step-00000007 True"),
    ],
)
def test_every_rank_resumes_what_the_asynchronous_save_copied(
    output: str, name: str, expected: str
) -> None:
    assert lines(output, name) == [expected, expected], output[-3000:]


def test_a_background_failure_on_rank_0_is_raised_by_should_stop_on_every_rank_at_once(
    output: str,
) -> None:
    seen = lines(output, "stop")
    assert len(seen) == 2, output[-3000:]
    assert seen[0] == seen[1], "the ranks raised at different calls or with different words"
    assert seen[0].startswith("ok raised CheckpointError: Could not write checkpoint step 0")


def test_a_failed_sharded_background_commit_is_raised_on_every_rank(output: str) -> None:
    seen = lines(output, "sharded-commit")
    assert len(seen) == 2, output[-3000:]
    for line in seen:
        assert line.startswith("CheckpointError: "), line
        assert "ValueError: simulated failure" in line, line


def test_a_stale_rounds_background_commit_is_refused_on_every_rank(output: str) -> None:
    seen = lines(output, "fenced")
    assert len(seen) == 2, output[-3000:]
    for line in seen:
        assert line.startswith("CheckpointFencedError: Round 3 may not "), line


def test_every_rank_carries_on_after_the_failures(output: str) -> None:
    assert "rank=0 done" in output
    assert "rank=1 done" in output
