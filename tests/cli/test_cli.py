"""The command line as a user meets it: help, version, one-line errors, submit on a fake Slurm."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from slurm_fake import FakeSlurm, Reply, mocked_submit

from hpc_elastic import __version__, cli

runner = CliRunner()


@pytest.fixture
def slurm() -> Iterator[FakeSlurm]:
    """Slurm as submit meets it: partitions low and high, sbatch takes job 42, then 43."""
    with mocked_submit() as fake:
        yield fake


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_version() -> None:
    assert invoke("--version") == (0, f"hpc-elastic {__version__}\n", "")


def test_help_teaches_by_example() -> None:
    code, out, _ = invoke("--help")
    assert code == 0
    assert "submit" in out
    assert "render" in out
    code, out, _ = invoke("submit", "--help")
    assert code == 0
    assert "hpc-elastic submit --nodes 2:8" in out
    assert "--nodes N|MIN:MAX" in out


def test_no_arguments_shows_help() -> None:
    code, out, _ = invoke()
    assert code == 0
    assert "Usage: hpc-elastic" in out


def test_dry_run_prints_the_script_and_submits_nothing(workdir: Path, slurm: FakeSlurm) -> None:
    code, out, _ = invoke("submit", "--dry-run", "--nodes", "1:4", "train.py", "--", "--lr", "1")
    assert code == 0
    assert out.startswith("#!/bin/bash\n")
    assert "#SBATCH --array=0-3" in out
    runs = workdir.resolve() / "hpc-elastic-runs"
    assert re.search(rf"-u {re.escape(str(runs))}/train-[^/]+/code/train\.py --lr 1\n", out)
    assert "hpc-elastic submit --dry-run --nodes 1:4 train.py -- --lr 1" in out
    assert slurm.submitted == []
    assert not (workdir / "hpc-elastic-runs").exists()


def test_render_is_submit_dry_run(workdir: Path, slurm: FakeSlurm) -> None:
    code, out, _ = invoke("render", "--nodes", "2", "train.py")
    assert code == 0
    assert "#SBATCH --nodes=2" in out
    assert slurm.submitted == []


def test_submit_writes_the_job_directory(workdir: Path, slurm: FakeSlurm) -> None:
    code, out, err = invoke("submit", "--nodes", "1:2", "--partition", "low", "train.py")
    assert (code, err) == (0, "")
    [job_dir] = (workdir / "hpc-elastic-runs").iterdir()
    assert job_dir.name.startswith("train-")
    assert out.splitlines() == [
        f"Submitted batch job 42 (run {job_dir.name}, elastic 1:2 nodes).",
        f"Job directory: {job_dir}",
        f"Logs: {job_dir}/slurm-42_*.out",
        f"Code: snapshot of {workdir.resolve()} (not a git work tree), 1 file, 0.0 MB",
        "ZooKeeper: 127.0.0.1:2181 (the built-in default: no --zk, $HPC_ELASTIC_ZK, config "
        "file or ensemble of yours names one; `hpc-elastic zk start` starts one)",
    ]
    secret = (job_dir / "secret").read_text()
    assert len(secret) == 64
    assert stat.S_IMODE((job_dir / "secret").stat().st_mode) == 0o600
    assert slurm.submitted == [(job_dir / "sbatch.sh").read_text()]
    assert secret not in slurm.submitted[0]
    record = json.loads((job_dir / "job.json").read_text())
    assert record["job_id"] == "42"
    assert record["run_id"] == job_dir.name
    assert record["spec"]["nodes"] == "1:2"
    assert secret not in json.dumps(record)


def test_flags_beat_the_config_file(workdir: Path, slurm: FakeSlurm) -> None:
    (workdir / "pyproject.toml").write_text(
        '[tool.hpc-elastic]\nnodes = "1:4"\npartition = "low"\nenv = { A = "file", B = "file" }\n'
    )
    code, out, _ = invoke("render", "--partition", "high", "--env", "B=flag", "train.py")
    assert code == 0
    assert "#SBATCH --array=0-3" in out
    assert "#SBATCH --partition=high" in out
    assert "export A=file\nexport B=flag\n" in out


def test_slot_budgets_and_prewarm_reach_the_agent(workdir: Path, slurm: FakeSlurm) -> None:
    (workdir / "hpc-elastic.toml").write_text("max-time-limits = 4\nprewarm = false\n")
    code, out, _ = invoke(
        "render", "--nodes", "1:2", "--max-preemptions", "7", "--exclude-after", "3", "train.py"
    )
    assert code == 0
    assert "--max-preemptions 7 \\\n" in out
    assert "--max-time-limits 4 \\\n" in out
    assert "--exclude-after 3 \\\n" in out
    assert "--prewarm" not in out
    code, out, _ = invoke("render", "--prewarm", "train.py")
    assert "--prewarm torch \\\n" in out


def test_a_slot_must_be_allowed_one_failure_per_node(workdir: Path, slurm: FakeSlurm) -> None:
    code, _, err = invoke("render", "--exclude-after", "0", "train.py")
    assert code == 2
    assert "--exclude-after" in err
    assert "'0'" in err


def test_flags_become_sbatch_lines(workdir: Path, slurm: FakeSlurm) -> None:
    code, out, _ = invoke(
        "render",
        *("--nodes", "3", "--account", "proj", "--qos", "hi", "--time", "1-00"),
        *("--gpus-per-node", "4", "--cpus-per-task", "32", "--mem", "64g"),
        *("--constraint", "a100", "--exclude", "n1", "--no-requeue", "--signal", "USR1@30"),
        *("--sbatch-arg", "--reservation=big", "--job-name", "exp1", "--no-snapshot", "train.py"),
    )
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("#SBATCH")]
    assert lines[:3] == [
        "#SBATCH --job-name=exp1",
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=1",
    ]
    assert lines[5:] == [
        "#SBATCH --account=proj",
        "#SBATCH --qos=hi",
        "#SBATCH --time=1-00",
        "#SBATCH --mem=64G",
        "#SBATCH --constraint=a100",
        "#SBATCH --exclude=n1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --no-requeue",
        "#SBATCH --signal=USR1@30",
        "#SBATCH --reservation=big",
    ]
    assert "--preempt-signal USR1 \\\n      --grace 30 \\\n" in out


def test_zk_comes_from_the_environment(
    workdir: Path, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPC_ELASTIC_ZK", "zk9:2181")
    assert "--zk zk9:2181 " in invoke("render", "train.py")[1]
    assert "--zk zk1:1 " in invoke("render", "--zk", "zk1:1", "train.py")[1]


BAD_INPUT = [
    (["--nodes", "4:1"], "--nodes '4:1' is inverted"),
    (["--nodes", "0"], "--nodes '0' asks for fewer than one node"),
    (["--nodes", "a:b"], "--nodes 'a:b' is not a node count"),
    (["--nproc-per-node", "0"], "--nproc-per-node '0' is out of range"),
    (["--nproc-per-node", "many"], "--nproc-per-node 'many' is not a whole number"),
    (["--min-wait", "-1"], "--min-wait '-1' is negative"),
    (["--max-restarts", "-1"], "--max-restarts '-1' is out of range"),
    (["--time", "2h"], "--time '2h' is not a Slurm time"),
    (["--mem", "4X"], "--mem '4X' is not a memory size"),
    (["--signal", "B:USR2@90"], "would reach only the batch shell"),
    (["--signal", "KILL"], "--signal 'KILL' is not a signal the agent can catch"),
    (["--env", "NOVALUE"], "--env 'NOVALUE' is not KEY=VALUE"),
    (["--partition", "a b"], "--partition 'a b' is empty or contains spaces"),
    (["--sbatch-arg", "reservation=x"], "--sbatch-arg 'reservation=x' is not an sbatch option"),
    (["--setup", "a\nb"], "give one --setup per shell line"),
    (["--zk", "localhost"], "--zk 'localhost' is not a ZooKeeper address list"),
    (["--template", "missing.j2"], "--template 'missing.j2' cannot be read"),
    (["--job-name", "a/b"], "--job-name 'a/b' is not usable"),
    (["--no-such-flag"], "No such option '--no-such-flag'"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_INPUT)
def test_bad_input_is_one_sentence_and_exit_2(
    workdir: Path, slurm: FakeSlurm, flags: list[str], message: str
) -> None:
    code, out, err = invoke("submit", *flags, "train.py")
    assert code == 2
    assert out == ""
    assert err.startswith("error: ")
    assert message in err
    assert err.count("\n") == 1
    assert slurm.submitted == []


def test_missing_script(workdir: Path, slurm: FakeSlurm) -> None:
    code, _, err = invoke("submit", "tarin.py")
    assert code == 2
    assert err == (
        "error: Script 'tarin.py' does not exist or is not a file; give the path of your "
        "training script, e.g. 'train.py'.\n"
    )


def test_broken_template(workdir: Path, slurm: FakeSlurm) -> None:
    (workdir / "job.sh.j2").write_text("{{ nodes_max + }}")
    code, _, err = invoke("submit", "--template", "job.sh.j2", "train.py")
    assert code == 2
    assert err.startswith("error: --template 'job.sh.j2' has a syntax error at line 1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes = 2\ngpus = 4\n", "unknown key 'gpus'; use one of"),
        ("nodes = [\n", "is not valid TOML"),
        ('nproc-per-node = "8"\n', "key 'nproc-per-node' must be an integer, not str '8'"),
        ('nodes = "4:1"\n', "key 'nodes' is invalid: --nodes '4:1' is inverted"),
    ],
)
def test_malformed_config_file(workdir: Path, slurm: FakeSlurm, text: str, message: str) -> None:
    (workdir / "hpc-elastic.toml").write_text(text)
    code, _, err = invoke("submit", "train.py")
    assert code == 2
    assert err.startswith(f"error: {workdir / 'hpc-elastic.toml'}")
    assert message in err
    assert err.count("\n") == 1


def test_unknown_partition_submits_nothing(workdir: Path, slurm: FakeSlurm) -> None:
    code, _, err = invoke("submit", "--partition", "gpu", "train.py")
    assert code == 2
    assert err == (
        "error: --partition 'gpu' does not exist on this cluster; use one of low, high "
        "(see `sinfo -s`).\n"
    )
    assert not (workdir / "hpc-elastic-runs").exists()


def test_sbatch_failure_leaves_no_job_directory(workdir: Path, slurm: FakeSlurm) -> None:
    said = "sbatch: error: Batch job submission failed: Invalid account specified\n"
    slurm.answer("sbatch", stderr=said, returncode=1)
    code, _, err = invoke("submit", "train.py")
    assert (code, err) == (
        1,
        "error: sbatch refused the job: Batch job submission failed: Invalid account "
        "specified; fix the request and submit again.\n",
    )
    assert len(slurm.submitted) == 1
    assert list((workdir / "hpc-elastic-runs").iterdir()) == []


def test_missing_sbatch_is_a_clear_runtime_error(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(workdir))
    code, _, err = invoke("submit", "train.py")
    assert code == 1
    assert err.startswith("error: sbatch was not found on PATH")


def test_unexpected_errors_are_one_line(workdir: Path, slurm: FakeSlurm) -> None:
    def broken(argv: list[str]) -> Reply:
        raise RuntimeError("boom")

    slurm.respond("sbatch", responder=broken)
    code, _, err = invoke("submit", "train.py")
    assert code == 1
    assert err.startswith("error: Internal error (RuntimeError: boom); rerun with")


def test_ctrl_c_ends_a_command_with_130_and_no_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted command (``logs --follow``, a long ``status``) ends as the shell's Ctrl-C
    does: exit 128 + SIGINT, no "error: Aborted." for what the user asked for."""
    from hpc_elastic import api  # noqa: PLC0415

    def interrupted(*_args: object) -> api.Job:
        raise KeyboardInterrupt

    monkeypatch.setattr(api.Job, "find", interrupted)
    code, out, err = invoke("status", "train-1")
    assert (code, out) == (130, "")
    assert "error" not in err


