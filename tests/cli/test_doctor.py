"""`hpc-elastic doctor`: the pure rules on captured settings; the probes on a fake Slurm at the
Slurm layer's one subprocess call (`tests/slurm_fake.py`); then the real local cluster, once
as configured (preemption on) and once through a second slurmctld whose slurm.conf has the
preemption settings removed, which must warn."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster import Cluster, free_port, free_port_block
from slurm_fake import FakeSlurm, Reply, mocked_slurm

from hpc_elastic import cli
from hpc_elastic.doctor import (
    Diagnosis,
    Level,
    checkpoint_checks,
    container_checks,
    preemption_checks,
    slurm_checks,
    version_check,
)
from hpc_elastic.slurm import commands

REPO = Path(__file__).resolve().parents[2]

ON = {
    "PreemptType": "preempt/partition_prio",
    "PreemptMode": "REQUEUE",
    "SlurmctldParameters": "preempt_send_user_signal",
    "JobRequeue": "1",
}
LOW = {"PartitionName": "low", "PreemptMode": "REQUEUE", "GraceTime": "20"}

# What Slurm 22.05 prints on the dev cluster (scripts/dev-cluster), shortened.
SHOW_CONFIG = """\
Configuration data as of 2026-11-29T10:12:01
AuthType                = auth/munge
JobRequeue              = 1
PreemptMode             = REQUEUE
PreemptType             = preempt/partition_prio
PreemptExemptTime       = 00:00:00
SlurmctldParameters     = preempt_send_user_signal
SlurmctldPort           = 6817

Cgroup Support Configuration:
CgroupMountpoint        = /sys/fs/cgroup
"""
SHOW_CONFIG_WITHOUT_PREEMPTION = """\
Configuration data as of 2026-11-29T10:12:01
JobRequeue              = 1
PreemptMode             = OFF
PreemptType             = preempt/none
SlurmctldParameters     = (null)
"""
PARTITION_HIGH = (
    "PartitionName=high AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL "
    "Default=NO QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 "
    "Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 LLN=NO "
    "MaxCPUsPerNode=UNLIMITED Nodes=n[1-4] PriorityJobFactor=1 PriorityTier=10 RootOnly=NO "
    "ReqResv=NO OverSubscribe=EXCLUSIVE OverTimeLimit=NONE PreemptMode=OFF State=UP "
    "TotalCPUs=4 TotalNodes=4 SelectTypeParameters=NONE JobDefaults=(null) "
    "DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=4,mem=4000M,node=4,billing=4\n"
)
PARTITION_LOW = (
    PARTITION_HIGH.replace("PartitionName=high", "PartitionName=low")
    .replace("Default=NO", "Default=YES")
    .replace("GraceTime=0", "GraceTime=20")
    .replace("PriorityTier=10", "PriorityTier=1")
    .replace("PreemptMode=OFF", "PreemptMode=REQUEUE")
)
NO_SUCH_FILE = (
    "cat: {path}: No such file or directory\nsrun: error: n1: task 0: Exited with exit code 1\n"
)


def levels(checks: list[Diagnosis]) -> dict[str, Level]:
    return {check.name: check.level for check in checks}


def levels_and_messages(checks: list[Diagnosis]) -> dict[str, str]:
    return {check.name: f"{check.level.value}: {check.message}" for check in checks}


def test_preemption_on_passes() -> None:
    assert set(levels(preemption_checks(ON, LOW)).values()) == {Level.PASS}


def test_preemption_removed_warns() -> None:
    found = levels(preemption_checks({"JobRequeue": "1"}, {"PartitionName": "low"}))
    assert found["PreemptType"] is Level.WARN
    assert found["preempt_send_user_signal"] is Level.WARN
    assert found["PreemptMode"] is Level.PASS


def test_cancel_mode_and_no_grace_warn() -> None:
    found = levels(preemption_checks(ON, {**LOW, "PreemptMode": "CANCEL"}))
    assert found["PreemptMode"] is Level.WARN
    found = levels(preemption_checks(ON, {**LOW, "GraceTime": "0"}))
    assert found["GraceTime"] is Level.WARN


def test_a_partition_that_is_never_preempted_warns_only_when_preemption_is_on() -> None:
    high = {"PartitionName": "high", "PreemptMode": "OFF"}
    assert levels(preemption_checks(ON, high))["PreemptMode"] is Level.WARN
    assert levels(preemption_checks({}, high))["PreemptMode"] is Level.PASS


def test_every_warning_says_what_to_do() -> None:
    settings = {"PreemptType": "preempt/partition_prio", "PreemptMode": "SUSPEND,GANG"}
    warnings = [
        check
        for check in preemption_checks(settings, {"PartitionName": "low"})
        if check.level is not Level.PASS
    ]
    assert {check.name for check in warnings} == {"PreemptMode", "preempt_send_user_signal"}
    assert all(check.hint for check in warnings)


def test_version_and_config_parsing() -> None:
    assert version_check("slurm-wlm 22.05.8\n").level is Level.PASS
    assert version_check("slurm 19.05.5").level is Level.WARN
    text = "Configuration data as of ...\nPreemptMode             = REQUEUE\nJobRequeue = 1\n"
    assert commands.parse_scontrol_config(text) == {"PreemptMode": "REQUEUE", "JobRequeue": "1"}


# --- the probes, on a fake Slurm ------------------------------------------------------------


def a_cluster(fake: FakeSlurm, config: str = SHOW_CONFIG) -> None:
    """The dev cluster's answers: partitions low (default, preemptible) and high."""
    fake.answer("scontrol", "show", "config", stdout=config)
    fake.answer("scontrol", "-o", "show", "partition", stdout=PARTITION_HIGH + PARTITION_LOW)
    fake.answer("scontrol", "-o", "show", "partition", "low", stdout=PARTITION_LOW)
    fake.answer("sinfo", "-h", "-o", "%R", stdout="low\nhigh\nlow\nhigh\n")


