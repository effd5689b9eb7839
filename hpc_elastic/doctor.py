"""``hpc-elastic doctor``: is this cluster ready for an elastic job? One line per check.

It asks what the first submit would otherwise find out the hard way: the Slurm tools and
version, the partition, the preemption settings and what they mean for an elastic job,
ZooKeeper and its latency, the nodes the user's jobs keep away from
(``hpc-elastic nodes``), the container runtimes (pyxis, Apptainer), and whether the
checkpoint directory is writable and shared between nodes. Slurm is asked through the Slurm
layer (``hpc_elastic.slurm.commands``), like every other command; what the answers mean is
decided here, by small rule functions that each turn settings into one finding with a
severity and a one-sentence fix.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import secrets
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.agent import badnodes
from hpc_elastic.contract import (
    DEFAULT_SESSION_TIMEOUT,
    DEFAULT_USER_SECRET_FILE,
    USER_SECRET_FILE_ENV,
    ZK_ENV,
)
from hpc_elastic.ensemble import fourletter, zoocfg
from hpc_elastic.ensemble.choice import ZkChoice
from hpc_elastic.errors import HpcElasticError, SlurmError, one_line
from hpc_elastic.rendezvous.badnode import BadNode
from hpc_elastic.slurm import commands, grace

log = logging.getLogger(__name__)

TOOLS = ("sbatch", "srun", "scontrol", "squeue")
MIN_SLURM = (20, 11)
"""Array tasks with per-task requeue and ``--signal=B:`` behave as documented from here on."""


class Level(enum.Enum):
    """A finding's severity: only FAIL makes doctor exit 1."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"

    @property
    def mark(self) -> str:
        return {"pass": "✓", "warn": "!", "fail": "✗"}[self.value]


@dataclass(frozen=True)
class Diagnosis:
    """One finding: what was checked, its severity, what was seen, and the fix (the hint)."""

    name: str
    level: Level
    message: str
    hint: str = ""

    def lines(self) -> list[str]:
        head = f"{self.level.mark} {self.level.value.upper()}  {self.name}: {self.message}"
        return [head, f"         hint: {self.hint}"] if self.hint else [head]


# --- pure rules ----------------------------------------------------------------------------


def version_check(text: str) -> Diagnosis:
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return Diagnosis("Slurm version", Level.WARN, f"cannot read '{text.strip()}'")
    found = (int(match.group(1)), int(match.group(2)))
    if found < MIN_SLURM:
        return Diagnosis(
            "Slurm version",
            Level.WARN,
            f"{match.group(0)} is older than {MIN_SLURM[0]}.{MIN_SLURM[1]}",
            "per-task requeue of job arrays may misbehave; test preemption before relying on it",
        )
    return Diagnosis("Slurm version", Level.PASS, match.group(0))


@dataclass(frozen=True)
class Preemption:
    """The settings that decide what preemption does to an elastic job in one partition,
    with Slurm's defaults where slurm.conf is silent."""

    partition: str
    preempt_type: str
    mode: str
    """The partition's PreemptMode, else the cluster's: ``REQUEUE``, ``OFF``, ``SUSPEND,GANG``..."""
    slurmctld_parameters: tuple[str, ...]
    job_requeue: str
    grace_time: str

    @classmethod
    def read(cls, config: Mapping[str, str], partition: Mapping[str, str]) -> Preemption:
        """From ``scontrol show config`` and the partition's ``scontrol show partition`` record."""
        return cls(
            partition=partition.get("PartitionName", "?"),
            preempt_type=config.get("PreemptType", "preempt/none"),
            mode=partition.get("PreemptMode") or config.get("PreemptMode", "OFF"),
            slurmctld_parameters=tuple(config.get("SlurmctldParameters", "").split(",")),
            job_requeue=config.get("JobRequeue", "1"),
            grace_time=partition.get("GraceTime", "0"),
        )

    @property
    def enabled(self) -> bool:
        return self.preempt_type != "preempt/none"

    @property
    def action(self) -> str:
        """What happens to a preempted job: the first word of PreemptMode (``REQUEUE,GANG``)."""
        return self.mode.split(",")[0].upper()


