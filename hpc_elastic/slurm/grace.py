"""Does a checkpoint still fit in the time Slurm leaves? Measured saves against the signal lead
and the partition's (or QoS's) GraceTime.

When Slurm stops a slot, the workers finish their step, save and exit: that takes one step
plus one save. Two clocks bound it:

* **the time limit**: the job's ``--signal=SIG@LEAD`` arrives LEAD seconds before the end;
* **preemption**: with ``preempt_send_user_signal`` the signal comes when the preemption
  starts, and Slurm kills the task ``GraceTime`` seconds later (the partition's with
  ``preempt/partition_prio``, the QoS's with ``preempt/qos``). A partition or QoS that is
  never preempted has no such bound.

A save that grows with the model (or a file system that slows down) can outgrow either
without anyone noticing until the first preemption loses its save. So every agent times the
saves its ranks make (``SaveClock``, from the heartbeat: a rank marks it "STEP checkpoint"
when a save starts and writes the step back when it ends, so both edges are the file's
mtimes) and its steps, and after each save compares them with what Slurm leaves (``check``).
When the save no longer fits, the job's timeline gets one ``grace`` event with the figures
(one per job: the first agent to claim ``slots/grace-warned`` writes it), ``status`` shows it,
and, with ``--grace-action lead``, each agent moves its own time-limit signal earlier: it
stops its slot itself ``moved_lead`` seconds before its end, through the time-limit path.
Preemption cannot be moved earlier; with ``--grace-action local`` the save is made smaller
instead: the agent publishes the decision in the job directory (``JobDir.local_first``) and
the save a stopping loop makes goes to the node-local tier only, its shared copy written at
the next start (``train.local_tier``, docs/unattended.md).

``hpc-elastic doctor`` runs the same ``check`` before submit, from the partition's settings
and a save measured in the checkpoint directory (or given by hand).
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpc_elastic.errors import SlurmError

log = logging.getLogger(__name__)

SAVES_KEPT = 5
"""The newest saves a verdict rests on: the slowest of them is the save to plan for."""
STEPS_KEPT = 50
POLL_S = 0.5
"""Seconds between two reads of the ranks' heartbeats; the heartbeat itself writes at most
every 0.5 s, so a save shorter than that may be missed, and it fits anyway."""
LEAD_FACTOR = 1.5
LEAD_MARGIN_S = 10.0
"""``moved_lead``: half as much again as a step and a save take, plus ten seconds for the
agent's own way out (its drain, leaving the rendezvous, the requeue)."""


# --- measuring: pure, fed with heartbeat readings -------------------------------------------


@dataclass(frozen=True)
class Beat:
    """One heartbeat file as read: its mtime, the step it holds, and the checkpoint mark."""

    mtime: float
    step: int | None
    checkpointing: bool


def parse_beat(text: str, mtime: float) -> Beat:
    """``"1200"`` or ``"1200 checkpoint"`` (protocol/heartbeat.py) with the file's mtime."""
    words = text.split()
    step = int(words[0]) if words and words[0].isdigit() else None
    return Beat(mtime, step, words[1:] == ["checkpoint"])


@dataclass
class SaveClock:
    """Save and step durations from successive readings of each rank's heartbeat."""

    saves: deque[float] = field(default_factory=lambda: deque(maxlen=SAVES_KEPT))
    steps: deque[float] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    _last: dict[str, Beat] = field(default_factory=dict)

    def observe(self, rank: str, beat: Beat) -> float | None:
        """Learn from a reading of ``rank``'s heartbeat; the save's seconds when one ended."""
        last = self._last.get(rank)
        if last is not None and beat.mtime <= last.mtime:
            return None
        self._last[rank] = beat
        if last is None:
            return None
        if last.checkpointing and not beat.checkpointing:
            seconds = beat.mtime - last.mtime  # the mark's mtime is the save's start
            self.saves.append(seconds)
            log.debug("grace: rank %s saved in %.2f s", rank, seconds)
            return seconds
        if (
            not last.checkpointing
            and not beat.checkpointing
            and last.step is not None
            and beat.step is not None
            and beat.step > last.step
        ):
            self.steps.append((beat.mtime - last.mtime) / (beat.step - last.step))
        return None

    def save_s(self) -> float | None:
        """The save to plan for: the slowest of the newest ones."""
        return max(self.saves) if self.saves else None

    def step_s(self) -> float:
        """A step, as the median of the newest ones (0 before any is known)."""
        return statistics.median(self.steps) if self.steps else 0.0


