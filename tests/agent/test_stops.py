"""The agent's stop signals before it runs: caught, replayed to a late listener, and ending a
start-up step that would otherwise block (agent/stops.py)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from hpc_elastic.agent import stops
from hpc_elastic.agent.api import ExitCode


@pytest.fixture
def caught() -> Iterator[stops.StopSignals]:
    """SIGUSR1 caught for the test, put back afterwards."""
    signals = stops.StopSignals((signal.SIGUSR1,))
    previous = signals.install()
    yield signals
    stops.restore(previous)


def test_each_stop_signal_exits_as_a_shell_would_report_it() -> None:
    usr2 = signal.SIGUSR2
    assert stops.exit_code(usr2, preempt_signal=usr2) is ExitCode.PREEMPTED
    assert stops.exit_code(signal.SIGINT, preempt_signal=usr2) is ExitCode.INTERRUPTED
    assert stops.exit_code(signal.SIGTERM, preempt_signal=usr2) is ExitCode.TERMINATED


def test_a_signal_caught_before_the_agent_listens_still_reaches_it(
    caught: stops.StopSignals,
) -> None:
    os.kill(os.getpid(), signal.SIGUSR1)
    assert caught.first == signal.SIGUSR1
    told: list[int] = []
    caught.listen(told.append)
    assert told == [signal.SIGUSR1], "told at once of the signal that came before"
    os.kill(os.getpid(), signal.SIGUSR1)
    assert told == [signal.SIGUSR1, signal.SIGUSR1], "and of every later one"


def test_a_signal_ends_a_start_up_step_that_never_returns(caught: stops.StopSignals) -> None:
    never = threading.Event()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    with pytest.raises(stops.Stopped) as stopped:
        stops.until_stopped(never.wait, caught)
    assert stopped.value.signum == signal.SIGUSR1
    never.set()


def test_a_start_up_step_gives_its_result_or_its_error(caught: stops.StopSignals) -> None:
    assert stops.until_stopped(lambda: 42, caught) == 42
    with pytest.raises(ZeroDivisionError):
        stops.until_stopped(lambda: 1 // 0, caught)


def test_a_start_up_step_past_its_bound_raises_what_the_caller_names(
    caught: stops.StopSignals,
) -> None:
    never = threading.Event()
    with pytest.raises(TimeoutError, match="gone"):
        stops.until_stopped(never.wait, caught, within=0.2, on_timeout=lambda: TimeoutError("gone"))
    never.set()