def a_shared_filesystem(argv: list[str]) -> Reply:
    """A compute node that mounts this host's filesystem: ``srun ... cat PATH`` reads it."""
    return Reply(stdout=Path(argv[-1]).read_text())


def test_a_cluster_with_preemption_on_passes_every_check(tmp_path: Path) -> None:
    with mocked_slurm() as fake:
        a_cluster(fake)
        fake.respond("srun", "-N1", responder=a_shared_filesystem)
        checks, partition = slurm_checks("low")
        checks += checkpoint_checks(tmp_path, partition, slurm_ok=True)
    assert partition == "low", checks
    assert set(levels(checks).values()) == {Level.PASS}, checks
    assert "'low' exists: nodes n[1-4], 4 in all, MaxTime UNLIMITED" in checks[2].message
    [step] = [argv for argv in fake.ran("srun") if "cat" in argv]
    assert step[step.index("-p") + 1] == "low"
    assert not list(tmp_path.iterdir()), "the marker file must be removed"


def test_without_a_partition_slurms_default_partition_is_checked() -> None:
    with mocked_slurm() as fake:
        a_cluster(fake)
        checks, partition = slurm_checks(None)
    assert partition == "low", checks
    assert "'low' exists" in levels_and_messages(checks)["partition"]
    assert "REQUEUE in partition 'low'" in levels_and_messages(checks)["PreemptMode"]
    assert ["scontrol", "-o", "show", "partition"] in fake.calls


def test_a_cluster_without_preemption_warns_with_a_hint_each() -> None:
    with mocked_slurm() as fake:
        a_cluster(fake, SHOW_CONFIG_WITHOUT_PREEMPTION)
        checks, _ = slurm_checks("low")
    found = levels(checks)
    assert found["PreemptType"] is Level.WARN
    assert found["preempt_send_user_signal"] is Level.WARN
    assert all(check.hint for check in checks if check.level is Level.WARN)


