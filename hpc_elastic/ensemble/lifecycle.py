"""``zk start``, ``zk status`` and ``zk stop``: the ensemble as one ordinary Slurm job.

The job asks for one node per server and per spare (``--nodes N+S --ntasks-per-node=1``),
``--no-kill`` so that a lost node ends only its own server, and ``--no-requeue``, since a
requeued ensemble would come back on other ports and every job using it would lose it anyway.
Its script (``render_script``) runs the supervisor (``supervisor``): one step per server,
``hpc-elastic zk server``; a server whose step died starts again in place (same node, ports and
data; ``--restarts`` times); one whose node was lost is replaced on a spare node and the
ensemble reconfigured; and a last step on every node removes what a killed server left
(``hpc-elastic zk clean``).

Slurm is asked only through the Slurm layer (``hpc_elastic.slurm.commands``); what its answers
mean is decided by the pure rules here (``preemption_refusal``, ``exclusive_warning``,
``step_state``, ``users_of``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from hpc_elastic import contract, trust
from hpc_elastic._version import __version__
from hpc_elastic.ensemble import files, fourletter, install, zoocfg
from hpc_elastic.ensemble.files import Ensemble, Found, Layout, Server, StartRecord
from hpc_elastic.errors import (
    EnsembleError,
    EnsembleTrustError,
    HpcElasticError,
    SlurmError,
    UsageError,
    one_line,
)
from hpc_elastic.slurm.commands import JobStatus, SlurmJobId

Say = Callable[[str], None]
JOB_NAME = "hpc-elastic-zk"
STOP_WAIT_S = 60.0
"""How long ``zk stop`` waits for the servers to stop and the job to leave the queue."""
POLL_S = 0.5


class Slurm(Protocol):
    """The Slurm layer's functions the ensemble uses (``hpc_elastic.slurm.commands``)."""

    def sbatch(self, script_text: str, extra_args: Sequence[str] = ()) -> SlurmJobId: ...
    def squeue(self, job_ids: Sequence[str] = ()) -> list[JobStatus]: ...
    def job_steps(self, job_id: str) -> dict[str, dict[str, str]]: ...
    def cancel(self, job_id: str, signal: str | None = None) -> None: ...
    def partition_record(self, name: str | None = None) -> dict[str, str] | None: ...
    def show_config(self) -> dict[str, str]: ...


def slurm_layer() -> Slurm:
    from hpc_elastic.slurm import commands  # noqa: PLC0415 (tests swap its functions)

    return commands


# --- pure rules ------------------------------------------------------------------------------


def preemption_refusal(config: Mapping[str, str], partition: Mapping[str, str]) -> str | None:
    """Why ``partition`` may preempt the ensemble, as the end of a sentence, or None.

    A preempted ensemble takes every job that uses it down with it, so the partition must
    never preempt: no preemption plugin, or ``PreemptMode=OFF`` on the partition. With
    ``preempt/qos`` the partition's QoS decides, which ``scontrol`` cannot show; a partition
    with a QoS is then named as a risk too."""
    preempt_type = config.get("PreemptType", "preempt/none")
    if preempt_type == "preempt/none":
        return None
    name = partition.get("PartitionName", "?")
    mode = (partition.get("PreemptMode") or config.get("PreemptMode") or "OFF").upper()
    if not mode.startswith("OFF"):
        return f"partition '{name}' has PreemptMode={mode} under {preempt_type}"
    qos = partition.get("QoS", "N/A")
    if preempt_type == "preempt/qos" and qos not in ("", "N/A"):
        return f"partition '{name}' runs under QoS '{qos}', which preempt/qos may preempt"
    return None


def exclusive_warning(partition: Mapping[str, str], servers: int) -> str | None:
    """A partition that gives every job whole nodes makes the ensemble hold ``servers`` of
    them, though each server needs one CPU."""
    if partition.get("OverSubscribe", "").upper().startswith("EXCLUSIVE"):
        return (
            f"partition '{partition.get('PartitionName', '?')}' gives every job whole nodes "
            f"(OverSubscribe=EXCLUSIVE), so the ensemble holds {servers} of them for one CPU "
            "each; a shared partition (--partition) wastes less"
        )
    return None


