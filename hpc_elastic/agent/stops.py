"""Stop signals, from the agent command's first instant to its exit (docs/agent.md, "Signals").

SIGTERM, SIGINT and the preemption signal are caught as soon as the agent command has read
its flags, not once the ``Agent`` runs: a signal during the preflight or while connecting
used to meet Python's default action (SIGTERM: an instant death that left the standby workers
behind and said nothing; SIGINT: a traceback). A handler only records the signal and tells
its listeners, which only record too; whoever waits polls for it (``until_stopped`` here, the
``Agent``'s loop later), so no wait can keep a signal from ending the agent.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, TypeVar

from hpc_elastic.agent.api import ExitCode

T = TypeVar("T")

POLL = 0.1
"""Seconds between two looks at the signals while a start-up step runs on its thread."""

log = logging.getLogger(__name__)


def exit_code(signum: int, preempt_signal: int) -> ExitCode:
    """The agent's exit status for a stop by ``signum``: 75 for the preemption signal (Slurm
    requeues the slot), 130 for SIGINT and 143 for SIGTERM, as a shell would report them."""
    if signum == preempt_signal:
        return ExitCode.PREEMPTED
    if signum == signal.SIGINT:
        return ExitCode.INTERRUPTED
    return ExitCode.TERMINATED


class Stopped(Exception):
    """A stop signal ended a start-up step (the preflight, the connection) before it finished."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The stop signals one agent process catches, and who is told of them."""

    def __init__(self, signums: Iterable[int]) -> None:
        self._signums = tuple(signums)
        self.first: int | None = None
        """The first stop signal caught, None before any."""
        self._listeners: list[Callable[[int], None]] = []

    def install(self) -> Handlers:
        """Catch the signals from now on (the main thread only, as Python requires); the
        handlers they had, for ``restore``."""
        previous = {signum: signal.signal(signum, self._caught) for signum in self._signums}
        log.debug("catching %s", ", ".join(signal.Signals(s).name for s in self._signums))
        return previous

    def listen(self, listener: Callable[[int], None]) -> None:
        """Tell ``listener`` of every signal from now on, and at once of one caught before:
        a signal between the connection and the agent's start must still stop the agent."""
        self._listeners.append(listener)
        if self.first is not None:
            listener(self.first)

    def _caught(self, signum: int, frame: FrameType | None) -> None:
        """The handler: record, tell the listeners (they only record too), return."""
        if self.first is None:
            self.first = signum
        for listener in list(self._listeners):
            listener(signum)


Handlers = dict[int, Callable[[int, FrameType | None], Any] | int | None]
"""Signal numbers and the handlers they had (``StopSignals.install``): a function, SIG_DFL or
SIG_IGN, or None for one that was not set from Python."""


def restore(handlers: Handlers) -> None:
    """Put back the handlers ``install`` found (an agent run inside another program)."""
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def until_stopped(
    call: Callable[[], T],
    stops: StopSignals,
    *,
    within: float | None = None,
    on_timeout: Callable[[], Exception] | None = None,
) -> T:
    """Run ``call`` on a thread of its own and wait for it, looking at the stop signals every
    ``POLL`` seconds: ``Stopped`` when one came (also before the call), else ``call``'s result
    or error. With ``within``, a call still running after that many seconds raises
    ``on_timeout()``. A call given up on is left to its daemon thread, which the agent's exit
    ends: it may be blocked for good in a library (kazoo waits for a connection that a dead
    ensemble never gives back), which is why it does not run on the main thread."""
    if stops.first is not None:
        raise Stopped(stops.first)
    result: list[T] = []
    error: list[BaseException] = []
    done = threading.Event()

    def target() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # handed to the waiting thread, which raises it
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=target, name="agent-start", daemon=True).start()
    deadline = None if within is None else time.monotonic() + within
    while not done.wait(POLL):
        if stops.first is not None:
            raise Stopped(stops.first)
        if deadline is not None and time.monotonic() >= deadline and on_timeout is not None:
            raise on_timeout()
    if error:
        raise error[0]
    return result[0]