def preempt_type_rule(settings: Preemption) -> Diagnosis:
    """Without a preemption plugin an elastic job can never borrow idle nodes."""
    if settings.enabled:
        return Diagnosis("PreemptType", Level.PASS, settings.preempt_type)
    return Diagnosis(
        "PreemptType",
        Level.WARN,
        "preemption is off (preempt/none): nodes never come back to an elastic job "
        "once others need them, and idle nodes are never lent to it",
        "ask for PreemptType=preempt/partition_prio (or preempt/qos) with "
        "PreemptMode=REQUEUE to run on borrowed nodes",
    )


def preempt_mode_rule(settings: Preemption) -> Diagnosis:
    """REQUEUE brings a preempted task back; CANCEL and SUSPEND shrink the job for good."""
    where = f"in partition '{settings.partition}'"
    if settings.action == "REQUEUE":
        return Diagnosis(
            "PreemptMode",
            Level.PASS,
            f"{settings.mode} {where}: a preempted array task is requeued and its "
            "agent rejoins when it runs again",
        )
    if settings.action == "OFF":
        return Diagnosis(
            "PreemptMode",
            Level.WARN if settings.enabled else Level.PASS,
            f"OFF {where}: its jobs are never preempted",
            "use a preemptible partition to soak up idle nodes; MIN:MAX then still absorbs "
            "node failures"
            if settings.enabled
            else "",
        )
    fate = "cancelled for good" if settings.action == "CANCEL" else "suspended, not requeued"
    return Diagnosis(
        "PreemptMode",
        Level.WARN,
        f"{settings.mode} {where}: a preempted task is {fate}",
        "an elastic job shrinks and stays smaller; ask for PreemptMode=REQUEUE",
    )


def user_signal_rule(settings: Preemption) -> Diagnosis:
    """Only with preempt_send_user_signal does a preempted task get the job's --signal."""
    if "preempt_send_user_signal" in settings.slurmctld_parameters:
        return Diagnosis(
            "preempt_send_user_signal",
            Level.PASS,
            "a preempted task gets the job's --signal (USR2) at GraceTime, so workers "
            "checkpoint before they stop",
        )
    return Diagnosis(
        "preempt_send_user_signal",
        Level.WARN,
        "not in SlurmctldParameters: a preempted task gets SIGTERM, not --signal",
        "workers still save on SIGTERM but get only the partition's GraceTime; ask "
        "for SlurmctldParameters=preempt_send_user_signal",
    )


def job_requeue_rule(settings: Preemption) -> Diagnosis:
    """Informational: hpc-elastic's scripts pass --requeue, so either value works."""
    meaning = (
        "jobs are requeueable by default"
        if settings.job_requeue == "1"
        else "jobs are not requeueable by default; hpc-elastic's scripts ask for "
        "--requeue themselves"
    )
    return Diagnosis("JobRequeue", Level.PASS, f"{settings.job_requeue}: {meaning}")


def grace_time_rule(settings: Preemption) -> Diagnosis | None:
    """A requeued task without GraceTime is killed before its workers can checkpoint."""
    if settings.action != "REQUEUE" or settings.grace_time not in ("0", "00:00:00"):
        return None
    return Diagnosis(
        "GraceTime",
        Level.WARN,
        f"0 in partition '{settings.partition}': preempted tasks are killed at once",
        "workers lose the steps since their last checkpoint; ask for a GraceTime of "
        "a minute or more",
    )


PreemptionRule = Callable[[Preemption], Diagnosis | None]
PREEMPTION_RULES: tuple[PreemptionRule, ...] = (
    preempt_type_rule,
    preempt_mode_rule,
    user_signal_rule,
    job_requeue_rule,
    grace_time_rule,
)
"""Run in this order; a rule that has nothing to say returns None."""


def preemption_checks(config: Mapping[str, str], partition: Mapping[str, str]) -> list[Diagnosis]:
    """What the cluster's preemption settings mean for an elastic job in ``partition``."""
    settings = Preemption.read(config, partition)
    return [check for rule in PREEMPTION_RULES if (check := rule(settings)) is not None]