def step_state(
    server: Server, job: JobStatus | None, steps: Mapping[str, Mapping[str, str]]
) -> str:
    """The Slurm state of a server's task: its step's, or why it has none."""
    if job is None:
        return "job ended"
    if job.state != "RUNNING":
        return job.state
    step = steps.get(server.step)
    if step is None:
        return "step ended"
    return step.get("State", "?")


def users_of(ensemble: Ensemble, records: Iterable[Any]) -> list[Any]:
    """The jobs (``JobRecord``s) that rendezvous through ``ensemble``: a Slurm job whose
    ``zk`` names its servers, as they are or as they were before a server was replaced
    (``Ensemble.names``)."""
    return [
        record
        for record in records
        if not record.local and record.job_id and record.zk and ensemble.names(record.zk)
    ]


def spares_refusal(servers: int, spares: int) -> str | None:
    """Why ``--spares`` cannot be given with ``--servers``, as a sentence, or None."""
    if not 0 <= spares <= contract.ZK_MAX_SPARES:
        return (
            f"--spares '{spares}' is not one of 0..{contract.ZK_MAX_SPARES}; give 1 to replace "
            "one lost server, 2 for two."
        )
    if spares and servers == 1:
        return (
            f"--spares {spares} needs --servers 3 or 5: a lost server is replaced by a "
            "reconfiguration, which needs the quorum that one server alone loses with it."
        )
    return None


# --- zk start ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartRequest:
    servers: int = contract.DEFAULT_ZK_SERVERS
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    memory: str = contract.DEFAULT_ZK_MEMORY
    data_root: str = ""
    ports: tuple[int, int] = contract.DEFAULT_ZK_PORTS
    restarts: int = contract.DEFAULT_ZK_RESTARTS
    spares: int = contract.DEFAULT_ZK_SPARES
    timeout: float = contract.DEFAULT_ZK_START_TIMEOUT
    allow_preemption: bool = False
    wait: bool = True
    python: str = field(default_factory=lambda: sys.executable)
    sbatch_args: tuple[str, ...] = ()


def render_script(request: StartRequest, layout: Layout) -> str:
    """The ensemble's sbatch script (module docstring)."""
    q = shlex.quote
    sbatch = [
        f"--job-name={JOB_NAME}",
        f"--nodes={request.servers + request.spares}",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        f"--mem={request.memory}",
        "--no-kill",
        "--no-requeue",
        f"--output={layout.slurm_output()}",
        *([f"--partition={request.partition}"] if request.partition else []),
        *([f"--time={request.time}"] if request.time else []),
        *([f"--account={request.account}"] if request.account else []),
        *request.sbatch_args,
    ]
    return "\n".join(
        [
            "#!/bin/bash",
            f"# Rendered by hpc-elastic {__version__}: a ZooKeeper ensemble of "
            f"{request.servers} server{'s' if request.servers > 1 else ''}, one step each"
            f"{spares_phrase(request.spares)}.",
            *(f"#SBATCH {q(option)}" for option in sbatch),
            "",
            "# The supervisor runs every server in a step of its own, starts one whose step died",
            "# again in place, replaces one whose node was lost on a spare node, and ends with a",
            "# step that removes what a killed server left on every node.",
            f"exec {q(request.python)} -m hpc_elastic zk supervise --run-dir "
            f"{q(str(layout.run_dir))}",
            "",
        ]
    )


