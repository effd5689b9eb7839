"""`hpc-elastic doctor`: the pure rules on captured settings, then the real local cluster,
once as configured (preemption on) and once through a second slurmctld whose slurm.conf has
the preemption settings removed, which must warn."""

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
from cluster import Cluster, free_port, free_port_block

from hpc_elastic.doctor import Check, Level, parse_config, preemption_checks, version_check

REPO = Path(__file__).resolve().parent.parent

ON = {
    "PreemptType": "preempt/partition_prio",
    "PreemptMode": "REQUEUE",
    "SlurmctldParameters": "preempt_send_user_signal",
    "JobRequeue": "1",
}
LOW = {"PartitionName": "low", "PreemptMode": "REQUEUE", "GraceTime": "20"}


def levels(checks: list[Check]) -> dict[str, Level]:
    return {check.name: check.level for check in checks}


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


def test_version_and_config_parsing() -> None:
    assert version_check("slurm-wlm 22.05.8\n").level is Level.PASS
    assert version_check("slurm 19.05.5").level is Level.WARN
    text = "Configuration data as of ...\nPreemptMode             = REQUEUE\nJobRequeue = 1\n"
    assert parse_config(text) == {"PreemptMode": "REQUEUE", "JobRequeue": "1"}


def doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "doctor", *args],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def marks(output: str) -> dict[str, str]:
    """``{"PreemptType": "PASS", ...}`` from doctor's lines."""
    return dict(
        (name, level)
        for level, name in re.findall(r"^. (PASS|WARN|FAIL)  ([^:]+):", output, re.MULTILINE)
    )


def test_unreachable_zookeeper_fails_with_one_clear_line(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": "/nonexistent"}
    result = doctor(env, "--zk", f"127.0.0.1:{free_port()}", "--checkpoint-dir", str(tmp_path))
    assert result.returncode == 1
    found = marks(result.stdout)
    assert found["ZooKeeper"] == "FAIL"
    assert found["Slurm tools"] == "FAIL"
    assert found["shared filesystem"] == "WARN"
    assert "is unreachable" in result.stdout


def test_bad_zk_flag_is_a_usage_error(tmp_path: Path) -> None:
    result = doctor(dict(os.environ), "--zk", "nohost")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ")
    assert "--zk 'nohost'" in result.stderr


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
