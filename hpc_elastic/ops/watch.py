"""``hpc-elastic watch``: a watcher outside the job, run from scrontab or cron on a login node.

A job's own alerts (``--notify``) come from its agents; a job whose agents are all gone (every
slot pending or held, a node crash that took the last one, agents that hang) says nothing. So
``watch`` looks at every job of the user's that Slurm still lists, from outside, and raises:

* ``stalled``: no slot has run for ``dead_after`` seconds (every slot pending, held or gone);
* ``heartbeat``: slots run, but the job's heartbeat (``<job dir>/heartbeat.json``, written
  every ``jobdir.BEAT_S`` by one agent of the job: the lowest running slot) is older than
  ``heartbeat_after``, or its training step has not moved for that long: the dead man's
  switch;
* ``goodput``: after ``goodput_after`` seconds of wall time, the job's goodput (the ``status``
  figure) is under ``min_goodput``.

Each incident is alerted once, through the job's own ``--notify`` URL (else the watcher's),
and once more when it ends (``recovered``). What was alerted, and since when each condition
holds, is kept in the user's state directory (``watch.json``, mode 0600), since every run is
a new process. Everything here but ``watch`` itself is a pure rule over plain values.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpc_elastic.events import Event
from hpc_elastic.jobdir import Beat, JobRecord, index_file, read_beat, write_private
from hpc_elastic.slurm.commands import JobStatus

log = logging.getLogger(__name__)

DEAD_AFTER = 900.0
HEARTBEAT_AFTER = 900.0
GOODPUT_AFTER = 3600.0
MIN_GOODPUT = 0.5
"""The defaults of ``watch``'s thresholds (``--dead-after`` ... ``--min-goodput``)."""
ENDED = "recovered"
"""The alert kind that says an incident ended."""


# --- the rules ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Thresholds:
    dead_after: float = DEAD_AFTER
    heartbeat_after: float = HEARTBEAT_AFTER
    min_goodput: float = MIN_GOODPUT
    goodput_after: float = GOODPUT_AFTER


@dataclass(frozen=True)
class Look:
    """What one run of the watcher sees of one job that Slurm lists."""

    running: int
    """Array tasks (or the allocation) Slurm shows RUNNING."""
    quiet_since: float
    """When the job last showed life: its newest event, or its start."""
    beat: Beat | None
    goodput: float | None
    """Productive over wall time, once the wall time passed ``goodput_after``; else None."""


@dataclass
class Incident:
    """One condition of one job, while it holds."""

    since: float
    sentence: str
    alerted: bool = False


@dataclass
class JobWatch:
    """What the watcher remembers of one job between runs."""

    incidents: dict[str, Incident] = field(default_factory=dict)
    step: int | None = None
    step_since: float | None = None
    """The newest step the job's heartbeat showed, and since when it has not moved."""
    running_since: float | None = None
    """Since when the watcher has seen a slot run (None: none ran at its last look)."""


def conditions(look: Look, memory: JobWatch, now: float, limits: Thresholds) -> dict[str, str]:
    """The conditions that hold now (kind -> sentence), and when each began (in ``memory``'s
    step tracking). Pure but for ``memory.step``/``step_since``, which it updates."""
    found: dict[str, str] = {}
    if look.running == 0:
        memory.running_since = memory.step = memory.step_since = None
        quiet = now - look.quiet_since
        found["stalled"] = (
            f"no slot of the job has run for {quiet:.0f} s: every slot is pending, held or gone"
        )
    else:
        if memory.running_since is None:
            memory.running_since = now
        beat = look.beat
        if beat is not None and beat.step is not None and beat.step != memory.step:
            memory.step, memory.step_since = beat.step, now
        # Timed from the later of the last beat and the first sight of a running slot: a job
        # just released from a hold has not beaten yet, and is no dead man.
        last = max(memory.running_since, beat.at if beat is not None else memory.running_since)
        if now - last >= limits.heartbeat_after:
            found["heartbeat"] = (
                f"{look.running} slot(s) run, but the job's heartbeat stopped {now - last:.0f} s "
                "ago: its agents may hang or be gone"
            )
        elif memory.step_since is not None and now - memory.step_since >= limits.heartbeat_after:
            found["heartbeat"] = (
                f"the job's step has stayed at {memory.step} for {now - memory.step_since:.0f} s "
                "while its slots run"
            )
    if look.goodput is not None and look.goodput < limits.min_goodput:
        found["goodput"] = (
            f"goodput is {100 * look.goodput:.0f} %, under {100 * limits.min_goodput:.0f} %: "
            "`hpc-elastic status` says where the time goes"
        )
    return found


def delay(kind: str, limits: Thresholds) -> float:
    """How long a condition must hold before it is alerted."""
    return {"stalled": limits.dead_after, "heartbeat": 0.0}.get(kind, 0.0)


