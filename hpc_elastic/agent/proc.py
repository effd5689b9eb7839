"""What the kernel says of a worker process: its scheduler state and its CPU times.

Linux's ``/proc``; every read answers None where the process is gone or ``/proc`` cannot say
(another system, a kernel without scheduler statistics), and the callers treat None as
"unknown", never as a fact.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

NANOSECONDS = 1e9


def state(pid: int) -> str | None:
    """The one-letter state of ``/proc/PID/stat``: R running, S sleeping, D uninterruptible
    sleep, T stopped (SIGSTOP), t stopped by a tracer, Z zombie; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold ") ": the state is
    # the first field after the last one.
    fields = text[text.rfind(")") + 1 :].split()
    return fields[0] if fields else None


def wchan(pid: int) -> str | None:
    """The kernel function the process's main thread sleeps in (``/proc/PID/wchan``):
    ``futex_do_wait`` for a lock or a condition (a collective's wait), ``hrtimer_nanosleep``
    for a ``sleep``; None when it runs, or when unknown."""
    try:
        with open(f"/proc/{pid}/wchan", "rb") as file:
            name = file.read().decode(errors="replace").strip()
    except OSError:
        return None
    return name if name and name != "0" else None


def cpu_times(pid: int) -> tuple[float, float] | None:
    """Seconds the process's main thread ran on a CPU and waited in a run queue for one, from
    ``/proc/PID/schedstat``; None if unknown. A process that wants a CPU and cannot get one
    (the machine is busy) accumulates the second: the watchdog does not hold that time
    against it (docs/reliability.md, "Deadlines under load")."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as file:
            ran, queued, *_ = file.read().split()
        return int(ran) / NANOSECONDS, int(queued) / NANOSECONDS
    except (OSError, ValueError) as error:
        log.debug("proc: no schedstat for %d: %s", pid, error)
        return None


def queued(pid: int) -> float | None:
    """Seconds the process waited for a CPU so far (``cpu_times``' second figure)."""
    times = cpu_times(pid)
    return None if times is None else times[1]
