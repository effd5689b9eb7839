"""The option table is the one place an option is written: everything else agrees with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpc_elastic import cli, config, contract, local
from hpc_elastic.agent import command
from hpc_elastic.agent.api import AgentSpec
from hpc_elastic.agent.workers import WorkerPaths, worker_env
from hpc_elastic.commands import run as run_command
from hpc_elastic.commands.run import RUN_OPTIONS
from hpc_elastic.invocation import AgentInvocation
from hpc_elastic.options import (
    AGENT_OPTIONS,
    CHECKPOINT_OPTIONS,
    SUBMIT_OPTIONS,
    AgentArguments,
    agent_options,
    job_environment,
    resolve,
)
from hpc_elastic.rendezvous.api import NodeInfo, Round
from hpc_elastic.spec import JobSpec, NodeRange, PreemptSignal

runner = CliRunner()


def test_every_job_spec_field_but_the_script_is_an_option_and_the_plans_own_are_not_fields() -> (
    None
):
    fields = {field.name for field in dataclasses.fields(JobSpec)}
    for option in SUBMIT_OPTIONS:
        if not option.in_spec:
            assert option.name not in fields
            continue
        assert option.name in fields, f"JobSpec has no field for the table's '{option.name}'"
    table = {option.name for option in SUBMIT_OPTIONS}
    assert set(fields) - table == {"script", "script_args"}


def test_the_config_keys_are_the_tables_flags_without_dashes() -> None:
    assert set(config._KEYS) == {
        option.cli_flag.removeprefix("--").split("/")[0]
        if option.name != "sbatch_args"
        else "sbatch-args"
        for option in SUBMIT_OPTIONS
    }


def test_help_shows_each_default_the_table_holds() -> None:
    result = runner.invoke(cli.app, ["submit", "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "[default: 1]" in result.stdout  # --nodes, --nproc-per-node
    assert "[default: USR2@90]" in result.stdout
    assert "[default: 127.0.0.1:2181]" in result.stdout
    assert "the agent's 600" in result.stdout  # --min-wait: unset, the agent decides


def test_a_flag_equal_to_the_default_still_beats_the_config_file(workdir: Path) -> None:
    (workdir / "hpc-elastic.toml").write_text("nproc-per-node = 4\nmax-restarts = 9\n")
    result = runner.invoke(cli.app, ["render", "--nproc-per-node", "1", "train.py"])
    assert result.exit_code == 0, result.stderr
    assert "--nproc-per-node 1 \\\n" in result.stdout
    assert "--max-restarts 9 \\\n" in result.stdout


def test_an_untyped_option_takes_the_file_then_the_tables_default() -> None:
    values = {option.name: None for option in SUBMIT_OPTIONS}
    resolved = resolve(SUBMIT_OPTIONS, values, lambda _name: False, {"nproc_per_node": 4})
    assert resolved["nproc_per_node"] == 4
    assert resolved["max_restarts"] == 3
    assert resolved["env"] == ()


def test_env_flags_join_the_files_env_key_by_key() -> None:
    values = {option.name: None for option in SUBMIT_OPTIONS} | {"env": ["B=flag", "C=flag"]}
    resolved = resolve(
        SUBMIT_OPTIONS, values, lambda name: name == "env", {"env": (("A", "f"), ("B", "f"))}
    )
    assert resolved["env"] == (("A", "f"), ("B", "flag"), ("C", "flag"))


def agent_invocation(**changes: Any) -> AgentInvocation:
    """The agent of run ``r-1`` on one or two nodes, two workers each, with ``changes``."""
    invocation = AgentInvocation(
        python="/py",
        run_id="r-1",
        job_dir=Path("/runs/r 1"),
        nodes="1:2",
        nproc_per_node=2,
        zk="zk:2181",
        worker=("/py", "-u", "/w/train.py"),
    )
    return dataclasses.replace(invocation, **changes)


def test_local_mode_and_the_template_start_the_same_agent() -> None:
    spec = JobSpec(script=Path("/w/train.py"), max_restarts=5, hang_timeout=30.0)
    invocation = agent_invocation(options=agent_options(spec.values()))
    argv = invocation.argv()
    assert argv[:4] == ["/py", "-m", "hpc_elastic", "agent"]
    assert argv[argv.index("--max-restarts") + 1] == "5"
    assert argv[argv.index("--hang-timeout") + 1] == "30"
    assert argv[argv.index("--") :] == ["--", "/py", "-u", "/w/train.py"]
    shell = invocation.shell()
    assert "--job-dir '/runs/r 1'" in shell
    assert len(shell) == len(invocation.flags())


NOT_FLAGS = {"python", "worker", "options"}
"""The fields of ``AgentInvocation`` that are not agent options: the interpreter, the worker
command, and the flags the option table already made."""


KNOBS: dict[str, Any] = {
    "max_restarts": 5,
    "hang_timeout": 30.0,
    "last_call": 1.5,
    "session_timeout": 7.0,
}
BUDGETS: dict[str, Any] = {
    "min_wait": 60.0,
    "zk_outage_limit": 120.0,
    "max_preemptions": 4,
    "max_time_limits": 2,
    "exclude_after": 1,
    "expected_gpus": 8,
    "bad_node_ttl": 3600.0,
    "exclude_stragglers": True,
    "grace_action": "lead",
    "in_place": True,
}
"""Values other than the defaults for every ``submit`` row that passes an agent flag."""


def test_every_flag_an_invocation_writes_is_one_the_agent_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = JobSpec(
        script=Path("/w/train.py"),
        signal=PreemptSignal("USR1", 60),
        prewarm=True,
        **KNOBS,
        **BUDGETS,
    )
    local_flags = (("--slot", "3"), ("--host", "127.0.0.1"), ("--tee",), ("--metrics-port", "0"))
    invocation = agent_invocation(
        auth_file=Path("/runs/r 1/secret"),
        options=(*agent_options(spec.values()), *local_flags),
    )
    fields = {field.name for field in dataclasses.fields(AgentInvocation)} - NOT_FLAGS
    assert len(invocation.identity()) == len(fields), "a field that never becomes a flag"
    seen: list[tuple[tuple[str, ...], AgentArguments]] = []

    def run_agent(worker: tuple[str, ...], args: AgentArguments, **_: object) -> int:
        seen.append((worker, args))  # what the agent would run with; it runs nothing here
        return 0

    monkeypatch.setattr(command, "run_agent", run_agent)
    # The flags are under test, not the environment: the suite's own user secret (conftest)
    # would otherwise stand in for the table's default.
    monkeypatch.delenv(contract.USER_SECRET_FILE_ENV)

    result = runner.invoke(cli.app, invocation.argv()[3:])

    assert result.exit_code == 0, result.output
    [(worker, args)] = seen
    assert worker == invocation.worker
    defaults = AgentArguments.from_values({row.name: row.default for row in AGENT_OPTIONS})
    assert args == dataclasses.replace(
        defaults,
        run_id="r-1",
        job_dir=Path("/runs/r 1"),
        nodes=NodeRange(1, 2),
        nproc_per_node=2,
        zk="zk:2181",
        zk_auth_file=Path("/runs/r 1/secret"),
        preempt_signal="USR1",
        grace=60.0,
        prewarm=("torch",),
        slot="3",
        host="127.0.0.1",
        tee=True,
        metrics_port=0,
        **KNOBS,
        **BUDGETS,
    )


def test_the_agents_help_shows_the_tables_defaults() -> None:
    result = runner.invoke(cli.app, ["agent", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for row in AGENT_OPTIONS:
        assert row.cli_flag.split("/")[0] in result.stdout, row.name
    assert "[default: 600.0]" in result.stdout  # --min-wait: the agent's own default
    assert "[required]" in result.stdout  # --run-id, --job-dir, --zk, --nodes


CHECKPOINT_FLAGS = (
    "--checkpoint-async",
    "--checkpoint-when-busy=skip",
    "--keep=5",
    "--keep-every=100",
    "--local-checkpoint-dir=/local/ckpt",
    "--persist-every=4",
)


def test_the_checkpoint_options_reach_the_workers_as_the_contracts_variables(
    workdir: Path,
) -> None:
    result = runner.invoke(cli.app, ["render", "--nodes=2:4", *CHECKPOINT_FLAGS, "train.py"])
    assert result.exit_code == 0, result.output
    for line in (
        f"export {contract.CHECKPOINT_ASYNC_ENV}=1",
        f"export {contract.CHECKPOINT_WHEN_BUSY_ENV}=skip",
        f"export {contract.CHECKPOINT_KEEP_ENV}=5",
        f"export {contract.CHECKPOINT_KEEP_EVERY_ENV}=100",
        f"export {contract.LOCAL_CHECKPOINT_DIR_ENV}=/local/ckpt",
        f"export {contract.PERSIST_EVERY_ENV}=4",
    ):
        assert line in result.output.splitlines()


def test_checkpoint_options_left_at_their_defaults_export_nothing(workdir: Path) -> None:
    result = runner.invoke(cli.app, ["render", "--no-checkpoint-async", "--keep=3", "train.py"])
    assert result.exit_code == 0, result.output
    assert "CHECKPOINT" not in result.output
    assert contract.PERSIST_EVERY_ENV not in result.output


def test_the_config_file_sets_the_checkpoint_options_too(workdir: Path) -> None:
    (workdir / "hpc-elastic.toml").write_text(
        'checkpoint-async = true\nkeep = 7\nlocal-checkpoint-dir = "/local/ckpt"\n'
    )
    result = runner.invoke(cli.app, ["render", "train.py"])
    assert result.exit_code == 0, result.output
    assert f"export {contract.CHECKPOINT_ASYNC_ENV}=1" in result.output
    assert f"export {contract.CHECKPOINT_KEEP_ENV}=7" in result.output
    # The node-local path is the compute nodes': not made relative to the file's directory.
    assert f"export {contract.LOCAL_CHECKPOINT_DIR_ENV}=/local/ckpt" in result.output


@pytest.mark.parametrize(
    ("flag", "quoted"),
    [
        ("--checkpoint-when-busy=maybe", "'maybe'"),
        ("--keep=0", "'0'"),
        ("--keep-every=-1", "'-1'"),
        ("--persist-every=0", "'0'"),
        ("--local-checkpoint-dir=s3://bucket/ckpt", "'s3://bucket/ckpt'"),
    ],
)
def test_a_bad_checkpoint_option_is_one_sentence_quoting_it(
    workdir: Path, flag: str, quoted: str
) -> None:
    result = runner.invoke(cli.app, ["render", flag, "train.py"])
    assert result.exit_code == 2
    assert quoted in result.output
    assert "Traceback" not in result.output


RUN_FLAGS: dict[str, tuple[str, object]] = {
    "nodes": ("--nodes=2:3", NodeRange(2, 3)),
    "nproc_per_node": ("--nproc-per-node=2", 2),
    "max_restarts": ("--max-restarts=0", 0),
    "job_name": ("--job-name=mine", "mine"),
    "log_dir": ("--log-dir=elsewhere", Path("elsewhere")),
    "prewarm": ("--no-prewarm", False),
    "in_place": ("--in-place", True),
}
"""A flag of each option ``LocalRun`` declares, and the value it gives the field."""


def run_given(args: list[str], monkeypatch: pytest.MonkeyPatch) -> local.LocalRun:
    """The ``LocalRun`` that ``hpc-elastic run ARGS`` hands local mode (which runs nothing)."""
    seen: list[local.LocalRun] = []

    def run_local(run: local.LocalRun, _say: object) -> int:
        seen.append(run)
        return 0

    monkeypatch.setattr(run_command, "run_local", run_local)
    result = runner.invoke(cli.app, ["run", *args])
    assert result.exit_code == 0, result.output
    [run] = seen
    return run


def test_each_option_of_run_reaches_its_local_run_field(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert list(RUN_FLAGS) == [row.name for row in local.OPTIONS]
    run = run_given([flag for flag, _ in RUN_FLAGS.values()] + ["train.py"], monkeypatch)
    assert {name: getattr(run, name) for name in RUN_FLAGS} == {
        name: value for name, (_, value) in RUN_FLAGS.items()
    }


def test_run_without_options_takes_submits_defaults_and_the_scripts_name(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = run_given(["train.py"], monkeypatch)
    submitted = JobSpec(script=workdir / "train.py")
    for row in local.OPTIONS:
        expected = "train" if row.name == "job_name" else getattr(submitted, row.name)
        assert getattr(run, row.name) == expected, row.name
    assert run == local.LocalRun(script=run.script, job_name="train", python=run.python)


def test_every_option_of_run_is_a_field_and_its_own_come_after_the_shared_ones() -> None:
    names = [row.name for row in RUN_OPTIONS]
    assert names == [
        *(row.name for row in local.OPTIONS),
        *(row.name for row in CHECKPOINT_OPTIONS),
        *(row.name for row in local.EXTRA_OPTIONS),
    ]
    assert [row.name for row in local.EXTRA_OPTIONS] == [
        field.name for field in dataclasses.fields(local.RunExtras)
    ]


def test_runs_own_options_reach_its_local_run(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = ["--simulate-churn", "--churn-every=5:9", "--churn-downtime=3", "--seed=7"]
    run = run_given([*flags, "--metrics-port=9100", "--tee", "train.py"], monkeypatch)
    assert run.churn == local.Churn((5.0, 9.0), 3.0)
    assert (run.seed, run.metrics_port, run.tee) == (7, 9100, True)


def test_run_without_its_own_options_simulates_nothing_and_shows_nothing(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = run_given(["--churn-every=5:9", "train.py"], monkeypatch)  # no --simulate-churn
    assert (run.churn, run.seed, run.metrics_port, run.tee) == (None, 0, None, False)
    assert local.RunExtras().run_fields() == {
        "churn": None,
        "seed": 0,
        "metrics_port": None,
        "tee": False,
    }


@pytest.mark.parametrize(
    ("flag", "quoted"),
    [("--churn-every=9:1", "'9:1'"), ("--churn-downtime=-1", "'-1'"), ("--seed=x", "'x'")],
)
def test_a_bad_option_of_runs_own_is_one_sentence_quoting_it(
    workdir: Path, flag: str, quoted: str
) -> None:
    """Refused before anything runs, with --simulate-churn or without."""
    result = runner.invoke(cli.app, ["run", flag, "train.py"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ")
    assert quoted in result.stderr
    assert result.stderr.count("\n") == 1


def test_local_mode_passes_the_checkpoint_options_to_its_agents() -> None:
    settings = resolve(
        RUN_OPTIONS,
        {"keep": 5, "checkpoint_async": True},
        lambda name: name in {"keep", "checkpoint_async"},
        {},
    )
    assert dict(job_environment(settings, CHECKPOINT_OPTIONS)) == {
        contract.CHECKPOINT_ASYNC_ENV: "1",
        contract.CHECKPOINT_KEEP_ENV: "5",
    }


def test_a_checkpoint_url_the_job_exports_reaches_the_workers_untouched(tmp_path: Path) -> None:
    spec = AgentSpec(job_dir=tmp_path, command=("true",))
    node = NodeInfo(node_id="n0", host="127.0.0.1", nproc=1, slot="0")
    rdzv_round = Round(1, (node,), "127.0.0.1", 29500, 0, 3)
    paths = WorkerPaths(tmp_path / "log", tmp_path / "error", tmp_path / "heartbeat")

    def env_over(base: dict[str, str]) -> dict[str, str]:
        return worker_env(base, spec, rdzv_round, node=node, run_id="r", local_rank=0, paths=paths)

    url = "s3://bucket/run-1"
    env = env_over({contract.CHECKPOINT_DIR_ENV: url})
    assert env[contract.CHECKPOINT_DIR_ENV] == url
    assert not (tmp_path / "s3:").exists()
    default = env_over({})
    assert default[contract.CHECKPOINT_DIR_ENV] == str(tmp_path / "checkpoints")
