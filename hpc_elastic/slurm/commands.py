"""Slurm's command-line tools as functions: run a command, parse its text with a pure function.

Every failure leaves here as one ``SlurmError`` sentence that says what to do. submitit is not
used for these calls: its executor pickles a Python callable per job and polls ``sacct``, while
hpc-elastic submits a rendered script and must work on clusters without accounting.
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NewType

from hpc_elastic.errors import SlurmError

log = logging.getLogger(__name__)
SlurmJobId = NewType("SlurmJobId", str)
"""A job id as Slurm prints it: ``123``, or ``123_4`` for one task of an array."""

_TIMEOUT_S = 60.0
_PING_HINT = "check that slurmctld is up with `scontrol ping`"
_CONF_HINT = (
    "check that slurmctld is up with `scontrol ping` and that SLURM_CONF names its slurm.conf"
)
_JOB_HINT = "check the job id with `squeue` and that slurmctld is up with `scontrol ping`"


@dataclass(frozen=True)
class JobStatus:
    """One line of ``squeue``: a job, or one task (or pending range) of an array job."""

    job_id: SlurmJobId
    """The job id, or for array jobs the array's base job id."""
    array_task: str | None
    """Array index (``3``) or pending range (``0-3``); None for a plain job."""
    state: str
    """Slurm's long state name: PENDING, RUNNING, COMPLETING, ..."""
    reason: str
    """Why it pends (``BeginTime``, ``Resources``) or ``None``."""
    nodes: str
    """Slurm node list (``n[1-2]``); empty while pending."""


@dataclass(frozen=True)
class NodeDrain:
    """A node Slurm drains or fails: no new work starts there, and its admin (or a health
    check) wants the running work gone (one line of ``sinfo -t drain,fail``)."""

    node: str
    state: str
    """sinfo's long state, lower case: ``draining`` (jobs still run), ``drained``,
    ``failing``, ``fail``; a ``*`` (not responding) or other suffix stays on it."""
    since: str
    """When the state was set, as Slurm prints it (``2026-12-03T07:18:34``)."""
    by: str
    """Who set it."""
    reason: str
    """The reason Slurm gives (``scontrol update ... reason=...``)."""


# --- pure parsers (unit-tested on captured output) ----------------------------------------


def parse_sbatch_parsable(stdout: str) -> SlurmJobId:
    """``sbatch --parsable`` prints ``ID`` or ``ID;CLUSTER``."""
    match = re.fullmatch(r"\s*(\d+)(?:;\S+)?\s*", stdout)
    if match is None:
        raise SlurmError(
            f"sbatch answered '{stdout.strip()}' instead of a job id; "
            "check the job with `squeue --me` before submitting again."
        )
    return SlurmJobId(match.group(1))


def explain_sbatch_error(stderr: str) -> str:
    """One sentence for what sbatch printed when it refused a job."""
    partition = re.search(r"invalid partition specified: (\S+)", stderr)
    if partition is not None:
        return (
            f"Slurm has no partition '{partition.group(1)}'; "
            "run `sinfo` to list the partitions and pick one of them."
        )
    if "Node count specification invalid" in stderr:
        return (
            "sbatch refused the node count: the partition has fewer nodes than asked for; "
            "run `sinfo` to see its nodes and ask for fewer."
        )
    return f"sbatch refused the job: {_last_error(stderr)}; fix the request and submit again."


DRAIN_FORMAT = "%N|%T|%H|%u|%E"
"""sinfo's fields for a drained node: name, state, since, by whom, reason (last: it may
hold ``|`` itself)."""


def parse_drains(stdout: str) -> dict[str, NodeDrain]:
    """``sinfo -h -N -t drain,fail -o DRAIN_FORMAT``: each node once (sinfo prints a node once
    per partition it is in)."""
    drains: dict[str, NodeDrain] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        fields = line.split("|", 4)
        if len(fields) != 5 or not fields[0].strip():
            raise SlurmError(
                f"sinfo printed '{line}', which is not '{DRAIN_FORMAT}'; "
                "check that `sinfo` is Slurm's and not a wrapper."
            )
        node, state, since, by, reason = (field.strip() for field in fields)
        drains.setdefault(node, NodeDrain(node, state.lower(), since, by, reason))
    return drains


def parse_partitions(stdout: str) -> list[str]:
    """``sinfo -h -o %R``: one partition name per line, repeated once per node state."""
    names: list[str] = []
    for line in stdout.splitlines():
        name = line.strip()
        if name and name not in names:
            names.append(name)
    return names


