"""Which commands get standby workers: only scripts that may import the prewarmed module."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
from cluster import wait_until
from test_agent import Cluster

from hpc_elastic import events
from hpc_elastic.agent import agent as agent_module
from hpc_elastic.agent import command as agent_command
from hpc_elastic.agent.api import ExitCode
from hpc_elastic.agent.health import Result, Status
from hpc_elastic.agent.standby import (
    StandbyPool,
    hand_off,
    may_import,
    standby_command,
    starts_process_group,
    warm_modules,
)
from hpc_elastic.agent.workers import launch
from hpc_elastic.events import Kind
from hpc_elastic.options import AGENT_OPTIONS, AgentArguments
from hpc_elastic.spec import NodeRange


def script(tmp_path: Path, text: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def command(path: Path) -> tuple[str, ...]:
    return (sys.executable, "-u", str(path), "--steps", "3")


def test_a_script_that_imports_only_the_standard_library_gets_no_standbys(tmp_path: Path) -> None:
    path = script(tmp_path, "import os, json\nfrom pathlib import Path\nprint(os.getpid())\n")
    assert not may_import(command(path), ("torch",))


def test_a_script_that_imports_torch_anywhere_gets_standbys(tmp_path: Path) -> None:
    path = script(tmp_path, "import os\n\ndef main():\n    import torch.distributed as dist\n")
    assert may_import(command(path), ("torch",))
    path = script(tmp_path, "from torch import nn\n", "b.py")
    assert may_import(command(path), ("torch",))


def test_torch_reached_through_a_local_module_or_package_counts(tmp_path: Path) -> None:
    script(tmp_path, "import sys\nfrom . import layers\n", "model/__init__.py")
    script(tmp_path, "import torch\n", "model/layers.py")
    path = script(tmp_path, "from model import build\n")
    assert may_import(command(path), ("torch",))
    script(tmp_path, "import math\n", "helpers.py")
    plain = script(tmp_path, "import helpers\nfrom helpers import square\n", "plain.py")
    assert not may_import(command(plain), ("torch",))


def test_whatever_cannot_be_seen_through_counts_as_an_import(tmp_path: Path) -> None:
    third_party = script(tmp_path, "import numpy\n", "a.py")
    assert may_import(command(third_party), ("torch",))
    broken = script(tmp_path, "import (\n", "c.py")
    assert may_import(command(broken), ("torch",))
    assert may_import(command(tmp_path / "missing.py"), ("torch",))
    assert may_import((sys.executable, "-m", "pkg.train"), ("torch",))


def test_an_agent_keeps_no_standbys_for_a_script_that_never_imports_torch(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes="1", nproc_per_node=2, prewarm=("torch",))
    cluster.start(1, FAKE_WORKER_SECONDS="0.2")
    assert cluster.join() == {0: ExitCode.SUCCESS}
    assert any("imports none of torch" in line for line in cluster.said)
    assert cluster.agents[0]._standbys is None


KNOCKS = """
import os, socket, sys
# A real script calls init_process_group here: its TCPStore client knocks on rank 0's store.
try:
    socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), 5).close()
    result = "listening"
except OSError:
    result = "refused"
open(sys.argv[1], "w").write(result)
"""
"""A rank's first act, as torch's TCPStore client would do it: knock on rank 0's store."""


def warm_rank(tmp_path: Path, rank: int, port: int, text: str = KNOCKS) -> Path:
    """Hand a standby (json prewarmed) the rank; returns the file its script writes."""
    script_path = script(tmp_path, text, "knock.py")
    out = tmp_path / f"knock_{rank}"
    argv = standby_command((sys.executable, str(script_path), str(out)), ("json",))
    assert argv is not None
    process = launch(argv, dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    env = {**os.environ, "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    assert hand_off(process, env, None)
    return out


def test_a_warm_rank_runs_its_script_once_rank_0s_store_listens(tmp_path: Path) -> None:
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))  # Bound, not listening: connections are refused.
        out = warm_rank(tmp_path, 1, master.getsockname()[1])
        time.sleep(0.3)  # Rank 0 is still starting; the warm rank must not knock yet.
        master.listen()
        assert wait_until(out.exists, 60)
        assert wait_until(lambda: out.read_text() != "", 60)
        assert out.read_text() == "listening"


