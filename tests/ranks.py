"""Run a test script as the agent would: under torchrun with a few ranks on this machine, or as
one plain Python process; the tests assert on what the ranks print.

torchrun's ``--tee=3`` prefixes every line with its rank (``[default0]:``), which ``lines`` reads
back. Every plain torchrun of the tests is built here (``torchrun_command``,
``environment``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from hpc_elastic import contract

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
SHARE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set, torchrun gives the workers a store of their own, on a port it picked and let go."""
AGENT_SET = (contract.CHECKPOINT_DIR_ENV, contract.EVENTS_FILE_ENV, contract.ROUND_ENV)
"""What an agent sets for its workers, and a plain torchrun must not inherit."""
GLOO_RANKS = """
import datetime, os, torch, torch.distributed as dist
from pathlib import Path
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import hpc_elastic.train as elastic
from hpc_elastic.errors import CheckpointError
from hpc_elastic.train.checkpoint import Checkpointer

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
"""
"""The start of a script whose ranks try checkpoint operations and print what each saw: the
process group's timeout (120 s) is far longer than any step needs, so a rank left waiting
shows as a timeout error, not as a hang of the test."""


def torchrun_command(
    nproc: int, script: Path, *args: str, options: tuple[str, ...] = ()
) -> list[str]:
    """Plain torchrun: ``nproc`` ranks of ``script`` on this machine, never restarted; ``options``
    are torchrun's own (``--tee=3``).

    The ranks' store is the one torchrun's rendezvous opened on a port the kernel gave it as it
    listened (``:0``), shared with the workers (``environment``). With a store of their
    own, torchrun picks the workers' ``MASTER_PORT`` by binding a socket and closing it
    (``get_free_port``), and rank 0 binds that port again seconds later: on a busy machine
    another process's connection can take it in between, and rank 0 then fails with EADDRINUSE
    while the other ranks wait for its store until torchrun kills them.
    """
    return [
        str(TORCHRUN),
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        "--max-restarts=0",
        *options,
        str(script),
        *args,
    ]


def environment(**extra: str) -> dict[str, str]:
    """This process's environment for what a test starts (a plain torchrun, an agent, the CLI):
    this checkout first on the path, one thread a rank, nothing an agent would have set, and
    torchrun's rendezvous store shared with its workers (``torchrun_command``); ``extra`` on
    top."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    for name in (SHARE_OFF, *AGENT_SET):
        env.pop(name, None)
    return {**env, **extra}


def torchrun(
    script: Path,
    *args: str,
    cwd: Path,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``script`` on ``nproc`` local ranks, with this checkout first on the path."""
    return subprocess.run(
        torchrun_command(nproc, script, *args, options=("--tee=3",)),
        env=environment(**(env or {})),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def torchrun_ok(
    script: Path,
    *args: str,
    cwd: Path,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> str:
    """``torchrun``, asserting that every rank exited 0; what the ranks printed."""
    result = torchrun(script, *args, cwd=cwd, nproc=nproc, env=env, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


LEAVE = """
import os as _os, sys as _sys
_sys.stdout.flush()
_sys.stderr.flush()
_os._exit(0)
"""
"""The last lines of a rank script after ``destroy_process_group()``: leave without the
interpreter's finalization. There, gloo's threads and the tensors they still hold can abort
the process ("terminate called without an active exception", SIGABRT; seen in loaded CI runs
after every rank had printed its last line; pytorch/pytorch#179291 describes the mechanism):
a teardown race of torch's, not a behaviour these tests check."""

GLOO_END = (
    """
dist.barrier()
print(f"rank={rank} done", flush=True)
dist.destroy_process_group()
"""
    + LEAVE
)
"""The end of a ``GLOO_RANKS`` script: each rank says it got past the last barrier, and
it then leaves as ``LEAVE`` does."""


def run_on_gloo_ranks(tmp_path_factory: pytest.TempPathFactory, name: str, body: str) -> str:
    """``GLOO_RANKS``, ``body`` and ``GLOO_END`` as ``<name>.py`` in a fresh directory, under
    ``torchrun_ok`` on two ranks; what the ranks printed."""
    cwd = tmp_path_factory.mktemp(name)
    script = cwd / f"{name}.py"
    script.write_text(GLOO_RANKS + body + GLOO_END)
    return torchrun_ok(script, cwd=cwd)


def python(
    code: str,
    *args: str,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh Python process (signals, exit codes and env of its own)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def lines(output: str, name: str) -> list[str]:
    """What the ranks printed after ``NAME: ``, in output order."""
    return [line.split(": ", 1)[1] for line in output.splitlines() if f" {name}: " in line]