def start(
    request: StartRequest,
    layout: Layout,
    say: Say,
    slurm: Slurm | None = None,
    environ: Mapping[str, str] = os.environ,
) -> str:
    """Submit the ensemble's job (and wait until it serves); returns the Slurm job id."""
    slurm = slurm or slurm_layer()
    refusal = spares_refusal(request.servers, request.spares)
    if refusal is not None:
        raise UsageError(refusal)
    found = install.find_installation(environ)
    say(f"ZooKeeper: {found.zookeeper}; Java: {found.java}.")
    _check_partition(request, slurm, say)
    _clear_stale(layout, slurm, say)
    files.ensure_private_dir(layout.root)
    try:
        layout.run_dir.mkdir(mode=files.PRIVATE_DIR_MODE)
    except FileExistsError:
        raise EnsembleError(
            f"Another `hpc-elastic zk start` is under way ('{layout.run_dir}' exists); wait for "
            "it, or run `hpc-elastic zk stop --force` to clear it."
        ) from None
    files.ensure_private_dir(layout.peers_dir)
    record = StartRecord(
        servers=request.servers,
        java=found.java,
        classpath=found.classpath,
        data_root=request.data_root,
        ports=request.ports,
        restarts=request.restarts,
        start_timeout=request.timeout,
        spares=request.spares,
    )
    files.write_private(layout.start_file, files.encode(record))
    if request.servers > 1:
        files.make_secret(layout)
    script = render_script(request, layout)
    files.write_private(layout.script, script.encode())
    previous = os.umask(0o077)  # Slurm creates the job's output file with sbatch's umask
    try:
        job_id = str(slurm.sbatch(script))
    except HpcElasticError:
        _remove_run_dir(layout)
        raise
    finally:
        os.umask(previous)
    files.write_private(layout.start_file, files.encode(replace(record, job_id=job_id)))
    say(
        f"Submitted Slurm job {job_id}: a ZooKeeper ensemble of {request.servers} "
        f"server{'s' if request.servers > 1 else ''}{spares_phrase(request.spares)} (output in "
        f"{layout.slurm_output(job_id)})."
    )
    if request.wait:
        ensemble = wait_serving(layout, job_id, request.timeout, slurm, say)
        say(
            f"Your ensemble serves at {ensemble.connect} (Slurm job {job_id}); submit, doctor, "
            "nodes and the Python API use it when no --zk is given."
        )
    return job_id


def spares_phrase(spares: int) -> str:
    return f" and {spares} spare node{'s' if spares > 1 else ''}" if spares else ""


def _check_partition(request: StartRequest, slurm: Slurm, say: Say) -> None:
    record = slurm.partition_record(request.partition)
    if record is None:
        raise EnsembleError(
            f"Slurm has no partition '{request.partition or '(default)'}'; run `sinfo -s` and "
            "give one with --partition."
        )
    refusal = preemption_refusal(slurm.show_config(), record)
    if refusal is not None:
        sentence = (
            f"The ensemble could be preempted because {refusal}, and a preempted ensemble "
            "ends the rendezvous of every job that uses it"
        )
        if not request.allow_preemption:
            raise EnsembleError(
                f"{sentence}; pick a partition that never preempts with --partition (see "
                "`scontrol show partition`), or pass --allow-preemption to take the risk."
            )
        say(f"WARNING: {sentence}.")
    note = exclusive_warning(record, request.servers + request.spares)
    if note is not None:
        say(f"Note: {note}.")


def _job_listed(slurm: Slurm, job_id: str) -> JobStatus | None:
    listed = [status for status in slurm.squeue([job_id]) if status.job_id == job_id]
    return listed[0] if listed else None


def _clear_stale(layout: Layout, slurm: Slurm, say: Say) -> None:
    """An ensemble file or run directory whose job Slurm no longer lists is what an ensemble
    that ended without `zk stop` left (its time limit, a crash): cleared, with a word."""
    found = Found(_quietly(files.load_ensemble, layout), _quietly(files.load_start, layout), layout)
    job_id = _job_of(found)
    if job_id and _job_listed(slurm, job_id) is not None:
        raise EnsembleError(
            f"Your ensemble (Slurm job {job_id}) already runs; use it, or stop it first with "
            "`hpc-elastic zk stop`."
        )
    if found.ensemble is not None and not found.ensemble.job_id:
        server = found.ensemble.servers[0]
        if fourletter.health(server.host, server.client_port, timeout=1.0).mode != "down":
            raise EnsembleError(
                f"Your ensemble (hpc-elastic zk serve at {server.address}) already runs; use "
                "it, or stop it first with `hpc-elastic zk stop`."
            )
    if found.ensemble is not None or layout.run_dir.exists():
        which = f" (Slurm job {job_id})" if job_id else ""
        say(f"Clearing the records of an ensemble that has ended{which}.")
        _remove_run_dir(layout)
        layout.ensemble_file.unlink(missing_ok=True)