def partition_check(record: Mapping[str, str]) -> Diagnosis:
    return Diagnosis(
        "partition",
        Level.PASS,
        f"'{record.get('PartitionName', '?')}' exists: nodes {record.get('Nodes', '?')}, "
        f"{record.get('TotalNodes', '?')} in all, MaxTime {record.get('MaxTime', '?')}",
    )


def unknown_partition_check(name: str | None, known: list[str]) -> Diagnosis:
    return Diagnosis(
        "partition",
        Level.FAIL,
        f"'{name or '(default)'}' does not exist",
        f"pick one of {', '.join(known) or '(none)'} with --partition",
    )


# --- probes: ask Slurm, ZooKeeper and the filesystem, then apply the rules -----------------


def slurm_checks(partition: str | None) -> tuple[list[Diagnosis], str | None]:
    """Tools, version, controller, partition and preemption; also the partition to use
    (None when Slurm is not usable, which skips the shared-filesystem step)."""
    missing = commands.missing_tools(TOOLS)
    if missing:
        return [
            Diagnosis(
                "Slurm tools",
                Level.FAIL,
                f"{', '.join(missing)} not found on PATH",
                "run doctor on a login node, or load Slurm (e.g. `module load slurm`)",
            )
        ], None
    checks = [Diagnosis("Slurm tools", Level.PASS, ", ".join(TOOLS) + " found"), _version_probe()]
    try:
        config = commands.show_config()
        record = commands.partition_record(partition)
        known = commands.partitions() if record is None else []
    except SlurmError as error:
        log.debug("doctor: Slurm is not usable: %s", error)
        return [*checks, Diagnosis("slurmctld", Level.FAIL, str(error))], None
    if record is None:
        return [*checks, unknown_partition_check(partition, known)], None
    log.debug("doctor: checking partition %s", record.get("PartitionName"))
    return [
        *checks,
        partition_check(record),
        *preemption_checks(config, record),
    ], record.get("PartitionName")


def _version_probe() -> Diagnosis:
    try:
        return version_check(commands.slurm_version())
    except SlurmError as error:
        return Diagnosis("Slurm version", Level.WARN, str(error))