def step(
    memory: JobWatch,
    found: Mapping[str, str],
    started: Mapping[str, float],
    now: float,
    limits: Thresholds,
) -> list[tuple[str, str]]:
    """Update ``memory`` with the conditions ``found`` now (``started``: when each began, if
    known better than now) and return the alerts to send, as (kind, sentence): a condition
    held for its delay is alerted once; an alerted one that no longer holds is said to end."""
    alerts: list[tuple[str, str]] = []
    for kind in sorted(set(memory.incidents) - set(found)):
        ended = memory.incidents.pop(kind)
        if ended.alerted:
            alerts.append((ENDED, f"{kind} is over after {now - ended.since:.0f} s"))
    for kind, sentence in sorted(found.items()):
        incident = memory.incidents.get(kind)
        if incident is None:
            incident = Incident(min(now, started.get(kind, now)), sentence)
            memory.incidents[kind] = incident
        incident.sentence = sentence
        if not incident.alerted and now - incident.since >= delay(kind, limits):
            incident.alerted = True
            alerts.append((kind, sentence))
    return alerts


# --- state between runs ------------------------------------------------------------------


def state_file(environ: Mapping[str, str] = os.environ) -> Path:
    """``watch.json`` beside the user's job index, in the user's state directory."""
    return index_file(environ).parent / "watch.json"


def load_state(path: Path) -> dict[str, JobWatch]:
    """The watcher's memory; a missing or unreadable file starts afresh (at worst, one alert
    is repeated)."""
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    memory: dict[str, JobWatch] = {}
    for run_id, job in raw.items() if isinstance(raw, dict) else ():
        try:
            incidents = {
                kind: Incident(float(item["since"]), str(item["sentence"]), bool(item["alerted"]))
                for kind, item in job.get("incidents", {}).items()
            }
            numbers = [job.get(key) for key in ("step", "step_since", "running_since")]
            step_, since, running = (
                value if isinstance(value, int | float) and not isinstance(value, bool) else None
                for value in numbers
            )
            memory[str(run_id)] = JobWatch(
                incidents,
                None if step_ is None else int(step_),
                None if since is None else float(since),
                None if running is None else float(running),
            )
        except (AttributeError, KeyError, TypeError, ValueError):
            continue
    return memory


def save_state(path: Path, memory: Mapping[str, JobWatch]) -> None:
    """Written 0600 in a 0700 directory, then renamed over the last one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    write_private(scratch, json.dumps({run: asdict(job) for run, job in memory.items()}))
    scratch.replace(path)


# --- one run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One job as this run found it: its record, its look, and when its conditions began."""

    record: JobRecord
    look: Look | None
    """None: Slurm no longer lists it, or its agents said it is over."""
    started: Mapping[str, float] = field(default_factory=dict)


Post = Callable[[JobRecord, str, str], None]
"""Send one alert (kind, sentence) about a job."""


def watch(
    seen: Sequence[Seen],
    memory: dict[str, JobWatch],
    now: float,
    limits: Thresholds,
    post: Post,
) -> int:
    """One run over the jobs ``seen``; returns the alerts sent. A job that is over is
    forgotten, after its open incidents are said to end."""
    sent = 0
    for job in seen:
        run_id = job.record.run_id
        kept = memory.get(run_id, JobWatch())
        if job.look is None:
            alerts = step(kept, {}, {}, now, limits)
            memory.pop(run_id, None)
        else:
            found = conditions(job.look, kept, now, limits)
            alerts = step(kept, found, job.started, now, limits)
            memory[run_id] = kept
        for kind, sentence in alerts:
            log.debug("watch: %s %s: %s", run_id, kind, sentence)
            post(job.record, kind, sentence)
            sent += 1
    return sent


def look_at(
    record: JobRecord,
    *,
    statuses: Sequence[JobStatus],
    history: Sequence[Event],
    state: str,
    goodput: tuple[float, float],
    limits: Thresholds,
) -> Seen:
    """The watcher's view of one job from Slurm's lines (``JobStatus``), its events, its
    ``job_state`` and its goodput (ratio, wall seconds)."""
    if state not in ("running", "pending", "held"):
        return Seen(record, None)
    running = sum(1 for status in statuses if status.state in ("RUNNING", "CONFIGURING"))
    quiet = max((event.time for event in history), default=_record_time(record))
    ratio, wall = goodput
    look = Look(
        running=running,
        quiet_since=quiet,
        beat=read_beat(record.job_dir),
        goodput=ratio if wall >= limits.goodput_after else None,
    )
    return Seen(record, look, {"stalled": quiet})


def _record_time(record: JobRecord) -> float:
    try:
        return record.paths.record.stat().st_mtime
    except OSError:
        return time.time()


def forget_unknown(memory: dict[str, JobWatch], known: set[str]) -> None:
    """Jobs the watcher no longer finds at all (their directory deleted) are forgotten."""
    for run_id in set(memory) - known:
        del memory[run_id]