def test_warm_rank_0_never_waits_for_a_store_it_opens_itself(tmp_path: Path) -> None:
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        out = warm_rank(tmp_path, 0, master.getsockname()[1])
        assert wait_until(out.exists, 60)
        assert wait_until(lambda: out.read_text() != "", 60)
        assert out.read_text() == "refused"


def test_a_warm_rank_of_a_script_without_a_process_group_never_waits(tmp_path: Path) -> None:
    plain = KNOCKS.replace("init_process_group", "nothing distributed")
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        out = warm_rank(tmp_path, 1, master.getsockname()[1], plain)
        assert wait_until(out.exists, 60)
        assert wait_until(lambda: out.read_text() != "", 60)
        assert out.read_text() == "refused"


def test_only_scripts_that_start_a_process_group_themselves_wait_for_rank_0(
    tmp_path: Path,
) -> None:
    helper = script(
        tmp_path, "import torch.distributed as dist\ndist.init_process_group()\n", "lib/setup.py"
    )
    assert helper.is_file()
    main = script(tmp_path, "from lib import setup\n")
    assert starts_process_group(command(main))
    alone = tmp_path / "alone"
    plain = script(alone, "import lightning\n")
    assert not starts_process_group(command(plain))
    assert not starts_process_group((sys.executable, "-m", "pkg.train"))


def test_a_script_that_asks_for_deterministic_algorithms_gets_standbys_that_import_inductor(
    tmp_path: Path,
) -> None:
    deterministic = script(tmp_path, "import torch\ntorch.use_deterministic_algorithms(True)\n")
    assert warm_modules(command(deterministic), ("torch",)) == ["torch", "torch._inductor.config"]
    compiled = script(tmp_path / "c", "import torch\nmodel = torch.compile(model)\n")
    assert warm_modules(command(compiled), ("torch",)) == ["torch", "torch._inductor.config"]
    plain = script(tmp_path / "p", "import re, torch\nre.compile('x')\n")
    assert warm_modules(command(plain), ("torch",)) == ["torch"]
    # Only for a prewarmed package: a standby that skips torch does not import part of it.
    assert warm_modules(command(deterministic), ("numpy",)) == ["numpy"]
    argv = standby_command(command(deterministic), ("torch",))
    assert argv is not None
    assert "torch,torch._inductor.config" in argv
    # A script not found here says nothing about the files beside its would-be path.
    assert warm_modules(command(tmp_path / "missing.py"), ("torch",)) == ["torch"]


