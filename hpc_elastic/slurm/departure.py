"""Why a slot's agent is asked to stop: preemption, time limit, by hand, or cancelled.

Slurm sends every stop the same warning signal; only ``scontrol show job`` tells the causes
apart (``departure``), and only at the moment the signal comes: after the workers' drain Slurm
may have requeued or ended the task already. So ``StopInquiry`` asks on a thread started
before any signal (``DepartureWatch``) and keeps the answer for ``ElasticSlot.settle``
(slurm/elastic.py), which decides on it: requeue for which cause, or leave.
"""

from __future__ import annotations

import enum
import logging
import queue
import re
import threading
from collections.abc import Callable, Mapping

from hpc_elastic.errors import SlurmError
from hpc_elastic.slurm.task import (
    SCONTROL_PAUSE,
    SCONTROL_TIMEOUT,
    SCONTROL_TRIES,
    ArrayTask,
    read_job,
)

log = logging.getLogger(__name__)

_TIME_LIMIT_MARGIN = 60.0
"""Slurm may send ``--signal=SIG@N`` up to about 30 s before N (field notes); allow double."""


class Departure(enum.Enum):
    """Why a slot's agent got the warning signal."""

    PREEMPTION = "preemption"
    TIME_LIMIT = "time_limit"
    BAD_NODE = "bad_node"
    BY_HAND = "by_hand"
    CANCELLED = "cancelled"
    """scancel, or Slurm no longer runs the job: nothing to requeue."""
    DRAIN = "drain"
    """Slurm drains the node (slurm/drain.py): the slot left it at a checkpoint. No budget
    counts it: the node's admin decided, and Slurm starts nothing on a drained node."""
    BACKFILL_END = "backfill_end"
    """The time limit of a task submitted with ``--time-min`` (``--grow-time-min``): backfill
    gave it a hole that has ended. It leaves as at any time limit and requeues for the next
    hole; no budget counts it, since that is what such a slot is for."""