SQUEUE_FORMAT = "%F|%K|%T|%r|%N"


def parse_squeue(stdout: str) -> list[JobStatus]:
    """``squeue -h -o SQUEUE_FORMAT`` lines into statuses."""
    statuses = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 5:
            raise SlurmError(
                f"squeue printed '{line}', which is not '{SQUEUE_FORMAT}'; "
                "check that `squeue` is Slurm's and not a wrapper."
            )
        job_id, array_task, state, reason, nodes = (field.strip() for field in fields)
        statuses.append(
            JobStatus(
                job_id=SlurmJobId(job_id),
                array_task=None if array_task in ("", "N/A") else array_task,
                state=state,
                reason=reason,
                nodes=nodes,
            )
        )
    return statuses


_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=(.*?)(?=\s+[A-Za-z][\w/:]*=|\s*$)")


def parse_scontrol_record(stdout: str) -> dict[str, str]:
    """The first record of ``scontrol -o show ...``: ``Key=Value`` pairs, values may hold spaces."""
    first = stdout.strip().splitlines()[0] if stdout.strip() else ""
    fields = {key: value for key, value in _FIELD.findall(first)}
    if not fields:
        raise SlurmError(
            f"scontrol printed '{first}', which has no Key=Value fields; "
            "check that `scontrol` is Slurm's and not a wrapper."
        )
    return fields


def parse_scontrol_config(stdout: str) -> dict[str, str]:
    """``scontrol show config``: ``Key = Value`` lines under a header; values may hold spaces."""
    pairs = (line.split("=", 1) for line in stdout.splitlines() if " = " in line)
    return {key.strip(): value.strip() for key, value in pairs}


def parse_scontrol_records(stdout: str) -> list[dict[str, str]]:
    """Every record of ``scontrol -o show ...``: one line each."""
    return [parse_scontrol_record(line) for line in stdout.splitlines() if line.strip()]


def pick_partition(records: Sequence[Mapping[str, str]], name: str | None) -> dict[str, str] | None:
    """The record of partition ``name``; with no name, the one Slurm marks ``Default=YES``."""
    for record in records:
        wanted = record.get("PartitionName") == name if name else record.get("Default") == "YES"
        if wanted:
            return dict(record)
    return None


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else "no error message"
    return re.sub(r"^\w+: error: ", "", last).rstrip(".")


# --- running the tools --------------------------------------------------------------------


