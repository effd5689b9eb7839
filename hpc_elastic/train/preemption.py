"""Stop on request, at the same step on every rank, after the loop had a chance to save.

The agent forwards SIGTERM, SIGINT and the preemption signal (SIGUSR1/SIGUSR2) to each worker.
The handler only sets a flag; ``should_stop()`` turns the flags of all ranks into one answer
with a one-element all_reduce(MAX), so either every rank stops at this step or none does.

Every stop signal, Ctrl-C included, is only a flag: the first asks the loop to stop (and save)
at its next ``should_stop()``. A repeat is absorbed, because one Ctrl-C often arrives twice
(from the terminal to the whole process group, and again from a launcher that forwards it) and
must not kill the final save. Only a third SIGINT raises ``KeyboardInterrupt``, so a script
stuck outside the loop still dies, and never while a checkpoint is being committed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import FrameType
from typing import NoReturn

import torch
import torch.distributed as dist

from hpc_elastic import events
from hpc_elastic.contract import PREEMPTED_EXIT_CODE
from hpc_elastic.protocol import lease
from hpc_elastic.protocol.heartbeat import Heartbeat
from hpc_elastic.train import _dist, background
from hpc_elastic.train.collectives import collective

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
INTERRUPTS_TO_RAISE = 3
"""The SIGINT that raises ``KeyboardInterrupt``: the second may be the first one forwarded."""

log = logging.getLogger(__name__)
_requested: signal.Signals | None = None
_interrupts = 0
_saving = 0
_saving_on_main = 0
_installed = False
_heartbeat = Heartbeat()
_calls = 0
_announced = False
_stopped = False


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
    """Only records the signal (no logging: the handler may interrupt a logging call)."""
    global _requested, _interrupts  # noqa: PLW0603
    if signum == signal.SIGINT:
        _interrupts += 1
        if escalates(_interrupts, saving=_saving > 0):
            signal.default_int_handler(signum, frame)
    if _requested is None:
        _requested = signal.Signals(signum)


def escalates(interrupts: int, saving: bool) -> bool:
    """The rule for Ctrl-C: the ``INTERRUPTS_TO_RAISE``-th raises, unless a save is running."""
    return interrupts >= INTERRUPTS_TO_RAISE and not saving


@contextmanager
def saving() -> Iterator[None]:
    """While a checkpoint is written, no Ctrl-C may raise: it would lose the save it waits for.

    On the training thread the outermost ``saving()`` also marks the heartbeat (see
    ``heartbeat.CHECKPOINT``), so the agent does not take a long save for a hang. A background
    commit does not mark it: the loop keeps beating meanwhile.
    """
    global _saving, _saving_on_main  # noqa: PLW0603
    on_main = threading.current_thread() is threading.main_thread()
    marks = on_main and _saving_on_main == 0
    _saving += 1
    _saving_on_main += int(on_main)
    try:
        with _heartbeat.saving() if marks else nullcontext():
            yield
    finally:
        _saving -= 1
        _saving_on_main -= int(on_main)


def finish() -> None:
    """Say that the training loop is over, before its final save: from then on the agent does
    not time this rank for hangs, so the final save, barriers and shutdown may take their time.

    ``should_stop()`` calls it when it answers stop, and ``exit_preempted()`` calls it too; a
    loop that ran out of steps calls it itself (``elastic.finish()``). Local, no communication.
    """
    _heartbeat.finish()


def requested() -> signal.Signals | None:
    """The signal this rank received, if any; local, no communication."""
    return _requested


def stopping() -> bool:
    """Whether ``should_stop()`` has answered stop: the same on every rank (it is agreed), so a
    save may decide by it collectively (``--grace-action local``'s local-first save). Local."""
    return _stopped


def should_stop(step: int | None = None) -> bool:
    """True on every rank once any rank was asked to stop; call it at the same step on all ranks.

    It is a collective (one all_reduce of one element) and it beats the progress heartbeat,
    writing ``step`` (or a call count when no step is given) at most every half second. Under
    the hpc-elastic agent it also checks the agent's lease first and exits with
    ``FENCED_EXIT_CODE`` when it is stale (see ``hpc_elastic.protocol.lease``).

    After an asynchronous save it also carries, in the same all_reduce, whether any rank's
    background commit failed: then every rank raises that ``CheckpointError`` here. When it
    answers stop, it first waits for the commit in flight, so the final save and the exit
    that follow never race it, and it marks the heartbeat finished (see ``finish``).
    """
    global _calls, _announced, _stopped  # noqa: PLW0603
    install_signal_handlers()
    lease.check()
    _calls += 1
    _heartbeat.beat(_calls if step is None else step)
    local = 1 if _requested is not None else 0
    if local and not _announced:
        _announced = True
        log.debug("stop requested by %s at step %s", _requested, step)
    if _calls == 1:  # The restart timeline (hpc_elastic.ops.phases): this rank is in the group.
        events.emit(events.Kind.WORKER_READY, step=step)
    stop, failed = _agree(local, int(background.failed()))
    if _calls == 1:  # ... and every rank has done its first step.
        events.emit(events.Kind.FIRST_STEP, step=step)
    if stop:
        _stopped = True
        finish()  # the loop ends here: its final save is not timed as a step
    if failed or (stop and background.used()):
        background.drain()  # raises the failure on every rank, or waits before the stop
    return stop


def _agree(stop: int, failed: int) -> tuple[bool, bool]:
    """Whether any rank wants to stop, and whether any rank's background commit failed."""
    if not _dist.active():
        return bool(stop), bool(failed)
    flags = torch.tensor([stop, failed], dtype=torch.int32, device=_dist.collective_device())
    with collective("all_reduce"):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0].item()), bool(flags[1].item())


def exit_preempted() -> NoReturn:
    """Leave with ``PREEMPTED_EXIT_CODE`` so the agent requeues instead of counting a failure.

    Call it after the final checkpoint; it waits for an asynchronous one to be committed (and
    raises its error on every rank). Exit code 0 means the training really finished. The
    barrier keeps rank 0, which hosts the store, alive until every rank is done with it. It
    then exits at once, skipping destructors: with DDP alive, tearing down the gloo group from
    the Reducer's destructor deadlocks on the GIL (seen here in one run out of a few).
    """
    finish()
    background.drain_if_used()  # the final save may still be committing
    _dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PREEMPTED_EXIT_CODE)