def zookeeper_check(hosts: str, samples: int = 5) -> Diagnosis:
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
        return Diagnosis(
            "ZooKeeper",
            Level.WARN if failures else Level.PASS,
            "; ".join(answers) + (f"; unreachable: {', '.join(failures)}" if failures else ""),
            "a server of the ensemble is down" if failures else "",
        )
    return Diagnosis(
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


def source_check(choice: ZkChoice) -> Diagnosis:
    """Which ensemble the checks below ask, and why that one (``ensemble.choice``)."""
    if choice.is_default:
        return Diagnosis(
            "ZooKeeper ensemble",
            Level.WARN,
            f"none named, so the built-in default {choice.address} is tried",
            "start your own with `hpc-elastic zk start`, or name your site's with --zk, "
            f"${ZK_ENV} or the config file (docs/cluster-setup.md)",
        )
    return Diagnosis("ZooKeeper ensemble", Level.PASS, f"{choice.address} ({choice.source})")


def quorum_rule(healths: Sequence[fourletter.Health]) -> Diagnosis:
    """A leader, and how many servers serve: a degraded ensemble survives one loss fewer."""
    state = fourletter.quorum_state(healths)
    serving = [health for health in healths if health.serving]
    leader = next(
        (health.address for health in healths if health.mode in ("leader", "standalone")), None
    )
    if state == "no quorum":
        return Diagnosis(
            "ZooKeeper quorum",
            Level.FAIL,
            f"no leader: {', '.join(f'{h.address} {h.mode}' for h in healths)}",
            "a majority of the servers must run; `hpc-elastic zk status` shows yours",
        )
    if len(healths) == 1:
        return Diagnosis(
            "ZooKeeper quorum",
            Level.PASS,
            f"a single server at {leader}: it serves, and survives no loss",
        )
    message = f"leader {leader}; {len(serving)} of {len(healths)} servers serving"
    if state == "degraded":
        down = ", ".join(f"{h.address} {h.mode}" for h in healths if not h.serving)
        return Diagnosis(
            "ZooKeeper quorum",
            Level.WARN,
            f"{message} ({down})",
            f"it survives {len(serving) - zoocfg.quorum(len(healths))} more lost server(s); "
            "bring the missing ones back",
        )
    return Diagnosis("ZooKeeper quorum", Level.PASS, message)


def session_rule(requested: float, bounds: tuple[float, float] | None) -> Diagnosis:
    """The agents' session timeout against the server's bounds: outside them, the server
    silently gives another one, and a dead node is noticed later (or a slow one dropped)."""
    if bounds is None:
        return Diagnosis(
            "ZooKeeper sessions",
            Level.PASS,
            f"not checked: the servers do not say their session bounds (`conf` is not allowed); "
            f"the agents ask for {requested:g} s",
        )
    low, high = bounds
    if low <= requested <= high:
        return Diagnosis(
            "ZooKeeper sessions",
            Level.PASS,
            f"the agents' {requested:g} s sessions are within the server's {low:g}-{high:g} s",
        )
    given = min(max(requested, low), high)
    return Diagnosis(
        "ZooKeeper sessions",
        Level.WARN,
        f"the agents ask for {requested:g} s but the server allows {low:g}-{high:g} s, so they "
        f"get {given:g} s",
        f"set session-timeout (--session-timeout, or the config file) within {low:g}-{high:g} s",
    )


def restart_rule(session_timeout: float, prewarm: bool) -> Diagnosis:
    """What a job with these settings pays at a failure, and the flag that changes it: the
    defaults make a worker failure cost a few tenths of a second (warm standbys, the round's
    store open before any rank knocks); without prewarming every restart imports torch again.
    A node that stops answering is noticed after the session timeout (docs/agent.md, "The
    defaults, and what they cost", says why 6 s and not 2)."""
    node = (
        f"a node that stops answering is noticed after {session_timeout:g} s (--session-timeout; "
        "2 s suits a quiet cluster whose ensemble has tickTime <= 1000 ms, more where nodes "
        "stall for seconds)"
    )
    if not prewarm:
        return Diagnosis(
            "Restart speed",
            Level.WARN,
            f"cold restarts: every worker imports torch again at each restart (2 s or more "
            f"each, the ranks that import sooner wait in the store's backoff); {node}",
            "drop --no-prewarm ('prewarm = false' in the config): standby workers with torch "
            "imported make a worker failure cost a few tenths of a second, for about 250 MB "
            "of host memory per worker",
        )
    return Diagnosis(
        "Restart speed",
        Level.PASS,
        f"warm restarts: standby workers hold torch imported and the round's store listens "
        f"before any rank knocks; {node}",
    )


def acl_rule(enforced: bool | None) -> Diagnosis:
    """Every job's nodes are guarded by a digest ACL: an ensemble that does not enforce ACLs
    lets every user read, forge and end every job."""
    if enforced is None:
        return Diagnosis(
            "ZooKeeper ACLs",
            Level.WARN,
            "not checked: no node may be made under /hpc-elastic",
            "ask the ensemble's admin to give /hpc-elastic world CREATE (docs/rendezvous.md)",
        )
    if enforced:
        return Diagnosis(
            "ZooKeeper ACLs",
            Level.PASS,
            "enforced: a node guarded by a digest ACL is refused to a client without its secret",
        )
    return Diagnosis(
        "ZooKeeper ACLs",
        Level.FAIL,
        "NOT enforced: a client without the secret read a node guarded by a digest ACL",
        "the server runs with skipACL (or a superuser for all); every user could read, forge "
        "and end your jobs: fix the server before submitting",
    )


def parse_conf_bounds(text: str) -> tuple[float, float] | None:
    """``minSessionTimeout``/``maxSessionTimeout`` (ms) from a ``conf`` answer, in seconds."""
    values = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )
    try:
        return int(values["minSessionTimeout"]) / 1000, int(values["maxSessionTimeout"]) / 1000
    except (KeyError, ValueError):
        return None


def session_bounds(
    servers: Sequence[tuple[str, int]], choice: ZkChoice
) -> tuple[float, float] | None:
    """The server's session bounds: recorded for the user's own ensemble, else from the first
    server that answers ``conf`` (admins often do not allow it)."""
    if choice.ensemble is not None:
        return choice.ensemble.min_session_ms / 1000, choice.ensemble.max_session_ms / 1000
    for host, port in servers:
        try:
            bounds = parse_conf_bounds(fourletter.ask(host, port, "conf", timeout=3.0))
        except OSError:
            continue
        if bounds is not None:
            return bounds
    return None


