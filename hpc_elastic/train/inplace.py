"""In-place recovery: surviving workers keep their process and their state through a restart.

With ``agent --in-place`` the agent does not kill the workers that are alive when a round ends
(a peer failed, a node left or arrived). It writes each of them the new round, the variables
that change from round to round (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``HPC_ELASTIC_ROUND``, ...), to a file (``$HPC_ELASTIC_ASSIGNMENT_FILE``, replaced atomically),
and starts workers only for the local ranks that have none. ``InPlace`` is the worker's half::

    state = MyState(model, optimizer)            # state_dict() / load_state_dict()
    with InPlace(state) as ip:                   # joins the group; a survivor's state arrives
        if not ip.received:
            load_checkpoint(state)               # nobody survived: checkpoints are the fallback
        while state.step < total:
            with ip.step():                      # the step boundary: adopts a new round
                train_one_step(state)            # changes the state only after its last collective

At a step boundary ``step()`` looks at the file (one ``stat``). When the agent wrote a newer
round, the worker destroys its process group, takes the round's variables into its
environment, acknowledges (the agent restarts a survivor that does not, the normal way), joins
the new group and receives the state, by broadcast, from the lowest rank that held one.

A step that a peer's death interrupts (a collective raises: gloo does at once, NCCL once
``abort`` ran) is abandoned: the worker waits for the new round, re-forms and runs the same
step again. That is only exact if the step changes the state after its last collective (the
usual ``backward``, all-reduce, ``optimizer.step()``), which is the contract of this module.
Any other error ends the worker as before, and the agent restarts it the normal way.

Nothing travels between ranks as a pickle (issue #12): the state's structure goes as the tagged
JSON of ``_dist.encode``, the tensors themselves with ``dist.broadcast``.

The agent's half of the hand-over (the files) is torch-free, in ``protocol/assignment.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hpc_elastic import contract, events
from hpc_elastic.protocol.assignment import (
    ASSIGNMENT_FILE_ENV,
    Assignment,
    is_collective_error,
    read_assignment,
    write_ack,
)
from hpc_elastic.train import _dist
from hpc_elastic.train.collectives import collective

log = logging.getLogger(__name__)

PEER_WAIT = 120.0
"""Seconds an interrupted step waits for the agent's next round before it gives up and raises.
The round after a node loss takes a session timeout plus the last call; two minutes covers
both with room, yet a real error still ends the worker rather than parking it forever."""

MASTER_WAIT = 60.0
"""Seconds a rank other than 0 waits for rank 0's store before ``init_process_group`` (whose
own timeout then applies): long enough for a newcomer rank 0 that starts cold."""

WATCH_INTERVAL = 0.05
"""Seconds between two looks at the assignment file during an NCCL step (a small JSON read)."""

INIT_TIMEOUT = 120.0
"""Seconds ``init_process_group`` may wait for the new round's other ranks."""


