"""The one checkpoint commit that may run behind the training loop, and how every rank waits for it.

An asynchronous save snapshots the state into host memory on the training thread and hands the
rest (serialising, fsyncing, the fenced commit) to a worker thread here. At most one such
commit is in flight per process: the next save, ``should_stop()`` when it says stop, the final
save and ``exit_preempted()`` all wait for it first, so a preempted job never leaves with its
last checkpoint half written.

A thread, for now: it runs exactly the synchronous commit (fencing, the lease's exit and
errors all stay in-process). Measured against a worker process in
``bench/checkpoint_bench.py --stall`` (docs/benchmarks.md): equal where steps are long, but
on a fast GPU step the process stalls the loop less, because ``torch.save``'s pickling holds
the GIL the loop needs; a process fed from shared-memory buffers is the next step.

A failure in the worker is only known on the rank that ran it. ``drain()`` is a collective:
every rank waits for its own worker, then all of them exchange what went wrong, so every rank
raises the same ``CheckpointError`` sentence at the same call instead of one rank raising and
the others waiting for it in their next collective.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from hpc_elastic.errors import CheckpointError, CheckpointFencedError
from hpc_elastic.train import _dist

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One background commit: what it does, for the error sentence, and how it ended."""

    what: str
    thread: threading.Thread | None = None
    result: str | None = None
    problem: str | None = None
    fenced: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, work: Callable[[], str]) -> None:
        try:
            self.result = work()
            log.debug("background commit done: %s -> %s", self.what, self.result)
        except CheckpointError as error:
            self.problem = str(error)
            self.fenced = isinstance(error, CheckpointFencedError)
        except BaseException as error:  # a worker thread's error must reach the training thread
            log.debug("background commit failed: %s", self.what, exc_info=True)
            self.problem = failure(self.what, error)
        finally:
            self.done.set()


def failure(what: str, error: BaseException) -> str:
    """The one sentence for an unexpected error while saving: what failed, why, what to do."""
    advice = (
        "check the directory's space and permissions"
        if isinstance(error, OSError)
        else "fix the cause it names and save again"
    )
    return f"Could not {what} ({type(error).__name__}: {error}); {advice}."


_lock = threading.Lock()
_job: Job | None = None
_used = False
"""Set on every rank by the first asynchronous save, so synchronous saves skip the exchange
in ``drain_if_used`` (every rank sees the same calls, so every rank agrees on the flag)."""


def submit(work: Callable[[], str], what: str) -> None:
    """Run ``work`` (returning the committed path) behind the training loop.

    The caller has already waited for the previous job (``drain``); a second job while one
    runs is a bug in the caller, not a user error.
    """
    global _job  # noqa: PLW0603
    with _lock:
        if _job is not None and not _job.done.is_set():
            raise RuntimeError("a background commit is already in flight")
        job = Job(what)
        # Not a daemon: an interpreter that exits normally still finishes the commit.
        job.thread = threading.Thread(
            target=job.run, args=(work,), name="hpc-elastic-checkpoint", daemon=False
        )
        _job = job
    log.debug("background commit started: %s", what)
    job.thread.start()


def busy() -> bool:
    """True while this rank's commit is still running; local, no communication."""
    job = _job
    return job is not None and not job.done.is_set()


def failed() -> bool:
    """True once this rank's commit ended in an error not yet reported; local."""
    job = _job
    return job is not None and job.done.is_set() and job.problem is not None


def wait_local() -> tuple[str, bool] | None:
    """Wait for this rank's commit; return its error sentence and whether it was fenced
    (once), or None."""
    global _job  # noqa: PLW0603
    job = _job
    if job is None:
        return None
    log.debug("waiting for the background commit: %s", job.what)
    job.done.wait()
    with _lock:
        if _job is job:
            _job = None
    return None if job.problem is None else (job.problem, job.fenced)


def mark_used() -> None:
    """Called on every rank by an asynchronous save: from now on saves and stops drain."""
    global _used  # noqa: PLW0603
    if not _used:
        atexit.register(report_at_exit)
    _used = True


def report_at_exit() -> None:
    """A script that ends without ``wait()`` must not lose the final commit's error silently.

    Runs after the interpreter joined the (non-daemon) worker, so the commit has ended.
    """
    problem = wait_local()
    if problem is not None:
        log.error("The last checkpoint was not committed: %s", problem[0])
        print(f"The last checkpoint was not committed: {problem[0]}", file=sys.stderr)


def used() -> bool:
    return _used


def drain_if_used() -> None:
    """``drain()`` once any asynchronous save ran in this process; free before that."""
    if _used:
        drain()


def drain() -> None:
    """Collective: wait for every rank's commit in flight; raise its error on every rank.

    Call it at the same point on every rank. Waiting is local (a rank without a job passes at
    once); the exchange that follows is one small all-gather, reached by every rank whatever
    its own worker hit, so no rank is left waiting.
    """
    problem = wait_local()
    problems = [found for found in _dist.gather_to_all(problem) if found is not None]
    if problems:
        message, fenced = problems[0]
        raise (CheckpointFencedError if fenced else CheckpointError)(message)


def any_busy() -> bool:
    """Collective: True on every rank when any rank's commit is still running."""
    return any(_dist.gather_to_all(busy()))