def zookeeper_checks(choice: ZkChoice, session_timeout: float) -> list[Diagnosis]:
    """Which ensemble, whether it answers (``zookeeper_check``), then its quorum, its session
    bounds and whether it enforces ACLs; the last three only when it answers."""
    checks = [source_check(choice), zookeeper_check(choice.address)]
    if checks[-1].level is Level.FAIL:
        return checks
    servers = [
        (host, int(port))
        for host, _, port in (
            pair.rpartition(":") for pair in choice.address.split("/", 1)[0].split(",")
        )
    ]
    checks.append(quorum_rule([fourletter.health(host, port) for host, port in servers]))
    checks.append(session_rule(session_timeout, session_bounds(servers, choice)))
    from hpc_elastic.rendezvous import zookeeper  # noqa: PLC0415 (kazoo: only when checking)

    try:
        checks.append(acl_rule(zookeeper.acls_enforced(choice.address)))
    except HpcElasticError as error:
        checks.append(Diagnosis("ZooKeeper ACLs", Level.WARN, f"not checked: {error}"))
    return checks


def checkpoint_checks(directory: Path, partition: str | None, slurm_ok: bool) -> list[Diagnosis]:
    """Writable here, and readable from a compute node (one short ``srun``)."""
    marker = directory / f".hpc-elastic-doctor-{secrets.token_hex(4)}"
    token = secrets.token_hex(8)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
    except OSError as error:
        return [
            Diagnosis(
                "checkpoint dir",
                Level.FAIL,
                f"'{directory}' is not writable ({error.strerror})",
                "give a writable --checkpoint-dir on a shared filesystem",
            )
        ]
    checks = [Diagnosis("checkpoint dir", Level.PASS, f"'{directory}' is writable")]
    try:
        if not slurm_ok:
            checks.append(
                Diagnosis(
                    "shared filesystem",
                    Level.WARN,
                    "not checked: Slurm is not usable here",
                    "make sure every node mounts the checkpoint directory at the same path",
                )
            )
            return checks
        checks.append(shared_filesystem_check(marker, token, partition))
    finally:
        marker.unlink(missing_ok=True)
    return checks


TEST_SAVE_BYTES = 64 * 1024 * 1024
"""What doctor writes to time a save when not told the save's size (``--save-size``)."""
SAVE_CHUNK = 8 * 1024 * 1024


def measure_save(directory: Path, size: int) -> float:
    """Seconds to write ``size`` bytes to a new file in ``directory`` and fsync it, as a
    checkpoint's commit does; the file is removed again."""
    path = directory / f".hpc-elastic-doctor-save-{secrets.token_hex(4)}"
    chunk = b"\0" * min(SAVE_CHUNK, size)
    started = time.monotonic()
    try:
        with path.open("wb") as out:
            left = size
            while left > 0:
                out.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
            out.flush()
            os.fsync(out.fileno())
        return time.monotonic() - started
    finally:
        path.unlink(missing_ok=True)


def save_fit_rule(fit: grace.Fit, how: str) -> Diagnosis:
    """The agents' own check (slurm/grace.py) on the save doctor timed or was given."""
    message = f"{fit.sentence()} ({how})"
    if fit.fits:
        return Diagnosis("checkpoint save", Level.PASS, message)
    return Diagnosis("checkpoint save", Level.WARN, message, fit.advice())


def save_fit_check(
    partition: str | None, qos: str | None, lead_s: float, save_s: float, how: str
) -> Diagnosis:
    """Whether a save of ``save_s`` (plus no step: doctor runs none) fits the ``--signal``
    lead and what a preemption in ``partition`` (or of ``qos``) leaves."""
    try:
        config = commands.show_config()
        record = commands.partition_record(partition) or {}
        table = {}
        if config.get("PreemptType") == "preempt/qos":
            rows = commands.qos_table()
            table = {name: grace.QosRow(name, *row) for name, row in rows.items()}
    except SlurmError as error:
        return Diagnosis("checkpoint save", Level.WARN, f"not checked: {error}")
    job = {"Partition": record.get("PartitionName", partition or ""), "QOS": qos or "normal"}
    limits = grace.limits_from(lead_s, job, config, record, table)
    return save_fit_rule(grace.check(save_s, 0.0, limits), how)