def _quietly(load: Callable[[Layout], Any], layout: Layout) -> Any:
    """A record, or None when it is missing or cannot be decoded; an untrusted one still
    raises (an attacker's file is never quietly replaced)."""
    try:
        return load(layout)
    except EnsembleTrustError:
        raise
    except EnsembleError:
        return None


def _job_of(found: Found) -> str:
    if found.start is not None and found.start.job_id:
        return found.start.job_id
    return found.ensemble.job_id if found.ensemble is not None else ""


def wait_serving(layout: Layout, job_id: str, timeout: float, slurm: Slurm, say: Say) -> Ensemble:
    """Until ``ensemble.json`` names this job; ``timeout`` counts from the job's start, the
    queue is waited out (Ctrl-C leaves the job queued; ``zk status`` follows it)."""
    told_pending = False
    started: float | None = None
    while True:
        ensemble = _quietly(files.load_ensemble, layout)
        if ensemble is not None and ensemble.job_id == job_id:
            return ensemble  # type: ignore[no-any-return]
        status = _job_listed(slurm, job_id)
        if status is None:
            raise EnsembleError(
                f"The ensemble's Slurm job {job_id} ended before it served; "
                f"{_last_words(layout, job_id)}"
            )
        if status.state == "PENDING":
            if not told_pending and status.reason != "None":  # "None": about to start
                say(f"Waiting for Slurm to start job {job_id} (pending: {status.reason}).")
                told_pending = True
        elif started is None:
            started = time.monotonic()
        elif time.monotonic() - started > timeout:
            raise EnsembleError(
                f"The ensemble's Slurm job {job_id} runs but did not serve within {timeout:g} s; "
                f"{_last_words(layout, job_id)} `hpc-elastic zk stop` ends it."
            )
        time.sleep(POLL_S)


def _last_words(layout: Layout, job_id: str) -> str:
    """The last line a server or the job printed, to say why, and where to read more."""
    lines: list[str] = []
    for path in [layout.slurm_output(job_id), *sorted(layout.run_dir.glob("server-*.log"))]:
        with contextlib.suppress(OSError):
            lines += [
                line for line in path.read_text(errors="replace").splitlines() if line.strip()
            ]
    said = [line for line in lines if "hpc-elastic zk server" in line] or lines
    last = f"it said: {one_line(said[-1].strip())[:300]}; " if said else ""
    return f"{last}see {layout.run_dir}."


def _remove_run_dir(layout: Layout) -> None:
    if layout.run_dir.exists() and trust.private_dir_problem(layout.run_dir) is None:
        shutil.rmtree(layout.run_dir, ignore_errors=True)


# --- zk status -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerView:
    server: Server
    health: fourletter.Health
    slurm: str
    joining: bool = False
    """Started on a spare node in the place of a lost server, not a member yet."""


@dataclass(frozen=True)
class User:
    run_id: str
    job_id: str
    state: str


@dataclass(frozen=True)
class StatusView:
    """``zk status``, gathered: the ensemble, each server, and the jobs that use it."""

    ensemble: Ensemble | None
    start: StartRecord | None
    job_state: str
    servers: list[ServerView]
    state: str
    """serving, degraded, no quorum, starting (not serving yet), or none."""
    users: list[User]
    file: Path
    warnings: list[str]
    spares: list[str] | None = None
    """The spare nodes still free in the job; None when the ensemble has none."""

    @property
    def members(self) -> list[ServerView]:
        return [view for view in self.servers if not view.joining]

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "connect": self.ensemble.connect if self.ensemble else None,
            "job_id": (self.ensemble.job_id if self.ensemble else None)
            or (self.start.job_id if self.start else None),
            "job_state": self.job_state,
            "file": str(self.file),
            "servers": [
                {
                    **asdict(view.server),
                    **asdict(view.health),
                    "slurm": view.slurm,
                    "joining": view.joining,
                }
                for view in self.servers
            ],
            "retired": [asdict(server) for server in self.retired],
            "spares": self.spares,
            "users": [asdict(user) for user in self.users],
            "warnings": self.warnings,
        }

    @property
    def retired(self) -> tuple[Server, ...]:
        return self.ensemble.retired if self.ensemble else ()


