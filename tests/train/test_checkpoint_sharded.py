"""Sharded checkpoints: written by 2 ranks through DCP, committed once, read back by 1 rank."""

from __future__ import annotations

from pathlib import Path

from ranks import LEAVE, torchrun_ok

SCRIPT = (
    """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import hpc_elastic.train as elastic

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
full = torch.arange(16.0).reshape(8, 2)
if sys.argv[1] == "save":
    weight = distribute_tensor(full, mesh, [Shard(0)])
    print("saved", elastic.save_sharded({"weight": weight, "step": 3}, 3, "ckpt").name)
else:
    state = {"weight": distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)]), "step": 0}
    print("loaded", elastic.load_sharded(state, "ckpt").name, state["step"])
    print("equal", torch.equal(state["weight"].full_tensor(), full))
dist.barrier()
dist.destroy_process_group()
"""
    + LEAVE
)


def torchrun(nproc: int, mode: str, cwd: Path) -> str:
    return torchrun_ok(cwd / "sharded.py", mode, cwd=cwd, nproc=nproc, timeout=240)


def test_two_ranks_save_one_rank_loads(tmp_path: Path) -> None:
    (tmp_path / "sharded.py").write_text(SCRIPT)
    assert "saved step-00000003" in torchrun(2, "save", tmp_path)
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == ["step-00000003"]
    output = torchrun(1, "load", tmp_path)
    assert "loaded step-00000003 3" in output
    assert "equal True" in output
