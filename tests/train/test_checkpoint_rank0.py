"""Whatever rank 0 hits while saving, every rank raises a clear error at once; none hangs.

Two real gloo ranks under torchrun go through six failures in one launch (a launch costs
seconds on a busy machine): a stale round's save on either path, an unpicklable value, a
ValueError in the commit, and the sharded path failing in either of rank 0's steps. The
process group's timeout (120 s) is far longer than any of these needs, so a rank left waiting
would show as a timeout error, not as a line.
"""

from __future__ import annotations

import pytest
from ranks import lines, run_on_gloo_ranks

SCRIPT = """

def attempt(name, action):
    try:
        action()
        print(f"rank={rank} {name}: saved", flush=True)
    except CheckpointError as error:
        print(f"rank={rank} {name}: {type(error).__name__}: {error}", flush=True)
    except Exception as error:
        print(f"rank={rank} {name}: other {type(error).__name__}: {error}", flush=True)


def sharded(directory="sharded"):
    weight = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    elastic.save_sharded({"weight": weight}, 1, directory)


os.environ["HPC_ELASTIC_ROUND"] = "3"
if rank == 0:
    for directory in ("replicated-fenced", "sharded-fenced"):
        Checkpointer(Path(directory), round=4).choose()  # round 4 resumed there
dist.barrier()
fenced = elastic.TrainState(torch.nn.Linear(2, 2))
attempt("replicated-fenced", lambda: elastic.save(fenced, "replicated-fenced"))
attempt("sharded-fenced", lambda: sharded("sharded-fenced"))
del os.environ["HPC_ELASTIC_ROUND"]


def fail(self, *args):
    raise ValueError("simulated failure")


unpicklable = elastic.TrainState(torch.nn.Linear(2, 2), extras={"hook": lambda: None})
attempt("unpicklable", lambda: elastic.save(unpicklable, "replicated"))
commit = Checkpointer.commit
Checkpointer.commit = fail
attempt("commit", lambda: elastic.save(elastic.TrainState(torch.nn.Linear(2, 2)), "replicated"))
attempt("sharded-commit", sharded)
Checkpointer.commit = commit
Checkpointer.prepare_staging = fail
attempt("sharded-prepare", sharded)
"""


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> str:
    return run_on_gloo_ranks(tmp_path_factory, "rank0", SCRIPT)


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("unpicklable", "Could not write checkpoint step 0"),
        ("commit", "ValueError: simulated failure"),
        ("sharded-commit", "ValueError: simulated failure"),
        ("sharded-prepare", "ValueError: simulated failure"),
    ],
)
def test_every_rank_raises_what_rank_0_hit(output: str, name: str, cause: str) -> None:
    seen = lines(output, name)
    assert len(seen) == 2, output[-3000:]
    for line in seen:
        assert line.startswith("CheckpointError: "), line
        assert cause in line, line


@pytest.mark.parametrize("name", ["replicated-fenced", "sharded-fenced"])
def test_every_rank_of_a_stale_round_is_refused(output: str, name: str) -> None:
    seen = lines(output, name)
    assert len(seen) == 2, output[-3000:]
    for line in seen:
        assert line.startswith("CheckpointFencedError: Round 3 may not "), line


def test_every_rank_carries_on_after_the_failures(output: str) -> None:
    assert "rank=0 done" in output
    assert "rank=1 done" in output