def gather(
    found: Found,
    slurm: Slurm | None = None,
    records: Callable[[], Iterable[Any]] | None = None,
) -> StatusView:
    """Ask every server (``mntr``), Slurm (the job and its steps) and the user's jobs."""
    slurm = slurm or slurm_layer()
    warnings: list[str] = []
    job_id = _job_of(found)
    job: JobStatus | None = None
    steps: dict[str, dict[str, str]] = {}
    if job_id:
        try:
            job = _job_listed(slurm, job_id)
            steps = slurm.job_steps(job_id) if job is not None else {}
        except SlurmError as error:
            warnings.append(str(error))
    views = [
        ServerView(
            server,
            fourletter.health(server.host, server.client_port),
            step_state(server, job, steps) if job_id else "not a Slurm job",
            joining,
        )
        for server, joining in _servers(found)
    ]
    if found.ensemble is None and found.start is None:
        state = "none"
    elif found.ensemble is None:
        state = "starting"
    else:
        state = fourletter.quorum_state([view.health for view in views if not view.joining])
    users = _users(found.ensemble, slurm, records, warnings) if found.ensemble else []
    job_nodes = _job_nodes(job)
    spares = None
    if found.start is not None and found.start.spares and job_nodes is not None:
        busy = {view.server.node for view in views}
        spares = [node for node in job_nodes if node not in busy]
    supervisor = _quietly(files.load_supervisor, found.layout)
    lost = supervisor_lost(supervisor.node if supervisor else None, job_nodes)
    if lost:
        warnings.append(lost)
    return StatusView(
        found.ensemble,
        found.start,
        job.state if job else ("ended" if job_id else "-"),
        views,
        state,
        users,
        found.layout.ensemble_file,
        warnings,
        spares,
    )


def supervisor_lost(node: str | None, job_nodes: Sequence[str] | None) -> str | None:
    """A sentence when the node that runs the ensemble's supervisor (Slurm's batch host) has
    left the running job: Slurm keeps the job and its other steps (``--no-kill``), but no
    server will be started again in place or replaced any more."""
    if node is None or job_nodes is None or node in job_nodes:
        return None
    return (
        f"the node that runs the ensemble's supervisor ({node}) has left its job, so no server "
        "will be started again or replaced; the servers left serve on, and a new ensemble "
        "(`hpc-elastic zk stop`, then `zk start`) between jobs restores that"
    )


def _job_nodes(job: JobStatus | None) -> list[str] | None:
    """The nodes of the running job, as Slurm lists them now (a lost node has left)."""
    from hpc_elastic.ensemble.supervisor import expand_nodelist  # noqa: PLC0415

    if job is None or job.state != "RUNNING" or not job.nodes:
        return None
    return expand_nodelist(job.nodes)


def _servers(found: Found) -> list[tuple[Server, bool]]:
    """Each server, and whether it is still joining: the members of the ensemble file, as
    they last published themselves (their current step), then the servers that published
    themselves but are no members yet (started in the place of a lost one). Before the
    ensemble first serves, every published server."""
    peers: dict[int, Server] = {}
    with contextlib.suppress(EnsembleError):
        peers = files.load_peers(found.layout) if found.start is not None else {}
    if found.ensemble is None:
        return [(peers[myid], False) for myid in sorted(peers)]
    members = {server.myid: peers.get(server.myid, server) for server in found.ensemble.servers}
    gone = {server.myid for server in found.ensemble.retired}
    joining = {
        myid: server
        for myid, server in peers.items()
        if myid not in members and myid not in gone and found.ensemble.job_id
    }
    listed = [(server, False) for server in members.values()]
    listed += [(server, True) for server in joining.values()]
    return sorted(listed, key=lambda item: item[0].myid)


def _users(
    ensemble: Ensemble,
    slurm: Slurm,
    records: Callable[[], Iterable[Any]] | None,
    warnings: list[str],
) -> list[User]:
    """The user's jobs that use the ensemble and that Slurm still lists."""
    candidates = users_of(ensemble, (records or _all_records)())
    if not candidates:
        return []
    try:
        queue = slurm.squeue([record.job_id for record in candidates])
    except SlurmError as error:
        warnings.append(str(error))
        return [User(record.run_id, record.job_id, "unknown") for record in candidates]
    listed: dict[str, str] = {}
    for status in queue:
        listed.setdefault(status.job_id, status.state)
        if status.state == "RUNNING":
            listed[status.job_id] = "RUNNING"
    return [
        User(record.run_id, record.job_id, listed[record.job_id])
        for record in candidates
        if record.job_id in listed
    ]