def test_missing_slurm_tools_fail_in_one_line_and_nothing_else_is_asked(tmp_path: Path) -> None:
    with mocked_slurm() as fake:
        fake.uninstall("sbatch", "srun")
        checks, partition = slurm_checks("low")
        checks += checkpoint_checks(tmp_path, partition, slurm_ok=partition is not None)
    assert partition is None
    assert checks[0] == Diagnosis(
        "Slurm tools",
        Level.FAIL,
        "sbatch, srun not found on PATH",
        "run doctor on a login node, or load Slurm (e.g. `module load slurm`)",
    )
    assert levels(checks)["shared filesystem"] is Level.WARN
    assert all(argv[1:] == ["--version"] for argv in fake.calls)


def test_a_controller_that_does_not_answer_is_one_failing_sentence() -> None:
    with mocked_slurm() as fake:
        fake.answer(
            "scontrol",
            "show",
            "config",
            returncode=1,
            stderr="slurm_load_ctl_conf error: Unable to contact slurm controller "
            "(connect failure)\n",
        )
        checks, partition = slurm_checks("low")
    assert partition is None
    assert checks[-1].name == "slurmctld"
    assert checks[-1].level is Level.FAIL
    assert "Unable to contact slurm controller (connect failure)" in checks[-1].message
    assert "scontrol ping" in checks[-1].message
    assert "\n" not in checks[-1].message


def test_a_hanging_controller_is_one_failing_sentence() -> None:
    with mocked_slurm() as fake:
        fake.hang("scontrol", "show", "config")
        checks, _ = slurm_checks("low")
    assert checks[-1].level is Level.FAIL
    assert "`scontrol show config` did not answer within 60 s" in checks[-1].message


def test_an_unknown_partition_fails_and_lists_the_real_ones() -> None:
    with mocked_slurm() as fake:
        a_cluster(fake)
        fake.answer(
            "scontrol",
            "-o",
            "show",
            "partition",
            "gpu",
            returncode=1,
            stdout="Partition gpu not found\n",
        )
        checks, partition = slurm_checks("gpu")
    assert partition is None
    assert checks[-1] == Diagnosis(
        "partition", Level.FAIL, "'gpu' does not exist", "pick one of low, high with --partition"
    )


def test_compute_nodes_that_do_not_see_the_directory_fail(tmp_path: Path) -> None:
    with mocked_slurm() as fake:
        fake.respond(
            "srun",
            "-N1",
            responder=lambda argv: Reply(stderr=NO_SUCH_FILE.format(path=argv[-1]), returncode=1),
        )
        checks = checkpoint_checks(tmp_path, "low", slurm_ok=True)
    found = levels(checks)
    assert found == {"checkpoint dir": Level.PASS, "shared filesystem": Level.FAIL}
    assert f"compute nodes do not see '{tmp_path}'" in checks[-1].message


def test_a_partition_without_an_idle_node_warns_instead_of_failing(tmp_path: Path) -> None:
    with mocked_slurm() as fake:
        fake.answer(
            "srun",
            "-N1",
            returncode=1,
            stderr="srun: error: Unable to allocate resources: Requested nodes are busy\n",
        )
        checks = checkpoint_checks(tmp_path, "low", slurm_ok=True)
    assert checks[-1].level is Level.WARN
    assert "Requested nodes are busy" in checks[-1].message
    assert "rerun when the partition has an idle node" in checks[-1].message


def marks(output: str) -> dict[str, str]:
    """``{"PreemptType": "PASS", ...}`` from doctor's lines."""
    return dict(
        (name, level)
        for level, name in re.findall(r"^. (PASS|WARN|FAIL)  ([^:]+):", output, re.MULTILINE)
    )