def _imported_modules(*args: str) -> str:
    """Run the real entry point in a fresh interpreter; return what it imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hpc_elastic", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    return " ".join(line.split("|")[-1].strip() for line in result.stderr.splitlines())


def test_help_imports_no_heavy_library() -> None:
    imported = _imported_modules("--help").split()
    for heavy in ("torch", "kazoo", "jinja2", "numpy"):
        assert heavy not in imported


def test_the_agent_starts_without_an_http_client() -> None:
    """Only a job with --notify posts; every agent paid for urllib.request (and ssl, http,
    email) at start-up before notify imported it lazily."""
    imported = _imported_modules("agent", "--help").split()
    assert "hpc_elastic.agent.agent" in imported  # the agent command was loaded
    for module in ("urllib.request", "http.client", "ssl"):
        assert module not in imported


def test_render_imports_no_other_command(workdir: Path) -> None:
    imported = _imported_modules("render", "train.py").split()
    others = {lazy.module for lazy in cli.LAZY_COMMANDS.values()} - {"hpc_elastic.commands.submit"}
    for module in others:
        assert module not in imported


def test_dry_run_does_not_import_torch(workdir: Path) -> None:
    imported = _imported_modules("submit", "--dry-run", "train.py").split()
    assert "jinja2" in imported
    for heavy in ("torch", "kazoo", "numpy"):
        assert heavy not in imported


EVERYDAY = {
    "--help": ("--help",),
    "--version": ("--version",),
    "render": ("render", "--nodes", "1:4", "train.py"),
    "submit": ("submit", "--dry-run", "train.py"),
    "status": ("status", "--log-dir", "runs", "train-1"),
}
"""The commands a user types most, which must start at once: no library they do not use."""


@pytest.mark.parametrize("args", list(EVERYDAY.values()), ids=list(EVERYDAY))
def test_the_everyday_commands_import_neither_typer_nor_pydantic_nor_torch(
    workdir: Path, args: tuple[str, ...]
) -> None:
    """typer converted every option's value through pydantic, a tenth of a second before any
    command ran; the command line is plain click now, and must stay so."""
    job_dir = workdir / "runs" / "train-1"  # a local run's record, which status reads
    job_dir.mkdir(parents=True)
    record = {"run_id": "train-1", "job_id": None, "mode": "local", "zk": "local:/nonexistent"}
    (job_dir / "job.json").write_text(json.dumps({**record, "spec": {"nodes": "1:2"}}))
    (job_dir / "job.json").chmod(0o600)
    imported = _imported_modules(*args).split()
    assert "click" in imported  # the list is read right
    for heavy in ("typer", "pydantic", "torch", "kazoo", "numpy"):
        assert heavy not in imported


@pytest.mark.parametrize("name", list(cli.LAZY_COMMANDS))
def test_the_root_help_lists_each_command_by_the_first_sentence_of_its_own_help(name: str) -> None:
    """The root ``--help`` shows a summary kept in ``LAZY_COMMANDS`` so that it imports no
    command; this is where a command's help and that summary cannot drift apart."""
    command = cli._load_command(name)
    help_text = " ".join((command.help or "").split())
    assert help_text.startswith(cli.LAZY_COMMANDS[name].summary), help_text[:200]


def test_the_root_help_imports_no_command_module() -> None:
    imported = _imported_modules("--help").split()
    for lazy in cli.LAZY_COMMANDS.values():
        assert lazy.module not in imported