# --- what Slurm leaves: pure, from Slurm's records -------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The time Slurm leaves a stopping slot."""

    lead_s: float
    """``--signal``'s lead before the time limit (``--grace`` of the agent)."""
    grace_s: float | None
    """GraceTime after a preemption starts; None when the slot is never preempted."""
    where: str
    """Whose GraceTime: ``partition 'low'`` or ``QoS 'scavenger'``."""
    preempt_mode: str
    time_limited: bool = True
    """False for a job without a time limit: the lead then never matters."""


def seconds(text: str) -> float:
    """Slurm's ``20`` (GraceTime in ``scontrol show partition``) or ``00:00:20`` (sacctmgr)."""
    value = text.strip()
    if value.isdigit():
        return float(value)
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", value)
    if match is None:
        raise SlurmError(
            f"Slurm printed the GraceTime '{text}', which is not seconds or [D-]HH:MM:SS; "
            "check that `scontrol` and `sacctmgr` are Slurm's."
        )
    days, hours, minutes, secs = (int(group or 0) for group in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + secs)


@dataclass(frozen=True)
class QosRow:
    """One QoS as ``sacctmgr -nP show qos format=Name,GraceTime,PreemptMode,Preempt`` prints it."""

    name: str
    grace_time: str
    preempt_mode: str
    preempts: tuple[str, ...]


def limits_from(
    lead_s: float,
    job: Mapping[str, str],
    config: Mapping[str, str],
    partition: Mapping[str, str],
    qos: Mapping[str, QosRow],
) -> Limits:
    """The limits of the slot ``job`` (its ``scontrol show job`` record) from the cluster's
    config, its partition's record and the QoS table (empty without accounting).

    With ``preempt/qos`` the slot is preemptible when some QoS lists its QoS in ``Preempt``,
    and its GraceTime is its QoS's; with ``preempt/partition_prio`` when its partition's
    PreemptMode is not OFF, and its GraceTime is the partition's."""
    preempt_type = config.get("PreemptType", "preempt/none")
    mode = partition.get("PreemptMode") or config.get("PreemptMode", "OFF")
    time_limited = job.get("TimeLimit", "UNLIMITED") not in ("UNLIMITED", "Partition_Limit")
    name = job.get("QOS", "")
    if preempt_type == "preempt/qos" and name in qos:
        own = qos[name]
        preemptible = any(name in row.preempts for row in qos.values())
        if own.preempt_mode.lower() not in ("", "cluster"):
            mode = own.preempt_mode.upper()
        grace = seconds(own.grace_time or "0") if preemptible else None
        return Limits(lead_s, grace, f"QoS '{name}'", mode, time_limited)
    preemptible = preempt_type != "preempt/none" and mode.upper() != "OFF"
    grace = seconds(partition.get("GraceTime", "0")) if preemptible else None
    where = f"partition '{partition.get('PartitionName', job.get('Partition', '?'))}'"
    return Limits(lead_s, grace, where, mode, time_limited)