def shared_filesystem_check(marker: Path, token: str, partition: str | None) -> Diagnosis:
    """A compute node must read back the token just written to ``marker`` on this host."""
    try:
        seen = commands.read_on_a_node(str(marker), partition)
    except SlurmError as error:
        return Diagnosis("shared filesystem", Level.WARN, str(error))
    if seen is None:
        return Diagnosis(
            "shared filesystem",
            Level.FAIL,
            f"compute nodes do not see '{marker.parent}'",
            "put checkpoints on a filesystem every node mounts (e.g. /scratch, $HOME)",
        )
    if seen.strip() != token:
        return Diagnosis(
            "shared filesystem",
            Level.WARN,
            f"a compute node read something else at '{marker}'",
            "make sure every node mounts the checkpoint directory at the same path",
        )
    return Diagnosis("shared filesystem", Level.PASS, "a compute node reads what is written here")


def is_url(text: str) -> bool:
    """``s3://bucket/run`` and the like: checkpoints in an object store (issue 15)."""
    return "://" in text


def object_store_check(url: str) -> Diagnosis:
    """An object store is not a directory: making ``s3:/bucket`` here would be wrong, so
    doctor says what it cannot check instead of creating a local look-alike."""
    return Diagnosis(
        "checkpoint dir",
        Level.WARN,
        f"'{url}' is an object store, which doctor does not check",
        "check the store's credentials and write access from a compute node",
    )


PYXIS_OPTIONS = ("--container-image", "--container-mounts")
"""What ``--container-image`` puts on the srun line; pyxis adds both to ``srun --help``."""


def pyxis_rule(srun_help: str | None) -> Diagnosis:
    """Whether ``submit --container-image`` can work here. No pyxis is no fault of the
    cluster: it passes, and says what the flag needs."""
    if srun_help is None:
        return Diagnosis("pyxis", Level.PASS, "not checked: srun is not usable here")
    missing = [option for option in PYXIS_OPTIONS if option not in srun_help]
    if not missing:
        return Diagnosis(
            "pyxis",
            Level.PASS,
            "srun has --container-image and --container-mounts: --container-image IMAGE works",
        )
    return Diagnosis(
        "pyxis",
        Level.PASS,
        f"srun has no {' or '.join(missing)} (no pyxis plugin): --container-image cannot be "
        "used here; use --apptainer IMAGE, or ask the admins for pyxis",
    )


def apptainer_rule(found: bool) -> Diagnosis:
    """Whether ``submit --apptainer`` can work: the command must be on PATH. Only this host's
    PATH is seen; the compute nodes need it too."""
    if found:
        return Diagnosis(
            "apptainer",
            Level.PASS,
            "found on PATH here (the compute nodes need it too): --apptainer IMAGE works",
        )
    return Diagnosis(
        "apptainer",
        Level.PASS,
        "not on PATH here: --apptainer cannot be used unless the compute nodes have it "
        "(try `module load apptainer`)",
    )


def container_checks() -> list[Diagnosis]:
    """The two container runtimes ``submit`` knows (``--container-image``, ``--apptainer``)."""
    try:
        help_text: str | None = commands.srun_help()
    except SlurmError as error:
        log.debug("doctor: srun --help failed: %s", error)
        help_text = None
    return [pyxis_rule(help_text), apptainer_rule(not commands.missing_tools(("apptainer",)))]


def bad_nodes_rule(records: Sequence[BadNode], now: float) -> Diagnosis:
    """The nodes the user's jobs keep away from: not a fault of the cluster, but a job that
    waits for nodes is told why it gets fewer than the partition has."""
    if not records:
        return Diagnosis(
            "bad nodes", Level.PASS, "none remembered: your jobs may run on every node"
        )
    shown = "; ".join(
        f"{record.host} until {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(record.until))} "
        f"({one_line(record.reason)})"
        for record in records
    )
    return Diagnosis(
        "bad nodes",
        Level.WARN,
        f"{len(records)} kept out of your jobs since their health check failed: {shown}",
        "once a node is repaired, `hpc-elastic nodes clear NODE` lets your jobs use it again",
    )