class Stateful(Protocol):
    """What ``InPlace`` sends to a newcomer: anything with torch's state-dict pair."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class InPlace:
    """A training loop's side of in-place recovery; see the module docstring.

    Without ``$HPC_ELASTIC_ASSIGNMENT_FILE`` (no ``--in-place``, plain torchrun) it only joins
    the process group and tells whether a state arrived (never): errors end the worker as ever.
    """

    def __init__(
        self,
        state: Stateful,
        *,
        backend: str | None = None,
        peer_wait: float = PEER_WAIT,
        init_timeout: float = INIT_TIMEOUT,
        environ: MutableMapping[str, str] | None = None,
    ) -> None:
        self.state = state
        self._backend = backend
        self._peer_wait = peer_wait
        self._init_timeout = init_timeout
        self._environ = os.environ if environ is None else environ
        file = self._environ.get(ASSIGNMENT_FILE_ENV)
        self._file = Path(file) if file else None
        self._seen: tuple[int, int] | None = None
        """(mtime_ns, size) of the assignment file when last read: one stat per step."""
        self.round = _round(self._environ)
        self.received = False
        """Whether this worker's state came from a survivor when it last (re)joined."""
        self.restarts = 0
        """How many times this worker re-formed its group in place."""
        self._holds_state = False
        self._first_step_pending = False
        self._abandoned: str | None = None
        """The error text of a step abandoned on a failed collective, until the next round."""

    @property
    def enabled(self) -> bool:
        """Whether the agent runs in in-place mode (it named an assignment file)."""
        return self._file is not None

    def __enter__(self) -> InPlace:
        if not dist.is_initialized():
            # The agent may have written a newer round between our spawn and now: join that.
            assignment = self._newer()
            if assignment is not None:
                self._take(assignment)
            self._init()
            events.emit(events.Kind.WORKER_READY, in_place=self.enabled, round=self.round)
        self._backend = dist.get_backend()
        self._note_file()  # the round we joined is not news at the first step boundary
        if self._file is not None and self.round is not None:
            # Tells the agent that this loop takes rounds in place: it keeps us next time.
            write_ack(self._file, self.round)
        self._synchronise()
        self._first_step_pending = True
        return self

    def __exit__(self, *exc: object) -> None:
        return None  # the group stays: the loop may still save, then destroys it as usual

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step. Before it: take up a newer round (after an abandoned step: wait
        for it). During it: a collective that fails because a peer is gone abandons the step
        (the loop runs it again once the group re-formed); any other error propagates."""
        # From the first step on, this worker's state is the job's: it was received, loaded
        # from the checkpoint or freshly made, and every rank of the group agrees on which.
        self._holds_state = True
        if self._abandoned is not None:
            self._recover()
        self.boundary()
        watch = self._watch()
        try:
            with watch:
                yield
        except Exception as error:
            # Once the watch aborted the group, whatever the step raised is that abort's echo.
            ours = isinstance(watch, AbortWatch) and watch.aborted
            if self._file is None or not (ours or is_collective_error(error)):
                raise
            log.debug(
                "a collective failed in round %s (%s); abandoning the step", self.round, error
            )
            # Only the text is kept, and the group is left after this handler, never in it: the
            # error's traceback holds the failed collective's work, which holds the group's
            # connections open through destroy_process_group. A live peer blocked on a receive
            # from us would then wait out the collective timeout (120 s), miss the agent's
            # ACK_TIMEOUT (30 s), and be restarted the normal way, spending the job's budget
            # (tests/agent/test_inplace.py's node-leave test caught it on a loaded machine).
            self._abandoned = str(error)
            return
        if self._first_step_pending:
            self._first_step_pending = False
            events.emit(events.Kind.FIRST_STEP, in_place=self.enabled, round=self.round)

    def _recover(self) -> None:
        """After an abandoned step: leave the broken group at once (so that peers blocked on
        us see our connections close and abandon their step too), wait for the agent's next
        round, take it up. No round within ``peer_wait``: raise the collective's error."""
        abandoned, self._abandoned = self._abandoned, None
        log.debug("leaving round %s's group; waiting for the next round", self.round)
        _leave_group()
        assignment = self._wait_for_round(time.monotonic() + self._peer_wait)
        if assignment is None:
            raise RuntimeError(
                f"{abandoned} (a collective of round {self.round} failed and no newer round "
                f"came within {self._peer_wait:g} s; the agent restarts this worker)"
            )
        self._adopt(assignment)

    def _watch(self) -> contextlib.AbstractContextManager[object]:
        """NCCL: abort the group as soon as the agent writes a newer round, so that a
        collective blocked on a dead peer returns (NCCL would wait for its timeout; gloo
        raises at once and needs no watch)."""
        if self._file is None or self._backend != "nccl":
            return contextlib.nullcontext()
        return AbortWatch(self._file, self.round, _abort_group)

    def boundary(self) -> bool:
        """Take up a newer round if the agent wrote one; True if this worker re-formed."""
        assignment = self._newer()
        if assignment is None:
            return False
        self._adopt(assignment)
        return True

    def _init(self) -> None:
        backend = self._backend or ("nccl" if torch.cuda.is_available() else "gloo")
        _wait_for_master(self._environ, time.monotonic() + MASTER_WAIT)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self._init_timeout))

    def _note_file(self) -> None:
        if self._file is None:
            return
        with contextlib.suppress(OSError):
            stat = self._file.stat()
            self._seen = (stat.st_mtime_ns, stat.st_size)

    def _newer(self) -> Assignment | None:
        """A round newer than ours in the file, looked at with one stat when nothing changed."""
        if self._file is None:
            return None
        try:
            stat = self._file.stat()
        except OSError:
            return None
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            return None
        self._seen = seen
        assignment = read_assignment(self._file)
        if assignment is None or (self.round is not None and assignment.round <= self.round):
            return None
        return assignment

    def _wait_for_round(self, deadline: float) -> Assignment | None:
        """Poll for the agent's next round until ``deadline`` (issue #11: no wait without one)."""
        while time.monotonic() < deadline:
            assignment = self._newer()
            if assignment is not None:
                return assignment
            time.sleep(0.01)
        log.debug("no round newer than %s came within %.0f s", self.round, self._peer_wait)
        return None

    def _adopt(self, assignment: Assignment) -> None:
        """Leave the old group, take the round's variables, acknowledge, join, synchronise."""
        assert self._file is not None
        backend = self._backend or (dist.get_backend() if dist.is_initialized() else None)
        self._backend = backend
        log.debug("taking up round %d in place (was %s)", assignment.round, self.round)
        _leave_group()
        self._take(assignment)
        self.restarts += 1
        self._init()
        events.emit(events.Kind.WORKER_READY, in_place=True, round=self.round)
        self._synchronise()
        self._first_step_pending = True

    def _take(self, assignment: Assignment) -> None:
        """The round's variables into our environment (``env://`` and the training helpers
        read them there), then the acknowledgement. The agent's deadline is on the
        acknowledgement, before the join: a worker stuck in a step never acknowledges and is
        restarted the normal way; the join itself is bounded by ``init_timeout``."""
        assert self._file is not None
        self._environ.update(assignment.env)
        self.round = assignment.round
        write_ack(self._file, assignment.round)

    def _synchronise(self) -> None:
        """Agree on who holds a state; the lowest such rank sends it to every other rank."""
        holders = _dist.gather_to_all(self._holds_state)
        source = next((rank for rank, holds in enumerate(holders) if holds), None)
        log.debug("round %s: ranks holding a state %s; source %s", self.round, holders, source)
        if source is None:
            self.received = False  # nobody survived: the loop loads its checkpoint
            return
        _broadcast_state(self.state, source)
        self.received = _dist.rank() != source
        self._holds_state = True