def _spawn(
    argv: Sequence[str],
    env: Mapping[str, str] | None,
    stdin: str | None,
    timeout: float = _TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """The layer's one subprocess call. Tests replace this function and nothing else
    (``tests/slurm_fake.py``), so every parser and error sentence above it runs for real."""
    return subprocess.run(
        list(argv),
        input=stdin,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _run(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    stdin: str | None = None,
    timeout: float = _TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """Run one Slurm tool; its absence or a hang becomes a SlurmError, its exit code is kept."""
    log.debug("running %s (timeout %g s)", " ".join(argv), timeout)
    try:
        return _spawn(argv, env, stdin, timeout)
    except FileNotFoundError as error:
        raise SlurmError(
            f"{argv[0]} was not found on PATH; run this on a Slurm login node or install Slurm."
        ) from error
    except subprocess.TimeoutExpired as error:
        raise SlurmError(
            f"`{' '.join(argv)}` did not answer within {timeout:g} s; {_PING_HINT}."
        ) from error


def _checked(
    argv: Sequence[str],
    env: Mapping[str, str] | None,
    hint: str = _PING_HINT,
    timeout: float = _TIMEOUT_S,
) -> str:
    result = _run(argv, env, timeout=timeout)
    if result.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed: {_last_error(result.stderr)}; {hint}.")
    return result.stdout


def sbatch(
    script_text: str, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> SlurmJobId:
    """Submit a script given as text (read by sbatch from stdin) and return its job id."""
    result = _run(["sbatch", "--parsable", *extra_args], env, stdin=script_text)
    if result.returncode != 0:
        raise SlurmError(explain_sbatch_error(result.stderr))
    return parse_sbatch_parsable(result.stdout)


def partitions(env: Mapping[str, str] | None = None) -> list[str]:
    return parse_partitions(_checked(["sinfo", "-h", "-o", "%R"], env))


def squeue(
    job_ids: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    timeout: float = _TIMEOUT_S,
) -> list[JobStatus]:
    """Jobs Slurm still knows; a job id it has forgotten yields no line instead of an error."""
    argv = ["squeue", "-h", "-o", SQUEUE_FORMAT]
    if job_ids:
        argv += ["-j", ",".join(job_ids)]
    result = _run(argv, env, timeout=timeout)
    if result.returncode != 0:
        if "Invalid job id specified" in result.stderr:
            return []
        raise SlurmError(f"squeue failed: {_last_error(result.stderr)}; {_PING_HINT}.")
    return parse_squeue(result.stdout)


def scontrol_show_job(
    job_id: str, env: Mapping[str, str] | None = None, *, timeout: float = _TIMEOUT_S
) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, Reason, NodeList, Restarts, ...)."""
    return parse_scontrol_record(
        _checked(["scontrol", "-o", "show", "job", job_id], env, _JOB_HINT, timeout)
    )


def job_steps(
    job_id: str, env: Mapping[str, str] | None = None, *, timeout: float = _TIMEOUT_S
) -> dict[str, dict[str, str]]:
    """The running steps of a job (``scontrol -o show step``) by step id (``123.0``, with
    ``123.batch``): State, NodeList, StartTime... An ended job, or one with no step, has none."""
    result = _run(["scontrol", "-o", "show", "step", job_id], env, timeout=timeout)
    if result.returncode != 0:
        if "not found" in result.stdout or "Invalid job id" in result.stderr:
            return {}
        raise SlurmError(
            f"`scontrol -o show step {job_id}` failed: {_last_error(result.stderr)}; {_JOB_HINT}."
        )
    records = parse_scontrol_records(result.stdout)
    return {record["StepId"]: record for record in records if "StepId" in record}


def cancel(
    job_id: str,
    signal: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    full: bool = False,
) -> None:
    """Cancel the job, or with ``signal`` only send that signal to its steps (``scancel -s``);
    ``full``: to the batch shell too, every process of the job (``scancel --full``)."""
    argv = ["scancel", *(["-s", signal] if signal else []), *(["--full"] if full else []), job_id]
    _checked(argv, env, _JOB_HINT)


def requeue(job_id: str, env: Mapping[str, str] | None = None) -> None:
    _checked(["scontrol", "requeue", job_id], env, _JOB_HINT)


def release(job_id: str, env: Mapping[str, str] | None = None) -> None:
    """``scontrol release``: let a held task (``REQUEUE_HOLD``) be scheduled again."""
    _checked(["scontrol", "release", job_id], env, _JOB_HINT)


def update_job(job_id: str, env: Mapping[str, str] | None = None, **fields: str) -> None:
    """``scontrol update JobId=ID Key=Value ...``, e.g. ``ExcNodeList="n3"``."""
    if not fields:
        raise SlurmError(f"update_job({job_id}) got no fields; pass e.g. ExcNodeList='n3'.")
    pairs = [f"{key}={value}" for key, value in fields.items()]
    _checked(["scontrol", "update", f"JobId={job_id}", *pairs], env, _JOB_HINT)


def drained_nodes(
    env: Mapping[str, str] | None = None, *, timeout: float = _TIMEOUT_S
) -> dict[str, NodeDrain]:
    """Every node of the cluster that Slurm drains or fails, by name: one ``sinfo``, whose
    answer grows with the drained nodes, not with the cluster or the job."""
    argv = ["sinfo", "-h", "-N", "-t", "drain,fail", "-o", DRAIN_FORMAT]
    return parse_drains(_checked(argv, env, timeout=timeout))


def missing_tools(tools: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The tools among ``tools`` that cannot be run. Each one runs ``--version`` through the one
    subprocess call, so a test can take a tool away just as it answers for one."""
    missing = []
    for tool in tools:
        try:
            _spawn([tool, "--version"], env, None)
        except OSError:
            missing.append(tool)
        except subprocess.TimeoutExpired:
            pass  # it is there but hangs; the next real query says so in one sentence
    return missing


def slurm_version(env: Mapping[str, str] | None = None) -> str:
    """``scontrol --version`` as printed, e.g. ``slurm 22.05.8``."""
    return _checked(["scontrol", "--version"], env, _CONF_HINT).strip()


def show_config(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """slurmctld's running configuration (``scontrol show config``) as a dict."""
    return parse_scontrol_config(_checked(["scontrol", "show", "config"], env, _CONF_HINT))


DEFAULT_MAX_BATCH_REQUEUE = 5
"""Slurm's default ``MaxBatchRequeue``: a batch job requeued more often than this is held."""


def max_batch_requeue(config: Mapping[str, str]) -> int:
    """The site's ``MaxBatchRequeue`` from ``scontrol show config`` (Slurm's default if absent)."""
    value = config.get("MaxBatchRequeue", "")
    return int(value) if value.isdigit() else DEFAULT_MAX_BATCH_REQUEUE


def partition_record(
    name: str | None = None, env: Mapping[str, str] | None = None
) -> dict[str, str] | None:
    """``scontrol show partition``'s record of ``name`` (default: Slurm's default partition),
    or None when Slurm has no such partition."""
    argv = ["scontrol", "-o", "show", "partition", *([name] if name else [])]
    result = _run(argv, env)
    if result.returncode != 0:
        if "not found" in result.stdout:  # scontrol prints "Partition x not found", exits 1
            return None
        raise SlurmError(f"`{' '.join(argv)}` failed: {_last_error(result.stderr)}; {_CONF_HINT}.")
    return pick_partition(parse_scontrol_records(result.stdout), name)


QOS_FORMAT = "format=Name,GraceTime,PreemptMode,Preempt"


def parse_qos_table(stdout: str) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """``sacctmgr -nP show qos QOS_FORMAT``: name -> (GraceTime, PreemptMode, the QoS it
    preempts)."""
    table: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 4:
            raise SlurmError(
                f"sacctmgr printed '{line}', which is not '{QOS_FORMAT}'; check that "
                "`sacctmgr` is Slurm's and not a wrapper."
            )
        name, grace, mode, preempts = (field.strip() for field in fields)
        table[name] = (grace, mode, tuple(item for item in preempts.split(",") if item))
    return table


def qos_table(
    env: Mapping[str, str] | None = None, *, timeout: float = _TIMEOUT_S
) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Every QoS of the cluster (``parse_qos_table``); a cluster without accounting has none,
    and sacctmgr then fails: that is no QoS, not an error."""
    result = _run(["sacctmgr", "-nP", "show", "qos", QOS_FORMAT], env, timeout=timeout)
    if result.returncode != 0:
        log.debug("sacctmgr show qos: %s", _last_error(result.stderr))
        return {}
    return parse_qos_table(result.stdout)


def scrontab_read(env: Mapping[str, str] | None = None) -> str:
    """The user's scrontab (``scrontab -l``); empty when there is none yet."""
    result = _run(["scrontab", "-l"], env)
    if result.returncode != 0:
        error = _last_error(result.stderr)
        if "no crontab" in error.lower():
            return ""
        raise SlurmError(f"`scrontab -l` failed: {error}; {_scrontab_hint(error)}.")
    return result.stdout


def scrontab_write(path: str, env: Mapping[str, str] | None = None) -> None:
    """Replace the user's scrontab with the file at ``path`` (``scrontab FILE``)."""
    result = _run(["scrontab", path], env)
    if result.returncode != 0:
        error = _last_error(result.stderr)
        raise SlurmError(f"`scrontab {path}` failed: {error}; {_scrontab_hint(error)}.")


def _scrontab_hint(error: str) -> str:
    if "disabled" in error.lower():
        return "ask the admins for ScronParameters=enable, or run the line from cron instead"
    return _PING_HINT


def srun_help(env: Mapping[str, str] | None = None) -> str:
    """``srun --help`` as printed: SPANK plugins such as pyxis add their options to it."""
    return _checked(["srun", "--help"], env, _CONF_HINT)


def read_on_a_node(
    path: str, partition: str | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """What one short step (``srun -N1 cat PATH``) reads at ``path`` on a compute node, or None
    when that node has no such file. ``--immediate`` makes it give up instead of queueing."""
    argv = ["srun", "-N1", "-n1", "--immediate=20", "--time=1", "--quiet"]
    argv += [*(["-p", partition] if partition else []), "cat", path]
    result = _run(argv, env)
    if result.returncode == 0:
        return result.stdout
    if "No such file" in result.stderr:
        return None
    raise SlurmError(
        f"no one-node step could run in partition '{partition or '(default)'}' "
        f"({_last_error(result.stderr)}); rerun when the partition has an idle node."
    )