def test_a_script_that_builds_an_optimizer_gets_standbys_that_import_dynamo(
    tmp_path: Path,
) -> None:
    # The first torch.optim optimizer of a process imports torch._dynamo (2.5 s here).
    trains = script(tmp_path, "import torch\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    assert warm_modules(command(trains), ("torch",)) == ["torch", "torch._dynamo"]
    workload = Path(__file__).resolve().parents[1] / "workloads" / "train_inplace.py"
    assert "torch._dynamo" in warm_modules(command(workload), ("torch",))


def test_the_example_training_script_gets_standbys_that_import_what_its_first_line_imports() -> (
    None
):
    """examples/train.py calls torch.use_deterministic_algorithms before anything else."""
    example = Path(__file__).resolve().parents[2] / "examples" / "train.py"
    assert "torch._inductor.config" in warm_modules(command(example), ("torch",))


def test_a_warm_rank_finds_the_module_its_script_calls_for_already_imported(
    tmp_path: Path,
) -> None:
    text = (
        "import sys\n"
        "# torch.use_deterministic_algorithms(True) would import it now\n"
        "open(sys.argv[1], 'w').write(str('torch._dynamo' in sys.modules))\n"
    )
    script_path = script(tmp_path, text, "check.py")
    out = tmp_path / "imported"
    argv = standby_command((sys.executable, str(script_path), str(out)), ("torch",))
    assert argv is not None
    process = launch(argv, dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert hand_off(process, {**os.environ, "RANK": "0"}, None)
    assert process.wait(timeout=120) == 0
    assert out.read_text() == "True"


def test_a_call_in_a_script_beside_it_gives_no_standby_its_module(tmp_path: Path) -> None:
    """A folder of scripts is common: one that builds an optimizer says nothing of the others."""
    script(tmp_path, "import torch\nopt = torch.optim.SGD(params, lr=0.1)\n", "finetune.py")
    script(tmp_path, "import torch\ntorch.use_deterministic_algorithms(True)\n", "lib/exact.py")
    plain = script(tmp_path, "import torch\nimport lib\n")
    assert warm_modules(command(plain), ("torch",)) == ["torch"]
    # A local module it imports does count, as its own text would.
    uses = script(tmp_path, "import torch\nfrom lib import exact\n", "uses.py")
    assert warm_modules(command(uses), ("torch",)) == ["torch", "torch._inductor.config"]
    # The gloo workload sits beside train_inplace.py, which builds an optimizer; it does not.
    workload = Path(__file__).resolve().parents[1] / "workloads" / "train_gloo.py"
    assert warm_modules(command(workload), ("torch",)) == ["torch"]


GATE = """
import os, pathlib, time
# Imported by the standbys: they stay "importing" until the file named by GATE exists.
pathlib.Path(os.environ["GATE"] + f".importing.{os.getpid()}").touch()
while not os.path.exists(os.environ["GATE"]):
    time.sleep(0.01)
"""


def gated_pool(tmp_path: Path, size: int) -> tuple[StandbyPool, Path]:
    """A pool whose standbys import ``gate``, which returns once the returned path exists."""
    script(tmp_path, GATE, "modules/gate.py")
    train = script(tmp_path, "import gate\n")
    argv = standby_command((sys.executable, str(train)), ("gate",))
    assert argv is not None
    gate = tmp_path / "open"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "modules"), "GATE": str(gate)}
    launcher = functools.partial(launch, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    return StandbyPool(argv, env, size, launcher, tmp_path / "ready"), gate


def test_a_standby_is_warm_only_once_its_imports_are_done(tmp_path: Path) -> None:
    pool, gate = gated_pool(tmp_path, size=2)
    try:
        pool.fill()
        importing = lambda: len(list(tmp_path.glob("open.importing.*"))) == 2  # noqa: E731
        assert wait_until(importing, 60)
        assert not pool.warm  # both are held in the import until the gate opens
        gate.touch()
        assert wait_until(lambda: pool.warm, 60)
        taken = pool.take()
        assert taken is not None
        assert not (tmp_path / "ready" / str(taken.pid)).exists()  # its pid may come back
        taken.kill()
        taken.wait()
    finally:
        pool.close()
    assert list((tmp_path / "ready").iterdir()) == []


def test_a_standby_that_died_does_not_keep_the_pool_cold(tmp_path: Path) -> None:
    """Its rank starts cold; waiting for it would wait for ever."""
    pool, _ = gated_pool(tmp_path, size=1)
    try:
        pool.fill()
        assert wait_until(lambda: len(list(tmp_path.glob("open.importing.*"))) == 1, 60)
        pid = int(next(tmp_path.glob("open.importing.*")).name.rsplit(".", 1)[1])
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: pool.warm, 60)
    finally:
        pool.close()


def gated_cluster(tmp_path: Path) -> Cluster:
    """``--nodes 1:2`` agents whose standbys import ``gate``; each rank writes
    ``round_<round>_rank_<rank>`` and trains until ``out/finish`` exists."""
    script(tmp_path, GATE, "modules/gate.py")
    train = script(
        tmp_path,
        "import gate\n"
        "import os, pathlib, time\n"
        "out = pathlib.Path(os.environ['FAKE_WORKER_OUT'])\n"
        "name = f\"round_{os.environ['HPC_ELASTIC_ROUND']}_rank_{os.environ['RANK']}\"\n"
        "(out / name).write_text(os.environ['WORLD_SIZE'])\n"
        "while not (out / 'finish').exists():\n"
        "    time.sleep(0.05)\n",
    )
    cluster = Cluster(tmp_path, nodes="1:2", prewarm=("gate",))
    cluster.spec = replace(cluster.spec, command=(sys.executable, str(train)))
    return cluster


