"""``hpc-elastic drill``: a preemption drill on a running job, and the figures it leaves.

A job's reaction to preemption is only known once one happens, usually at night. A drill makes
one on purpose: it picks a random running slot and acts the ``kind``, as Slurm would:

* ``preempt``: the job's own ``--signal`` to the slot's steps, and, if the slot has not
  requeued itself within its grace, ``scontrol requeue`` (Slurm's requeue after GraceTime);
* ``requeue``: ``scontrol requeue`` at once (SIGTERM to the slot, as an admin's requeue);
* ``node-kill``: SIGKILL to every process of the slot, then ``scontrol requeue`` (what Slurm
  does for a task whose node died).

Then it waits for the job to train at full size again and reports: the time from the act to
the first step at full size, the steps redone, the grace margin (the signal lead minus the time
from the signal to the committed save, ``preempt`` only), and whether the step log is clean
(no step missing, none repeated but the redone ones after a resume). Everything here is a pure
rule over the job's events and step log; ``commands/drill.py`` acts and waits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hpc_elastic.events import CheckpointDetails, Event, Kind, RoundDetails

KINDS = ("preempt", "requeue", "node-kill")
STEP_LINE = re.compile(r"^step=(\d+)\b", re.MULTILINE)
"""A step line of the job's step log (``examples/train.py --log-file``): ``step=12 ...``."""


def log_steps(text: str) -> list[int]:
    """The steps of a step log, in the order they were logged."""
    return [int(match.group(1)) for match in STEP_LINE.finditer(text)]


@dataclass(frozen=True)
class StepCheck:
    """What a step log says about the job's restarts."""

    redone: int
    """Steps logged again after a resume (the work a restart threw away)."""
    problems: tuple[str, ...] = ()
    """One sentence per fault: a step missing, or one logged again but not from a resume."""

    @property
    def clean(self) -> bool:
        return not self.problems


def check_steps(steps: Sequence[int], committed: Iterable[int], since: int = 0) -> StepCheck:
    """Walk the step log from its line ``since``: each step must follow the one before, or
    go back to one past a committed checkpoint (a resume); going forward by more than one
    misses steps, going back elsewhere repeats them."""
    saved = set(committed)
    redone = 0
    problems: list[str] = []
    for before, step in zip(steps[since:], steps[since + 1 :], strict=False):
        if step == before + 1:
            continue
        if step > before + 1:
            problems.append(
                f"steps {before + 1}..{step - 1} are missing (the log went {before} -> {step})"
            )
        elif step - 1 in saved or (step == 1 and not saved):
            redone += before - step + 1
        else:
            problems.append(
                f"step {step} was logged again after step {before}, but no checkpoint was "
                f"committed at step {step - 1}: a resume goes back to one past a checkpoint"
            )
    return StepCheck(redone, tuple(problems))


def checkpoints(history: Iterable[Event]) -> set[int]:
    """The steps of every committed checkpoint of the job (not a rank's local tier)."""
    steps = set()
    for event in history:
        if event.kind == Kind.CHECKPOINT and event.details.get("tier") != "local":
            step = CheckpointDetails.from_details(event.details).step
            if step is not None:
                steps.add(step)
    return steps


def world_size(history: Iterable[Event], before: float) -> int | None:
    """The world size of the job's newest round before ``before``."""
    sizes = [
        RoundDetails.from_details(event.details).world_size
        for event in history
        if event.kind == Kind.ROUND and event.time < before
    ]
    return sizes[-1] if sizes else None


@dataclass(frozen=True)
class Recovery:
    """When the job was whole again after the drill."""

    full_round: int | None = None
    """The first round after the act with at least the world size before it."""
    stepped_at: float | None = None
    """Its first step (``first_step``), else the round itself when no helper says so."""
    by: str = ""


def recovery(history: Sequence[Event], acted: float, full: int) -> Recovery:
    """The first round at full size after ``acted``, and the time of its first step."""
    for event in history:
        if event.kind != Kind.ROUND or event.time <= acted or event.round is None:
            continue
        if RoundDetails.from_details(event.details).world_size < full:
            continue
        steps = [
            later.time
            for later in history
            if later.kind == Kind.FIRST_STEP and later.round == event.round
        ]
        if steps:
            return Recovery(event.round, min(steps), "its first step")
        return Recovery(event.round, None, "")
    return Recovery()


def save_after(history: Iterable[Event], signalled: float) -> float | None:
    """When the first checkpoint after the signal was committed (the stop's own save)."""
    times = [
        event.time
        for event in history
        if event.kind == Kind.CHECKPOINT
        and event.time >= signalled
        and event.details.get("tier") != "local"
    ]
    return min(times) if times else None


@dataclass(frozen=True)
class Report:
    """The drill's figures."""

    job: str
    slot: str
    kind: str
    acted_at: float
    full_size: int
    time_to_full_step_s: float | None
    full_round: int | None
    steps_redone: int | None
    grace_lead_s: float | None
    save_after_signal_s: float | None
    step_log: str
    problems: list[str] = field(default_factory=list)

    @property
    def grace_margin_s(self) -> float | None:
        """The signal lead minus the time to the committed save: what was left over."""
        if self.grace_lead_s is None or self.save_after_signal_s is None:
            return None
        return self.grace_lead_s - self.save_after_signal_s

    def lines(self) -> list[str]:
        def seconds(value: float | None, missing: str) -> str:
            return missing if value is None else f"{value:.1f} s"

        redone = "unknown (no step log)" if self.steps_redone is None else str(self.steps_redone)
        if self.grace_lead_s is None:
            margin = "not measured (only a preempt drill signals)"
        else:
            left = seconds(self.grace_margin_s, "unknown (no save committed after the signal)")
            saved = seconds(self.save_after_signal_s, "?")
            margin = f"{left} (signal lead {self.grace_lead_s:.0f} s, save committed {saved} after)"
        return [
            f"Drill on job {self.job}: {self.kind} of slot {self.slot}.",
            f"Back at full size (world {self.full_size}), round {self.full_round}: "
            + seconds(self.time_to_full_step_s, "not within the wait")
            + " from the act to the first step",
            f"Steps redone: {redone}",
            f"Grace margin: {margin}",
            f"Step log: {self.step_log}",
            *(f"  {problem}" for problem in self.problems),
        ]