def _all_records() -> list[Any]:
    """Every job of the user's (the index and the configured log directory)."""
    from hpc_elastic.ops import jobs  # noqa: PLC0415

    return jobs.everywhere(jobs.log_dir())


def render(view: StatusView) -> list[str]:
    """``zk status`` as text."""
    if view.state == "none":
        return [
            "No ensemble of yours runs; start one with `hpc-elastic zk start` "
            "(docs/cluster-setup.md)."
        ]
    job_id = (view.ensemble.job_id if view.ensemble else "") or (
        view.start.job_id if view.start else ""
    )
    where = f"Slurm job {job_id} ({view.job_state})" if job_id else "hpc-elastic zk serve"
    lines = [f"Ensemble  {where}: {view.state.upper()}"]
    if view.ensemble is not None:
        count = len(view.ensemble.servers)
        up = sum(server.health.serving for server in view.members)
        lines.append(
            f"Servers   {up} of {count} serving; it serves while {zoocfg.quorum(count)} do "
            f"(survives losing {zoocfg.survives(count)})"
        )
        lines.append(f"Connect   {view.ensemble.connect}")
    if view.spares is not None:
        lines.append(f"Spares    {', '.join(view.spares) or 'none left'}")
    lines += [_replaced_line(server, view) for server in view.retired]
    lines.append(f"File      {view.file}")
    lines.append("")
    header = ("Server", "Node", "Address", "Mode", "Clients", "Latency avg/max ms", "Slurm")
    rows = [header]
    for item in view.servers:
        health = item.health
        latency = (
            f"{health.latency_avg_ms:.1f}/{health.latency_max_ms:.0f}"
            if health.latency_avg_ms is not None and health.latency_max_ms is not None
            else "-"
        )
        rows.append(
            (
                f"{item.server.myid}"
                + (f" (start {item.server.incarnation})" if item.server.incarnation > 1 else "")
                + (f" (for {item.server.replaces})" if item.server.replaces else ""),
                item.server.node or "-",
                item.server.address,
                f"joining ({health.mode})" if item.joining else health.mode,
                "-" if health.clients is None else str(health.clients),
                latency,
                f"{item.server.step} {item.slurm}".strip() if item.server.step else item.slurm,
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines += [
        "  "
        + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.append("")
    if view.users:
        used = ", ".join(
            f"{user.run_id} (Slurm job {user.job_id}, {user.state})" for user in view.users
        )
        lines.append(f"Used by   {used}")
    else:
        lines.append("Used by   no job of yours that Slurm still lists")
    return lines


def _replaced_line(retired: Server, view: StatusView) -> str:
    """``Replaced  server 2 (s2, 10.1.4.18:32625) by server 4 on s4``."""
    successor = next(
        (
            item.server
            for item in view.servers
            if item.server.replaces == retired.myid and not item.joining
        ),
        None,
    )
    by = f" by server {successor.myid} on {successor.node}" if successor else ""
    return f"Replaced  server {retired.myid} ({retired.node or '-'}, {retired.address}){by}"


# --- zk stop ---------------------------------------------------------------------------------


def stop(
    found: Found,
    force: bool,
    say: Say,
    *,
    slurm: Slurm | None = None,
    records: Callable[[], Iterable[Any]] | None = None,
    wait_s: float = STOP_WAIT_S,
) -> None:
    """End the ensemble: refused while a job of the user's still uses it (unless ``force``);
    then every server stops, the job leaves the queue, and its records go."""
    slurm = slurm or slurm_layer()
    layout = found.layout
    job_id = _job_of(found)
    if found.ensemble is None and found.start is None:
        say("No ensemble of yours runs; nothing to stop.")
        return
    if found.ensemble is not None and not force:
        users = _users(found.ensemble, slurm, records, [])
        if users:
            named = ", ".join(
                f"{user.run_id} (Slurm job {user.job_id}, {user.state})" for user in users
            )
            raise EnsembleError(
                f"{_capitalized(found.ensemble.describe())} is still used by {named}; cancel "
                f"{'it' if len(users) == 1 else 'them'} first (`hpc-elastic cancel "
                f"{users[0].job_id}`), or pass --force to end the ensemble under "
                f"{'it' if len(users) == 1 else 'them'}."
            )
    servers = [
        *(found.ensemble.servers if found.ensemble else ()),
        *(found.ensemble.retired if found.ensemble else ()),
        *(_quietly(files.load_peers, layout) or {}).values(),
    ]
    if job_id:
        _stop_job(layout, job_id, slurm, wait_s, say, servers=servers)
    elif found.ensemble is not None:
        _stop_serve(found.ensemble, wait_s)
    still = sorted({server.address for server in servers if _answers(server)})
    if still:
        raise EnsembleError(
            f"ZooKeeper still answers at {', '.join(still)} after its job ended; find the "
            "process on that node (`ss -ltnp`) and end it, then run `hpc-elastic zk stop` again."
        )
    _remove_run_dir(layout)
    layout.ensemble_file.unlink(missing_ok=True)
    which = found.ensemble.describe() if found.ensemble else f"the ensemble (Slurm job {job_id})"
    say(f"Stopped {which}; nothing of it is left.")


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def _answers(server: Server) -> bool:
    return fourletter.health(server.host, server.client_port, timeout=1.0).mode != "down"


def _stop_job(
    layout: Layout, job_id: str, slurm: Slurm, wait_s: float, say: Say, *, servers: Sequence[Server]
) -> None:
    """SIGTERM to every server step (each stops ZooKeeper and removes its node-local
    directory; the 'stopping' file keeps them from being started again), the job's last
    step cleans up; a job still listed after ``wait_s`` is cancelled outright. A job whose
    supervisor's node was lost has no script left to end it: once no server answers, it is
    cancelled at once."""
    with contextlib.suppress(EnsembleError):
        files.write_private(layout.stopping_file, b"")
    status = _job_listed(slurm, job_id)
    if status is None:
        return
    if status.state == "RUNNING":
        slurm.cancel(job_id, signal="TERM")
    else:
        slurm.cancel(job_id)
    supervisor = _quietly(files.load_supervisor, layout)
    nodes = _job_nodes(status)
    if supervisor_lost(supervisor.node if supervisor else None, nodes):
        # Each server removes its own directory once ZooKeeper has stopped; its step ends
        # then. Slurm still lists the steps of a lost node as running: those are not waited for.
        steps = {server.step for server in servers if nodes and server.node in nodes}
        deadline = time.monotonic() + wait_s
        while steps & set(slurm.job_steps(job_id)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        slurm.cancel(job_id)
    if _wait_gone(slurm, job_id, wait_s):
        return
    say(f"Slurm job {job_id} did not end within {wait_s:g} s of SIGTERM; cancelling it.")
    slurm.cancel(job_id)
    if not _wait_gone(slurm, job_id, wait_s):
        raise EnsembleError(
            f"Slurm job {job_id} is still listed {2 * wait_s:g} s after `scancel`; check it "
            f"with `squeue -j {job_id}` and run `hpc-elastic zk stop` again."
        )


def _wait_gone(slurm: Slurm, job_id: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while _job_listed(slurm, job_id) is not None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _stop_serve(ensemble: Ensemble, wait_s: float) -> None:
    """A ``zk serve`` of this user's on this host is sent SIGTERM; elsewhere, it is named."""
    import signal  # noqa: PLC0415
    import socket  # noqa: PLC0415

    server = ensemble.servers[0]
    if server.node != socket.gethostname() or not _is_our_serve(server.pid):
        if _answers(server):
            raise EnsembleError(
                f"Your ensemble is `hpc-elastic zk serve` at {server.address} on "
                f"{server.node}; stop it there (Ctrl-C, or `systemctl stop` for a service)."
            )
        return
    os.kill(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while _is_our_serve(server.pid) and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _is_our_serve(pid: int) -> bool:
    """Whether ``pid`` is a live ``hpc-elastic zk serve`` of this user's (never another
    process that got the pid since)."""
    try:
        info = os.stat(f"/proc/{pid}")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return info.st_uid == os.geteuid() and b"zk" in argv and b"serve" in argv