@dataclass(frozen=True)
class Fit:
    """A save and a step against the limits: which of the two bounds they outgrow."""

    save_s: float
    step_s: float
    limits: Limits

    @property
    def need_s(self) -> float:
        return self.save_s + self.step_s

    @property
    def lead_short(self) -> bool:
        return self.limits.time_limited and self.need_s > self.limits.lead_s

    @property
    def grace_short(self) -> bool:
        return self.limits.grace_s is not None and self.need_s > self.limits.grace_s

    @property
    def fits(self) -> bool:
        return not (self.lead_short or self.grace_short)

    def sentence(self) -> str:
        """The figures and what they mean, in one sentence."""
        need = f"a save of {self.save_s:.1f} s plus a step of {self.step_s:.1f} s"
        limits = self.limits
        found = []
        if self.grace_short:
            found.append(
                f"outgrow the GraceTime of {limits.grace_s:.0f} s of {limits.where} "
                f"(PreemptMode {limits.preempt_mode}): a preemption kills the save"
            )
        if self.lead_short:
            found.append(
                f"outgrow the --signal lead of {limits.lead_s:.0f} s: the time limit kills the save"
            )
        if not found:
            bounds = [f"the --signal lead of {limits.lead_s:.0f} s"]
            if limits.grace_s is not None:
                bounds.append(f"the GraceTime of {limits.grace_s:.0f} s of {limits.where}")
            return f"{need} fit {' and '.join(bounds)}"
        return f"{need} {' and '.join(found)}"

    def advice(self) -> str:
        """What to do about it, in one sentence."""
        fixes = []
        if self.lead_short:
            fixes.append(f"submit with --signal USR2@{math.ceil(moved_lead(self.need_s))}")
        if self.grace_short:
            fixes.append(
                f"ask for a GraceTime of {math.ceil(moved_lead(self.need_s))} s or more, save "
                "less (a sharded checkpoint, or a stop's save to --local-checkpoint-dir with "
                "--grace-action local), or run where jobs are not preempted"
            )
        return "; ".join(fixes)


def check(save_s: float, step_s: float, limits: Limits) -> Fit:
    return Fit(save_s, step_s, limits)


def moved_lead(need_s: float) -> float:
    """The time-limit signal lead that leaves room for ``need_s`` (``--grace-action lead``)."""
    return LEAD_FACTOR * need_s + LEAD_MARGIN_S


def parse_end_time(text: str) -> float | None:
    """``scontrol show job``'s ``EndTime=2026-12-03T08:00:00`` (the node's local time) as
    epoch seconds; None for ``Unknown`` or a job without one."""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


# --- acting: the agent's thread ------------------------------------------------------------


class GraceWatch:
    """One agent's save timer, on a daemon thread: reads the heartbeats in ``run_dir`` every
    ``POLL_S``; after each save, asks for the limits once (``limits``) and checks the fit.
    The first misfit is ``warn``ed (the caller writes the event once per job); with ``lead``
    the slot stops itself ``moved_lead`` seconds before its end (``stop_at``)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        limits: Callable[[], Limits | None],
        warn: Callable[[Fit], None],
        stop_at: Callable[[float], None] | None = None,
        clock: SaveClock | None = None,
    ) -> None:
        self._run_dir = run_dir
        self._limits = limits
        self._known: Limits | None = None
        self._warn = warn
        self._stop_at = stop_at
        self.clock = clock or SaveClock()
        self.warned: Fit | None = None
        self.lead: float | None = None
        """The moved lead, once ``lead`` acted."""
        self._stop = threading.Event()

    def start(self) -> GraceWatch:
        threading.Thread(target=self._run, name="hpc-elastic-grace", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # A thread of its own: say so, and look again next time.
                log.exception("the save timer failed this time")

    def poll(self) -> Fit | None:
        """Read every heartbeat once; the verdict after a save that ended, else None."""
        ended = False
        for path in sorted(self._run_dir.glob("heartbeat_*")):
            if "." in path.name:  # the collective marker, a writer's temporary file
                continue
            try:
                mtime = path.stat().st_mtime
                text = path.read_text()
            except OSError:
                continue
            ended |= self.clock.observe(path.name, parse_beat(text, mtime)) is not None
        return self.judge() if ended else None

    def judge(self) -> Fit | None:
        save = self.clock.save_s()
        if save is None:
            return None
        if self._known is None:
            self._known = self._limits()
            if self._known is None:
                return None
        fit = check(save, self.clock.step_s(), self._known)
        log.debug("grace: %s", fit.sentence())
        if not fit.fits and self.warned is None:
            self.warned = fit
            self._warn(fit)
            if fit.lead_short and self._stop_at is not None:
                self.lead = moved_lead(fit.need_s)
                self._stop_at(self.lead)
        return fit