def bad_nodes_check(zk: str, secret_file: Path, zk_ok: bool) -> Diagnosis:
    """The user's remembered bad nodes (``hpc-elastic nodes``), read with the user's secret."""
    if not zk_ok:
        return Diagnosis(
            "bad nodes",
            Level.WARN,
            "not checked: ZooKeeper did not answer",
            "once ZooKeeper answers, `hpc-elastic nodes` lists them",
        )
    if not secret_file.expanduser().is_file():
        return Diagnosis(
            "bad nodes",
            Level.PASS,
            f"none remembered (no user secret at '{secret_file.expanduser()}' yet)",
        )
    try:
        with badnodes.open_book(zk, secret_file) as book:
            records = badnodes.listing(book, time.time())
    except HpcElasticError as error:
        log.debug("doctor: the bad-node list is unreadable: %s", error)
        return Diagnosis(
            "bad nodes",
            Level.WARN,
            f"not read: {error}",
            "your jobs still run; a node that fails its health check is excluded anyway",
        )
    return bad_nodes_rule(records, time.time())


def _user_secret_file() -> Path:
    """Where the agents keep the user's secret: ``HPC_ELASTIC_USER_SECRET_FILE`` or the default."""
    return Path(os.environ.get(USER_SECRET_FILE_ENV) or DEFAULT_USER_SECRET_FILE)


def diagnose(
    partition: str | None,
    zk: str | ZkChoice,
    checkpoint_dir: Path | str,
    user_secret_file: Path | None = None,
    session_timeout: float = DEFAULT_SESSION_TIMEOUT,
    *,
    prewarm: bool = True,
    save: SavePlan | None = None,
) -> list[Diagnosis]:
    """Every check; ``checkpoint_dir`` is a local directory, or a URL (``is_url``) left as is.
    ``zk`` is the ensemble to check and where it came from (a bare address: given by hand).
    ``session_timeout`` and ``prewarm``: what the user's jobs will get (the config file).
    ``save``: the save to check against the partition's GraceTime and the signal lead."""
    choice = zk if isinstance(zk, ZkChoice) else ZkChoice(zk, "--zk")
    checks, chosen = slurm_checks(partition)
    ensemble = zookeeper_checks(choice, session_timeout)
    checks.extend(ensemble)
    checks.append(restart_rule(session_timeout, prewarm))
    zk_ok = all(check.level is not Level.FAIL for check in ensemble[:2])
    checks.append(bad_nodes_check(choice.address, user_secret_file or _user_secret_file(), zk_ok))
    checks.extend(container_checks())
    if isinstance(checkpoint_dir, str):
        checks.append(object_store_check(checkpoint_dir))
    else:
        checks.extend(checkpoint_checks(checkpoint_dir, chosen, chosen is not None))
    if chosen is not None and save is not None:
        checks.append(save.check(chosen, checkpoint_dir))
    return checks


@dataclass(frozen=True)
class SavePlan:
    """The save doctor checks (``save_fit_check``): given in seconds, else timed by writing
    ``size`` bytes to the checkpoint directory."""

    lead_s: float
    """The ``--signal`` lead the jobs will have."""
    seconds: float | None = None
    size: int = TEST_SAVE_BYTES
    qos: str | None = None

    def check(self, partition: str, directory: Path | str) -> Diagnosis:
        if self.seconds is not None:
            return save_fit_check(partition, self.qos, self.lead_s, self.seconds, "as given")
        if isinstance(directory, str):
            return Diagnosis(
                "checkpoint save",
                Level.WARN,
                f"not timed: '{directory}' is object storage",
                "time one save yourself and give --save-seconds S",
            )
        try:
            seconds = measure_save(directory, self.size)
        except OSError as error:
            return Diagnosis("checkpoint save", Level.WARN, f"not timed ({error.strerror})")
        how = f"a test save of {self.size / 1e6:.0f} MB to '{directory}' took {seconds:.1f} s"
        return save_fit_check(partition, self.qos, self.lead_s, seconds, how)