def test_a_node_arriving_at_a_running_job_joins_once_its_standbys_are_warm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Joining ends the running round: the job trains while the newcomer's standbys import."""
    monkeypatch.setattr(agent_module, "WARM_UP_WAIT", 600.0)  # no way out but the gate
    cluster = gated_cluster(tmp_path)
    modules = str(tmp_path / "modules")
    (tmp_path / "open").touch()
    cluster.start(1, PYTHONPATH=modules, GATE=str(tmp_path / "open"))
    assert wait_until((cluster.out / "round_1_rank_0").exists, 60)
    cluster.start(1, PYTHONPATH=modules, GATE=str(tmp_path / "later"))
    assert wait_until(lambda: any("before joining the running job" in s for s in cluster.said), 60)
    assert wait_until(lambda: any(tmp_path.glob("later.importing.*")), 60)
    assert cluster.job.server.member_ids == {"node0"}  # still training alone, undisturbed
    (tmp_path / "later").touch()
    opened = time.time()
    assert wait_until((cluster.out / "round_2_rank_1").exists, 60)
    (cluster.out / "finish").touch()
    assert cluster.join() == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}
    rounds = [e for e in events.read(cluster.job_dir / "events.jsonl") if e.kind == Kind.ROUND]
    assert [e.round for e in rounds if e.slot == "n1"] == [2]
    assert all(e.time >= opened for e in rounds if e.round == 2)
    assert (cluster.out / "round_2_rank_1").read_text() == "2"


def test_the_first_nodes_of_a_job_join_while_their_standbys_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the start nobody trains yet, and the round's last call overlaps the imports."""
    monkeypatch.setattr(agent_module, "WARM_UP_WAIT", 600.0)
    cluster = gated_cluster(tmp_path)
    cluster.start(1, PYTHONPATH=str(tmp_path / "modules"), GATE=str(tmp_path / "later"))
    assert wait_until(lambda: "round" in cluster.kinds(), 60)  # formed with the gate shut
    assert not (cluster.out / "round_1_rank_0").exists()  # its warm rank is still importing
    (tmp_path / "later").touch()
    assert wait_until((cluster.out / "round_1_rank_0").exists, 60)
    (cluster.out / "finish").touch()
    assert cluster.join() == {0: ExitCode.SUCCESS}
    assert not any("before joining" in line for line in cluster.said)


def test_the_standbys_import_during_the_health_checks_and_go_with_a_node_that_fails_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU node the checks take seconds (the matmul test imports torch and initialises
    CUDA): the standbys start first, so an arriving node is warm sooner."""
    script(tmp_path, GATE, "modules/gate.py")
    train = script(tmp_path, "import gate\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "modules"))
    monkeypatch.setenv("GATE", str(tmp_path / "never"))  # they import until they are killed
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the run directory goes
    importing: list[Path] = []

    def sees_a_standby_importing() -> Result:
        wait_until(lambda: any(tmp_path.glob("never.importing.*")), 60)
        importing.extend(tmp_path.glob("never.importing.*"))
        return Result("standbys", Status.FAILED, f"{len(importing)} standby was importing.")

    checks = {"standbys": sees_a_standby_importing}
    monkeypatch.setattr(agent_command, "_default_checks", lambda *_: checks)
    defaults = {row.name: row.default for row in AGENT_OPTIONS}
    args = replace(
        AgentArguments.from_values(defaults),
        run_id="job1",
        job_dir=tmp_path / "job",
        zk=f"local:{tmp_path / 'never-served'}",
        nodes=NodeRange(1, 1),
        prewarm=("gate",),
        slot="0",
        host="127.0.0.1",
    )
    assert agent_command.run_agent((sys.executable, str(train)), args) == 1
    assert len(importing) == 1
    pid = int(importing[0].name.rsplit(".", 1)[1])
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped with the node's exit
    assert not list(tmp_path.glob("hpc-elastic-*"))  # and its run directory removed
