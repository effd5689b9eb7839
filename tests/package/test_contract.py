"""The contract module is the one home of what agent, workers and helpers agree on."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from hpc_elastic import contract, events, spec
from hpc_elastic.agent.api import AgentSpec
from hpc_elastic.jobdir import JobDir
from hpc_elastic.train import exitcodes, lease


def test_the_old_homes_of_shared_names_give_the_contracts_values() -> None:
    assert exitcodes.PREEMPTED_EXIT_CODE == contract.PREEMPTED_EXIT_CODE
    assert exitcodes.FENCED_EXIT_CODE == contract.FENCED_EXIT_CODE
    assert events.EVENTS_FILE_ENV == contract.EVENTS_FILE_ENV
    assert spec.MASTER_PORTS_ENV == contract.MASTER_PORTS_ENV


def test_the_slurm_layer_and_the_agent_api_do_not_import_the_training_package() -> None:
    code = (
        "import sys, hpc_elastic.slurm.elastic, hpc_elastic.agent.api, hpc_elastic.contract;"
        "print(sorted(m for m in sys.modules if m.startswith('hpc_elastic.train') or m == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_module_but_the_contract_spells_an_environment_variable_name() -> None:
    """A second spelling of ``HPC_ELASTIC_...`` could drift from the contract's without a test
    noticing; the one exception is the test harness's own ZooKeeper jar setting."""
    package = Path(contract.__file__).parent
    spelt = [
        f"{path.relative_to(package)}:{node.lineno} {node.value}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "contract.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"HPC_ELASTIC_[A-Z_]+", node.value)
        and node.value != "HPC_ELASTIC_ZOOKEEPER_JAR"
    ]
    assert spelt == []


def test_the_agent_and_the_training_helpers_share_one_lease_variable() -> None:
    assert lease.LEASE_FILE_ENV is contract.LEASE_FILE_ENV
    assert lease.LEASE_TIMEOUT_ENV is contract.LEASE_TIMEOUT_ENV


def test_the_job_directory_names_its_files_as_the_contract_does(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    assert job.secret == tmp_path / contract.SECRET_FILE
    assert job.events == tmp_path / contract.EVENTS_FILE
    assert job.checkpoints == tmp_path / contract.CHECKPOINTS_DIR
    assert job.slot_ledger(3) == tmp_path / contract.SLOTS_DIR / "3.json"
    assert AgentSpec(job_dir=tmp_path, command=("true",)).log_dir == job.logs
