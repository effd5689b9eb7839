"""``hpc-elastic doctor``: is this cluster ready for an elastic job? One line per check.

It asks what the first submit would otherwise find out the hard way: the Slurm tools and
version, the partition, the preemption settings and what they mean for an elastic job,
ZooKeeper and its latency, and whether the checkpoint directory is writable and shared
between nodes. Doctor probes the Slurm tools themselves, so it runs them directly.
"""

from __future__ import annotations

import enum
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from hpc_elastic.config import DEFAULT_ZK, load_config
from hpc_elastic.errors import UsageError
from hpc_elastic.spec import parse_zk

TOOLS = ("sbatch", "srun", "scontrol", "squeue")
MIN_SLURM = (20, 11)
"""Array tasks with per-task requeue and ``--signal=B:`` behave as documented from here on."""
TIMEOUT = 30.0


class Level(enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"

    @property
    def mark(self) -> str:
        return {"pass": "✓", "warn": "!", "fail": "✗"}[self.value]


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    message: str
    hint: str = ""

    def lines(self) -> list[str]:
        head = f"{self.level.mark} {self.level.value.upper()}  {self.name}: {self.message}"
        return [head, f"         hint: {self.hint}"] if self.hint else [head]


Run = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def run_tool(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return subprocess.CompletedProcess(list(argv), 127, "", str(error))


# --- pure rules ----------------------------------------------------------------------------


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Key = Value`` lines."""
    pairs = (line.split("=", 1) for line in text.splitlines() if " = " in line)
    return {key.strip(): value.strip() for key, value in pairs}


def parse_record(text: str) -> dict[str, str]:
    """One ``scontrol -o show ...`` line: ``Key=Value`` pairs (values without spaces)."""
    return dict(re.findall(r"(\w+)=(\S*)", text.strip().splitlines()[0] if text.strip() else ""))


def version_check(text: str) -> Check:
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return Check("Slurm version", Level.WARN, f"cannot read '{text.strip()}'")
    found = (int(match.group(1)), int(match.group(2)))
    if found < MIN_SLURM:
        return Check(
            "Slurm version",
            Level.WARN,
            f"{match.group(0)} is older than {MIN_SLURM[0]}.{MIN_SLURM[1]}",
            "per-task requeue of job arrays may misbehave; test preemption before relying on it",
        )
    return Check("Slurm version", Level.PASS, match.group(0))


def preemption_checks(config: Mapping[str, str], partition: Mapping[str, str]) -> list[Check]:
    """What the cluster's preemption settings mean for an elastic job in ``partition``."""
    checks = []
    preempt_type = config.get("PreemptType", "preempt/none")
    mode = partition.get("PreemptMode") or config.get("PreemptMode", "OFF")
    name = partition.get("PartitionName", "?")
    if preempt_type == "preempt/none":
        checks.append(
            Check(
                "PreemptType",
                Level.WARN,
                "preemption is off (preempt/none): nodes never come back to an elastic job "
                "once others need them, and idle nodes are never lent to it",
                "ask for PreemptType=preempt/partition_prio (or preempt/qos) with "
                "PreemptMode=REQUEUE to run on borrowed nodes",
            )
        )
    else:
        checks.append(Check("PreemptType", Level.PASS, preempt_type))
    mode_word = mode.split(",")[0].upper()
    if mode_word == "REQUEUE":
        checks.append(
            Check(
                "PreemptMode",
                Level.PASS,
                f"{mode} in partition '{name}': a preempted array task is requeued and its "
                "agent rejoins when it runs again",
            )
        )
    elif mode_word == "OFF":
        checks.append(
            Check(
                "PreemptMode",
                Level.PASS if preempt_type == "preempt/none" else Level.WARN,
                f"OFF in partition '{name}': its jobs are never preempted",
                ""
                if preempt_type == "preempt/none"
                else "use a preemptible partition to "
                "soak up idle nodes; MIN:MAX then still absorbs node failures",
            )
        )
    else:
        checks.append(
            Check(
                "PreemptMode",
                Level.WARN,
                f"{mode} in partition '{name}': a preempted task is "
                + ("cancelled for good" if mode_word == "CANCEL" else "suspended, not requeued"),
                "an elastic job shrinks and stays smaller; ask for PreemptMode=REQUEUE",
            )
        )
    parameters = config.get("SlurmctldParameters", "")
    if "preempt_send_user_signal" in parameters.split(","):
        checks.append(
            Check(
                "preempt_send_user_signal",
                Level.PASS,
                "a preempted task gets the job's --signal (USR2) at GraceTime, so workers "
                "checkpoint before they stop",
            )
        )
    else:
        checks.append(
            Check(
                "preempt_send_user_signal",
                Level.WARN,
                "not in SlurmctldParameters: a preempted task gets SIGTERM, not --signal",
                "workers still save on SIGTERM but get only the partition's GraceTime; ask "
                "for SlurmctldParameters=preempt_send_user_signal",
            )
        )
    requeue = config.get("JobRequeue", "1")
    checks.append(
        Check(
            "JobRequeue",
            Level.PASS,
            f"{requeue}: "
            + (
                "jobs are requeueable by default"
                if requeue == "1"
                else "jobs are not requeueable by default; hpc-elastic's scripts ask for "
                "--requeue themselves"
            ),
        )
    )
    grace = partition.get("GraceTime", "0")
    if mode_word == "REQUEUE" and grace in ("0", "00:00:00"):
        checks.append(
            Check(
                "GraceTime",
                Level.WARN,
                f"0 in partition '{name}': preempted tasks are killed at once",
                "workers lose the steps since their last checkpoint; ask for a GraceTime of "
                "a minute or more",
            )
        )
    return checks


# --- probes --------------------------------------------------------------------------------


def slurm_checks(partition: str | None, run: Run) -> tuple[list[Check], str | None]:
    """Tools, version, controller, partition and preemption; also the partition to use."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return [
            Check(
                "Slurm tools",
                Level.FAIL,
                f"{', '.join(missing)} not found on PATH",
                "run doctor on a login node, or load Slurm (e.g. `module load slurm`)",
            )
        ], None
    checks = [Check("Slurm tools", Level.PASS, ", ".join(TOOLS) + " found")]
    checks.append(version_check(run(["scontrol", "--version"]).stdout))
    shown = run(["scontrol", "show", "config"])
    if shown.returncode != 0:
        checks.append(
            Check(
                "slurmctld",
                Level.FAIL,
                f"`scontrol show config` failed: {_last_line(shown.stderr)}",
                "check `scontrol ping` and SLURM_CONF",
            )
        )
        return checks, None
    config = parse_config(shown.stdout)
    record, partition = _partition(partition, run)
    if record is None:
        known = run(["sinfo", "-h", "-o", "%R"]).stdout.split()
        checks.append(
            Check(
                "partition",
                Level.FAIL,
                f"'{partition or '(default)'}' does not exist",
                f"pick one of {', '.join(dict.fromkeys(known)) or '(none)'} with --partition",
            )
        )
        return checks, None
    checks.append(
        Check(
            "partition",
            Level.PASS,
            f"'{partition}' exists: nodes {record.get('Nodes', '?')}, "
            f"{record.get('TotalNodes', '?')} in all, MaxTime {record.get('MaxTime', '?')}",
        )
    )
    checks.extend(preemption_checks(config, record))
    return checks, partition


def _partition(name: str | None, run: Run) -> tuple[dict[str, str] | None, str | None]:
    shown = run(["scontrol", "-o", "show", "partition", *([name] if name else [])])
    if shown.returncode != 0:
        return None, name
    for line in shown.stdout.splitlines():
        record = parse_record(line)
        if (name is None and record.get("Default") == "YES") or record.get("PartitionName") == name:
            return record, record.get("PartitionName")
    return None, name


def zookeeper_check(hosts: str, samples: int = 5) -> Check:
    """Each server's ``srvr`` answer and round-trip time; a quorum must answer."""
    servers = hosts.split("/", maxsplit=1)[0].split(",")
    answers: list[str] = []
    failures: list[str] = []
    for server in servers:
        host, _, port = server.rpartition(":")
        try:
            times = [_round_trip(host, int(port))[0] for _ in range(samples)]
            version = _round_trip(host, int(port))[1]
        except OSError as error:
            failures.append(f"{server} ({error.strerror or error})")
            continue
        answers.append(f"{server} {version} in {statistics.median(times) * 1000:.1f} ms")
    if len(answers) * 2 > len(servers):
        return Check(
            "ZooKeeper",
            Level.WARN if failures else Level.PASS,
            "; ".join(answers) + (f"; unreachable: {', '.join(failures)}" if failures else ""),
            "a server of the ensemble is down" if failures else "",
        )
    return Check(
        "ZooKeeper",
        Level.FAIL,
        f"'{hosts}' is unreachable: {', '.join(failures)}",
        "check --zk (or HPC_ELASTIC_ZK) and that the ensemble runs",
    )


def _round_trip(host: str, port: int) -> tuple[float, str]:
    """Seconds for one ``srvr`` exchange, and the server version it reports."""
    start = time.perf_counter()
    with socket.create_connection((host, port), timeout=3) as connection:
        connection.sendall(b"srvr")
        reply = b""
        while chunk := connection.recv(4096):
            reply += chunk
    elapsed = time.perf_counter() - start
    match = re.search(rb"version: ([\d.]+)", reply)
    return elapsed, f"ZooKeeper {match.group(1).decode()}" if match else "answers"


def checkpoint_checks(
    directory: Path, partition: str | None, slurm_ok: bool, run: Run
) -> list[Check]:
    """Writable here, and readable from a compute node (one short ``srun``)."""
    marker = directory / f".hpc-elastic-doctor-{secrets.token_hex(4)}"
    token = secrets.token_hex(8)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
    except OSError as error:
        return [
            Check(
                "checkpoint dir",
                Level.FAIL,
                f"'{directory}' is not writable ({error.strerror})",
                "give a writable --checkpoint-dir on a shared filesystem",
            )
        ]
    checks = [Check("checkpoint dir", Level.PASS, f"'{directory}' is writable")]
    try:
        if not slurm_ok:
            checks.append(
                Check(
                    "shared filesystem",
                    Level.WARN,
                    "not checked: Slurm is not usable here",
                    "make sure every node mounts the checkpoint directory at the same path",
                )
            )
            return checks
        argv = ["srun", "-N1", "-n1", "--immediate=20", "--time=1", "--quiet"]
        argv += [*(["-p", partition] if partition else []), "cat", str(marker)]
        result = run(argv)
        if result.returncode == 0 and result.stdout.strip() == token:
            checks.append(
                Check("shared filesystem", Level.PASS, "a compute node reads what is written here")
            )
        elif "No such file" in result.stderr:
            checks.append(
                Check(
                    "shared filesystem",
                    Level.FAIL,
                    f"compute nodes do not see '{directory}'",
                    "put checkpoints on a filesystem every node mounts (e.g. /scratch, $HOME)",
                )
            )
        else:
            checks.append(
                Check(
                    "shared filesystem",
                    Level.WARN,
                    f"no one-node step could run to check it ({_last_line(result.stderr)})",
                    "rerun doctor when the partition has an idle node",
                )
            )
    finally:
        marker.unlink(missing_ok=True)
    return checks


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1].rstrip(".") if lines else "no message"


def diagnose(
    partition: str | None, zk: str, checkpoint_dir: Path, run: Run = run_tool
) -> list[Check]:
    checks, chosen = slurm_checks(partition, run)
    checks.append(zookeeper_check(zk))
    checks.extend(checkpoint_checks(checkpoint_dir, chosen, chosen is not None, run))
    return checks


def doctor_command(
    partition: Annotated[
        str | None, typer.Option(metavar="NAME", help="Partition to check; default: Slurm's.")
    ] = None,
    zk: Annotated[
        str | None,
        typer.Option(
            parser=parse_zk,
            metavar="HOST:PORT[,...]",
            help=f"ZooKeeper to check. Default: $HPC_ELASTIC_ZK, the config file, or {DEFAULT_ZK}.",
        ),
    ] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(metavar="DIR", help="Where jobs will write. Default: ./hpc-elastic-runs."),
    ] = None,
) -> None:
    """Check a cluster before the first submit: one line per check, pass, warn or fail."""
    values = load_config(Path.cwd()).values
    address = zk or str(values.get("zk", DEFAULT_ZK))
    directory = checkpoint_dir or Path(str(values.get("log_dir", "hpc-elastic-runs")))
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--checkpoint-dir '{directory}' is a file; give a directory.")
    checks = diagnose(partition, address, directory.absolute())
    for check in checks:
        for line in check.lines():
            typer.echo(line)
    failed = sum(check.level is Level.FAIL for check in checks)
    warned = sum(check.level is Level.WARN for check in checks)
    typer.echo(f"{len(checks)} checks: {failed} failed, {warned} warnings.")
    raise typer.Exit(1 if failed else 0)