def parse_duration(text: str) -> float | None:
    """Slurm's ``[D-]HH:MM:SS``, ``MM:SS`` or ``UNLIMITED`` in seconds (None: no limit)."""
    if text in ("UNLIMITED", "INFINITE", "Partition_Limit", "NONE"):
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if match is None:
        raise SlurmError(
            f"scontrol printed the duration '{text}', which is not [D-]HH:MM:SS; "
            "check that `scontrol` is Slurm's and not a wrapper."
        )
    days, hours, minutes, seconds = (int(group or 0) for group in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


_DEPARTURE_FIELDS = ("JobState", "PreemptTime", "RunTime", "TimeLimit")
"""What ``departure`` reads; kept in the requeue event so a surprising cause can be checked
(and ``TimeMin``, for a task that has one: ``--grow-time-min``)."""


def _evidence(job: Mapping[str, str]) -> dict[str, str]:
    found = {key: job.get(key, "") for key in _DEPARTURE_FIELDS}
    if job.get("TimeMin", "N/A") not in ("N/A", "None", "", "0"):
        found["TimeMin"] = job["TimeMin"]
    return found


_STILL_RUNNING = ("RUNNING", "SIGNALING")
"""Job states of a task that was signalled but not cancelled."""


def departure(job: Mapping[str, str], warning_s: float) -> Departure:
    """Tell preemption from time limit from a signal sent by hand, from ``scontrol show job``.

    Slurm sets ``PreemptTime`` when it starts preempting a job, and may show it ``SIGNALING``
    while the preemption's signal is delivered (seen on 22.05 in the 30-min soak: read as a
    cancel, the slot left for good, since a task that exits by itself before GraceTime is not
    requeued by Slurm). So ``PreemptTime`` is read first. The time limit is near when what is
    left of ``TimeLimit`` is within the ``--signal`` warning.
    """
    if job.get("PreemptTime", "None") not in ("None", "Unknown", ""):
        return Departure.PREEMPTION
    if job.get("JobState") not in _STILL_RUNNING:
        return Departure.CANCELLED
    limit = parse_duration(job.get("TimeLimit", "UNLIMITED"))
    elapsed = parse_duration(job.get("RunTime", "00:00"))
    left = None if limit is None or elapsed is None else limit - elapsed
    if left is not None and left <= warning_s + _TIME_LIMIT_MARGIN:
        backfilled = job.get("TimeMin", "N/A") not in ("N/A", "None", "", "0")
        return Departure.BACKFILL_END if backfilled else Departure.TIME_LIMIT
    return Departure.BY_HAND


class DepartureWatch:
    """Asks Slurm why this slot is being stopped at the moment the stop signal arrives.

    Asked after the workers have drained (up to ``--grace`` later), Slurm describes the task
    as it is then: already requeued by Slurm after GraceTime, or completing, which reads as
    "cancelled", and a slurmctld busy with the preemption may not answer at all. So the signal
    handler only hands the signal to a thread that was
    started beforehand (``SimpleQueue.put`` is safe in a signal handler, starting a thread is
    not: the handler may interrupt the main thread while it holds a lock of ``threading``);
    that thread runs ``scontrol`` and keeps the answer for ``ElasticSlot.settle``.
    """

    def __init__(self, ask: Callable[[], tuple[Departure, dict[str, str]] | None]) -> None:
        self._ask = ask
        self._signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._signalled = False
        self._answered = threading.Event()
        self._answer: tuple[Departure, dict[str, str]] | None = None
        threading.Thread(target=self._watch, name="hpc-elastic-departure", daemon=True).start()

    def signalled(self, signum: int) -> None:
        """Called from the signal handler: sets a flag and queues the signal, never blocks."""
        self._signalled = True
        self._signals.put(signum)

    def answer(self, timeout: float) -> tuple[Departure, dict[str, str]] | None:
        """What Slurm said when the first signal came; None if no signal came, or no answer
        within ``timeout``."""
        if not self._signalled:
            return None
        self._answered.wait(timeout)
        return self._answer

    def _watch(self) -> None:
        signum = self._signals.get()
        log.debug("signal %d: asking Slurm why this slot is being stopped", signum)
        try:
            self._answer = self._ask()
            log.debug("Slurm says why the slot is stopped: %s", self._answer)
        except Exception:  # A thread of its own: say so, and let settle ask again.
            log.exception("could not record why this slot is being stopped")
        finally:
            self._answered.set()


class StopInquiry:
    """Asks Slurm why this slot's task is being stopped, at the signal and again if need be.

    One job: the answer to "why". ``watch`` starts the thread that asks the moment a stop
    signal arrives; ``recorded`` is what it heard (waiting as long as its tries may take);
    ``ask`` asks now, for a stop that sent no signal (the workers' own exit 75, the bad-node
    watch) or one Slurm did not answer at the time. The watch's answer is handed to ``note`` as
    soon as it comes, before any drain: the slot's ledger keeps it in case Slurm SIGKILLs the slot
    before it leaves (``SlotLedger.leaving_for``).
    """

    def __init__(self, task: ArrayTask, note: Callable[[Departure], None]) -> None:
        self._task = task
        self._note = note
        self._watch: DepartureWatch | None = None

    def watch(self, warning_s: float) -> DepartureWatch:
        """Start the thread that asks Slurm why, as soon as a stop signal arrives; its answer
        is also noted in the ledger, in case Slurm SIGKILLs the slot before it leaves. When
        Slurm cannot answer then, there is no answer, and ``settle`` asks again."""

        def ask() -> tuple[Departure, dict[str, str]] | None:
            record = read_job(self._task.job_id, self._task.env)
            if isinstance(record, SlurmError):
                log.warning("Slurm did not say why slot %s stops: %s", self._task.job_id, record)
                return None
            why, evidence = departure(record, warning_s), _evidence(record)
            self._note(why)
            return why, evidence

        self._watch = DepartureWatch(ask)
        return self._watch

    def recorded(self) -> tuple[Departure, dict[str, str]] | None:
        """What Slurm said when the stop signal arrived (see ``DepartureWatch``); None if no
        watch runs, no signal came, or Slurm did not answer within the watch's tries."""
        deadline = SCONTROL_TRIES * (SCONTROL_TIMEOUT + SCONTROL_PAUSE)
        return self._watch.answer(deadline) if self._watch is not None else None

    def ask(self, warning_s: float) -> tuple[Departure, dict[str, str]]:
        """Why Slurm stops this task now, and the fields that said so. A Slurm that cannot
        say is treated as a cancel, since it could not requeue us either."""
        record = read_job(self._task.job_id, self._task.env)
        if isinstance(record, SlurmError):
            return Departure.CANCELLED, {"error": str(record)}
        return departure(record, warning_s), _evidence(record)
