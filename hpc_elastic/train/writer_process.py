"""An opt-in worker process that writes asynchronous checkpoints (``writer="process"``).

Why: ``torch.save``'s pickling and zip writing hold the GIL that the training loop needs, so
on a fast GPU step a writer thread still stalls the loop (docs/benchmarks.md, "Training-step
stall": 10 to 40 points of stall better with a process). Here the thread that runs the
background commit hands the one expensive part, serialising ``state.pt`` and fsyncing it, to a
process; everything that decides whether a checkpoint counts stays in the training process:
staging, the round fence, the manifest written last and the rename (``Checkpointer.commit``).

Shared memory: the snapshot's host buffers are allocated once in shared memory
(``checkpoint.snapshot(shared=True)``) and reused by every save, so a request carries handles
to them and a file name, not a copy of the state.

A writer that dies (SIGKILL, out of memory) leaves a staging directory without a manifest,
which no reader trusts and the next save removes; the commit in flight fails with a
``CheckpointError`` on every rank, and the next save starts a new writer.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from hpc_elastic.errors import CheckpointError

POLL_SECONDS = 0.2
"""How often the waiting thread checks that the writer is still alive."""

log = logging.getLogger(__name__)


def serve(connection: Connection) -> None:
    """The writer's loop: write each ``(payload, path)`` it is sent, fsynced; reply with None
    or the error's text. Ends when the training process closes its end."""
    torch.set_num_threads(1)  # the training process needs the cores; writing is I/O-bound
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        payload, path = request
        try:
            with open(path, "wb") as file:
                torch.save(payload, file)
                file.flush()
                os.fsync(file.fileno())
            connection.send(None)
        except Exception as error:  # the parent turns it into its one sentence
            connection.send(f"{type(error).__name__}: {error}")
        del payload, request  # drop the shared buffers' mappings until the next request


class Writer:
    """The training process's handle on one writer process (started on first use)."""

    def __init__(self) -> None:
        self.process: Any = None
        self.connection: Connection | None = None

    def pid(self) -> int | None:
        return None if self.process is None else int(self.process.pid)

    def ensure_started(self) -> None:
        """Start the writer if none is alive. Called on the training thread, inside ``save``:
        starting hides the user's ``__main__`` for a moment (``_main_hidden``), which must
        not happen while the user's code runs."""
        if self.process is None or not self.process.is_alive():
            self.close()
            self._start()

    def _start(self) -> Connection:
        # spawn: forking a process that runs gloo and CUDA threads could copy a held lock.
        context = torch_mp.get_context("spawn")
        mine, theirs = context.Pipe()
        process = context.Process(
            target=serve, args=(theirs,), name="hpc-elastic-writer", daemon=True
        )
        with _main_hidden():
            process.start()
        theirs.close()
        self.process, self.connection = process, mine
        log.debug("started checkpoint writer process %d", process.pid)
        return mine

    def write(self, payload: dict[str, Any], path: Path) -> None:
        """Have the writer write ``payload`` to ``path``; raise if it fails or dies."""
        connection = self.connection
        if connection is None:
            raise CheckpointError(
                f"No checkpoint writer process was running to write '{path}'; save again."
            )
        try:
            connection.send((payload, str(path)))
            while not connection.poll(POLL_SECONDS):
                if not self.process.is_alive():
                    break
            problem = connection.recv() if connection.poll() else self._died()
        except (OSError, EOFError):
            problem = self._died()
        if problem is not None:
            raise CheckpointError(
                f"The checkpoint writer process could not write '{path}' ({problem}); the "
                f"previous checkpoint stays the newest; save again, or use writer='thread'."
            )

    def _died(self) -> str:
        self.process.join(timeout=5)
        code = self.process.exitcode
        self.close()
        return f"it ended with exit code {code}"

    def close(self) -> None:
        """Stop the writer (it ends when its end of the pipe closes)."""
        if self.connection is not None:
            self.connection.close()
        if self.process is not None:
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()
        self.process, self.connection = None, None


@contextmanager
def _main_hidden() -> Iterator[None]:
    """Keep spawn from importing the user's script in the writer.

    spawn re-imports the parent's ``__main__`` in the child (by path, or by module name under
    ``python -m``), which runs a training script's top level again unless it is guarded by
    ``if __name__ == "__main__"``: the writer would start training. The writer needs nothing
    from the script, so while it starts, ``__main__`` shows neither a file nor a module name.
    """
    main = sys.modules["__main__"]
    names: tuple[str, ...] = ("__file__", "__spec__")
    saved = {name: main.__dict__[name] for name in names if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


_writer = Writer()


def ensure_started() -> None:
    """Start this process's writer unless it is alive (on the training thread)."""
    _writer.ensure_started()


def write(payload: dict[str, Any], path: Path) -> None:
    """Write ``payload`` to ``path`` in this process's writer (one commit at a time)."""
    _writer.write(payload, path)


def writer_pid() -> int | None:
    """The writer process's id, or None before the first save (tests kill it)."""
    return _writer.pid()