class AbortWatch:
    """While a step runs, look at the assignment file every ``interval`` seconds on a thread;
    on a round newer than ``current``, call ``abort`` once. ``aborted`` says whether it did."""

    def __init__(
        self,
        file: Path,
        current: int | None,
        abort: Callable[[], None],
        interval: float = WATCH_INTERVAL,
    ) -> None:
        self._file = file
        self._current = current
        self._abort = abort
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="in-place-watch", daemon=True)
        self.aborted = False

    def __enter__(self) -> AbortWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            assignment = read_assignment(self._file)
            if assignment is None:
                continue
            if self._current is None or assignment.round > self._current:
                log.debug("round %d came during a step: aborting the group", assignment.round)
                self.aborted = True
                self._abort()
                return


def _abort_group() -> None:
    """Abort the default NCCL group from the watch's thread (what NVRx's monitor does), through
    the public ``ProcessGroup.abort`` of ``dist.group.WORLD``."""
    group = dist.group.WORLD
    if group is None:
        return
    with contextlib.suppress(Exception):  # already gone: the step's error says the rest
        group.abort()


def _wait_for_master(environ: Mapping[str, str], deadline: float) -> None:
    """A rank other than 0 waits, until ``deadline``, for rank 0's store to listen.

    Survivors take up a round within milliseconds of each other, so ranks 1..N knock on rank
    0's TCPStore before it opens its port, and torch's client answers a refused connection
    with a growing backoff (0.25-0.75 s, then 0.4-1.1 s, ...): the restart then waits seconds
    after rank 0 listens (measured: 2.4-7 s instead of 0.1 s; the standbys do the same wait,
    ``agent/standby.py``). A plain connect every 10 ms costs nothing."""
    if environ.get("RANK", "0") == "0" or not environ.get("MASTER_PORT"):
        return
    address = (environ.get("MASTER_ADDR", "127.0.0.1"), int(environ["MASTER_PORT"]))
    while time.monotonic() < deadline:
        try:
            socket.create_connection(address, timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)
    log.debug("rank 0's store at %s:%s did not listen in time", *address)


def _round(environ: Mapping[str, str]) -> int | None:
    value = environ.get(contract.ROUND_ENV, "")
    return int(value) if value.isdigit() else None


def _leave_group() -> None:
    """Destroy the default group. NCCL first aborts it (the public ``ProcessGroup.abort``), so
    that a collective still queued on a dead peer returns instead of blocking the destroy."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        _abort_group()
    dist.destroy_process_group()


def _broadcast_state(state: Stateful, source: int) -> None:
    """``source``'s state on every rank: its structure as tagged JSON, then each tensor."""
    sending = _dist.rank() == source
    tensors: list[torch.Tensor] = []
    skeleton = _hollow(state.state_dict(), tensors) if sending else None
    payload = _dist.broadcast_bytes(_dist.encode(skeleton) if sending else None, source)
    received_skeleton, shapes = _dist.decode(payload)
    device = _dist.collective_device()
    if sending:
        with collective("broadcast"):
            for tensor in tensors:
                dist.broadcast(tensor.detach().to(device).contiguous(), src=source)
        return
    filled: list[torch.Tensor] = []
    with collective("broadcast"):
        for dtype_of, shape in shapes:
            buffer = torch.empty(shape, dtype=dtype_of.dtype, device=device)
            dist.broadcast(buffer, src=source)
            filled.append(buffer)
    state.load_state_dict(_fill(received_skeleton, iter(filled)))


def _hollow(tree: Any, tensors: list[torch.Tensor]) -> tuple[Any, list[tuple[Any, list[int]]]]:
    """The tree with each tensor replaced by an empty one of its type, and (type, shape) of
    each in walk order; the tensors themselves are appended to ``tensors``."""
    shapes: list[tuple[Any, list[int]]] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            empty = torch.empty(0, dtype=node.dtype)
            shapes.append((empty, list(node.shape)))
            return empty
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list | tuple):
            items = [walk(value) for value in node]
            return tuple(items) if isinstance(node, tuple) else items
        return node

    return walk(tree), shapes


def _fill(node: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``_hollow`` undone on the receiving side: each empty tensor, in walk order, is the next
    received one. Dicts keep their order through the JSON, so the walk orders agree."""
    if isinstance(node, torch.Tensor):
        return next(tensors)
    if isinstance(node, dict):
        return {key: _fill(value, tensors) for key, value in node.items()}
    if isinstance(node, list | tuple):
        items = [_fill(value, tensors) for value in node]
        return tuple(items) if isinstance(node, tuple) else items
    return node