def test_unreachable_zookeeper_fails_with_one_clear_line(tmp_path: Path) -> None:
    with mocked_slurm() as fake:
        fake.uninstall("sbatch", "srun", "scontrol", "squeue")
        result = CliRunner().invoke(
            cli.app,
            ["doctor", "--zk", f"127.0.0.1:{free_port()}", "--checkpoint-dir", str(tmp_path)],
        )
    assert result.exit_code == 1
    found = marks(result.stdout)
    assert found["ZooKeeper"] == "FAIL"
    assert found["Slurm tools"] == "FAIL"
    assert found["shared filesystem"] == "WARN"
    assert "is unreachable" in result.stdout


def test_bad_zk_flag_is_a_usage_error() -> None:
    with mocked_slurm() as fake:
        result = CliRunner().invoke(cli.app, ["doctor", "--zk", "nohost"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ")
    assert "--zk 'nohost'" in result.stderr
    assert fake.calls == []


def doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "doctor", *args],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.integration
def test_the_dev_cluster_with_preemption_on_passes(cluster: Cluster, tmp_path: Path) -> None:
    result = doctor(
        cluster.env,
        "--partition=low",
        f"--zk={cluster.zk_hosts}",
        f"--checkpoint-dir={tmp_path}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    found = marks(result.stdout)
    assert set(found.values()) == {"PASS"}, result.stdout
    for name in ("Slurm version", "partition", "PreemptMode", "preempt_send_user_signal"):
        assert name in found
    assert found["shared filesystem"] == "PASS"
    assert re.search(r"ZooKeeper: 127\.0\.0\.1:\d+ ZooKeeper [\d.]+ in [\d.]+ ms", result.stdout)


@pytest.fixture
def without_preemption(cluster: Cluster, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A second slurmctld (no slurmd: its nodes point at unused ports) whose slurm.conf lacks
    every preemption setting; the environment of its clients."""
    state = tmp_path / "ctld2"
    (state / "ctld").mkdir(parents=True)
    base = free_port_block(4)
    substitutions = [
        (r" PreemptMode=\S+| GraceTime=\S+", ""),
        (r"^SlurmctldPort=\d+", f"SlurmctldPort={free_port()}"),
        (r"^StateSaveLocation=.*", f"StateSaveLocation={state}/ctld"),
        (r"^SlurmctldPidFile=.*", f"SlurmctldPidFile={state}/ctld.pid"),
        (r"^SlurmctldLogFile=.*", f"SlurmctldLogFile={state}/ctld.log"),
        (r" Port=\[\d+-\d+\]", f" Port=[{base}-{base + 3}]"),
    ]
    lines = []
    for original in cluster.slurm_conf.read_text().splitlines():
        if original.startswith(("PreemptType", "PreemptMode", "SlurmctldParameters")):
            continue
        if original.startswith(("NodeName=s", "PartitionName=service")):
            continue  # a cluster's service nodes (dev-cluster --service-nodes): not needed here
        line = original
        for pattern, replacement in substitutions:
            line = re.sub(pattern, replacement, line)
        lines.append(line)
    conf = state / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    env = {**cluster.env, "SLURM_CONF": str(conf)}
    subprocess.run(["slurmctld", "-f", str(conf), "-i"], env=env, check=True, timeout=30)
    pid_file = state / "ctld.pid"
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ping = subprocess.run(
                ["scontrol", "ping"], env=env, capture_output=True, text=True, check=False
            )
            if "is UP" in ping.stdout:
                break
            time.sleep(0.2)
        yield env
    finally:
        if pid_file.exists():
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.1)


@pytest.mark.integration
def test_a_cluster_without_preemption_settings_warns(
    cluster: Cluster, without_preemption: dict[str, str], tmp_path: Path
) -> None:
    result = doctor(
        without_preemption,
        "--partition=low",
        f"--zk={cluster.zk_hosts}",
        f"--checkpoint-dir={tmp_path}",
    )
    found = marks(result.stdout)
    assert found["partition"] == "PASS", result.stdout
    assert found["PreemptType"] == "WARN"
    assert found["preempt_send_user_signal"] == "WARN"
    assert "hint: " in result.stdout
    assert result.returncode == 0, result.stdout


def test_a_checkpoint_url_is_reported_unchecked_and_nothing_is_made_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with mocked_slurm() as fake:
        fake.uninstall("sbatch", "srun", "scontrol", "squeue")
        result = CliRunner().invoke(
            cli.app,
            ["doctor", "--zk", f"127.0.0.1:{free_port()}", "--checkpoint-dir", "s3://bucket/run"],
        )
    assert marks(result.stdout)["checkpoint dir"] == "WARN"
    assert "'s3://bucket/run' is an object store" in result.stdout
    assert list(tmp_path.iterdir()) == []


# --- container runtimes (issue 14), on the fake Slurm ---------------------------------------

SRUN_HELP = """\
Usage: srun [OPTIONS(0)... [executable(0) [args(0)...]]] [ : [OPTIONS(N)...]] executable(N)

Parallel run options:
  -A, --account=name          charge job to specified account
      --overlap               Allow other steps to overlap this step
"""
PYXIS_HELP = (
    SRUN_HELP
    + """
Options provided by plugins:
      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH
                              [pyxis] the image to use for the container
      --container-mounts=SRC:DST[:FLAGS][,SRC:DST...]
                              [pyxis] bind mount[s] inside the container
"""
)


def test_doctor_says_srun_has_pyxis_when_its_help_lists_the_container_options() -> None:
    with mocked_slurm() as fake:
        fake.answer("srun", "--help", stdout=PYXIS_HELP)
        pyxis, apptainer = container_checks()
    assert pyxis == Diagnosis(
        "pyxis",
        Level.PASS,
        "srun has --container-image and --container-mounts: --container-image IMAGE works",
    )
    assert apptainer.message.startswith("not on PATH here: --apptainer cannot be used")
    assert ["apptainer", "--version"] in fake.calls


def test_doctor_says_what_to_use_instead_when_srun_has_no_pyxis() -> None:
    with mocked_slurm() as fake:
        fake.answer("srun", "--help", stdout=SRUN_HELP)
        fake.answer("apptainer", "--version", stdout="apptainer version 1.3.4\n")
        fake.install("apptainer")
        pyxis, apptainer = container_checks()
    assert pyxis.message == (
        "srun has no --container-image or --container-mounts (no pyxis plugin): "
        "--container-image cannot be used here; use --apptainer IMAGE, or ask the admins for pyxis"
    )
    assert apptainer.message.startswith("found on PATH here (the compute nodes need it too)")


def test_doctor_prints_the_container_lines_and_no_srun_means_not_checked(tmp_path: Path) -> None:
    with mocked_slurm() as fake:
        fake.uninstall("sbatch", "srun", "scontrol", "squeue")
        result = CliRunner().invoke(
            cli.app,
            ["doctor", "--zk", f"127.0.0.1:{free_port()}", "--checkpoint-dir", str(tmp_path)],
        )
    assert "✓ PASS  pyxis: not checked: srun is not usable here\n" in result.stdout
    assert "✓ PASS  apptainer: not on PATH here" in result.stdout


def test_doctor_says_what_a_failure_costs_and_which_flag_makes_restarts_warm() -> None:
    from hpc_elastic.doctor import restart_rule  # noqa: PLC0415

    warm = restart_rule(6.0, prewarm=True)
    assert warm.level is Level.PASS
    assert "after 6 s (--session-timeout" in warm.message
    cold = restart_rule(2.0, prewarm=False)
    assert cold.level is Level.WARN
    assert "imports torch again" in cold.message
    assert "after 2 s" in cold.message
    assert "--no-prewarm" in cold.hint
