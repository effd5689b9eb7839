"""Stop on request, at the same step on every rank, after the loop had a chance to save.

The agent forwards SIGTERM, SIGINT and the preemption signal (SIGUSR1/SIGUSR2) to each worker.
The handler only sets a flag; ``should_stop()`` turns the flags of all ranks into one answer
with a one-element all_reduce(MAX), so either every rank stops at this step or none does.

Outside any launcher, the first Ctrl-C asks the loop to stop at its next ``should_stop()``
and a second Ctrl-C raises ``KeyboardInterrupt`` as usual, so a stuck script still dies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import NoReturn

import torch
import torch.distributed as dist

from hpc_elastic.train import _dist
from hpc_elastic.train.exitcodes import PREEMPTED_EXIT_CODE
from hpc_elastic.train.heartbeat import Heartbeat

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

_requested: signal.Signals | None = None
_installed = False
_heartbeat = Heartbeat()
_calls = 0


def install_signal_handlers() -> None:
    """Catch the stop signals from now on; call early so a signal during setup is not lost.

    ``should_stop()`` installs them on first use too. Only the main thread may install handlers,
    so elsewhere this does nothing.
    """
    global _installed  # noqa: PLW0603
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_signal)
    _installed = True


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _requested  # noqa: PLW0603
    if signum == signal.SIGINT and _requested is not None:
        signal.default_int_handler(signum, frame)
    _requested = signal.Signals(signum)


def requested() -> signal.Signals | None:
    """The signal this rank received, if any; local, no communication."""
    return _requested


def should_stop(step: int | None = None) -> bool:
    """True on every rank once any rank was asked to stop; call it at the same step on all ranks.

    It is a collective (one all_reduce of one element) and it beats the progress heartbeat,
    writing ``step`` (or a call count when no step is given) at most every half second.
    """
    global _calls  # noqa: PLW0603
    install_signal_handlers()
    _calls += 1
    _heartbeat.beat(_calls if step is None else step)
    local = 1 if _requested is not None else 0
    if not _dist.active():
        return bool(local)
    flag = torch.tensor([local], dtype=torch.int32, device=_dist.collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def exit_preempted() -> NoReturn:
    """Leave with ``PREEMPTED_EXIT_CODE`` so the agent requeues instead of counting a failure.

    Call it after the final checkpoint; exit code 0 means the training really finished. The
    barrier keeps rank 0, which hosts the store, alive until every rank is done with it. It
    then exits at once, skipping destructors: with DDP alive, tearing down the gloo group from
    the Reducer's destructor deadlocks on the GIL (seen here in one run out of a few).
    """
    if _dist.active():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PREEMPTED_EXIT_CODE)
