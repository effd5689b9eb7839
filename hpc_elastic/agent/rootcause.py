"""Turn a dead worker into a ``Failure``: who, how, and the traceback it left behind."""

from __future__ import annotations

import json
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.rendezvous.api import Failure

_MAX_MESSAGE = 2000
_TAIL_LINES = 15
_DUMP_LINES = 400
"""Enough for a faulthandler dump of many threads (it prints at most 100 frames each)."""

_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|ECONNRESET|Broken pipe"
    r"|Connection refused|NCCL communicator was aborted|ProcessGroupNCCL.*(abort|timeout)"
    r"|Socket Timeout|Timed out waiting|DistNetworkError|DistStoreError",
    re.IGNORECASE,
)
"""Errors a rank raises when a *peer* vanished: an echo of another failure, not a root cause."""

_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Timeout)\b")
"""The line a traceback ends with: ``torch.distributed.DistNetworkError: ...``."""


def error_file_message(path: Path) -> str | None:
    """The traceback torch's ``@record`` wrote to TORCHELASTIC_ERROR_FILE, if any."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = raw.get("message") if isinstance(raw, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        if isinstance(extra, dict) and isinstance(extra.get("py_callstack"), str):
            return str(extra["py_callstack"])
        message = message.get("message")
    return message if isinstance(message, str) else None


def log_tail(path: Path, lines: int = _TAIL_LINES) -> str:
    try:
        text = path.read_bytes()[-65536:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def describe_exit(returncode: int) -> tuple[int | None, str | None]:
    """A Popen return code as (exit code, signal name): -9 is (None, 'SIGKILL')."""
    if returncode < 0:
        try:
            return None, signal.Signals(-returncode).name
        except ValueError:
            return None, f"signal {-returncode}"
    return returncode, None


def worker_failure(
    *,
    node_id: str,
    host: str,
    slot: str,
    rank: int,
    returncode: int | None,
    error_file: Path,
    log: Path,
    reason: str = "",
) -> Failure:
    """Build the root-cause record; the error file wins over the log's last lines."""
    exit_code, signal_name = describe_exit(returncode) if returncode is not None else (None, None)
    detail = error_file_message(error_file) or log_tail(log)
    return Failure(
        node_id=node_id,
        host=host,
        rank=rank,
        exit_code=exit_code,
        signal=signal_name,
        message=_bounded(reason, detail),
        time=time.time(),
        slot=slot,
    )


def _bounded(reason: str, detail: str) -> str:
    """The agent's reason whole, then as much of the worker's own words as still fits.

    The bound keeps the rendezvous state small; cutting from the front (as it once did) lost
    the reason, the one sentence that says what happened, behind a long log tail."""
    reason = reason[:_MAX_MESSAGE]
    room = _MAX_MESSAGE - len(reason) - (1 if reason else 0)
    tail = detail[-room:] if detail and room > 0 else ""
    return "\n".join(part for part in (reason, tail) if part)


def is_echo(failure: Failure) -> bool:
    """True if the rank most likely failed because a peer died (so the peer is the cause)."""
    return failure.signal is None and _PEER_LOST.search(own_error(failure.message)) is not None


def own_error(message: str) -> str:
    """The worker's own error: its traceback's last exception line and what follows it.

    Only that counts for ``is_echo``: a log tail also holds lines the worker merely printed
    (a retried "Connection refused" while a store started), which say nothing of its death.
    """
    lines = message.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.match(lines[index].strip()):
            return "\n".join(lines[index:])
    stripped = [line for line in lines if line.strip()]
    return stripped[-1] if stripped else ""


def summary(failure: Failure) -> str:
    """One headline sentence plus the indented traceback, printed once by the agent."""
    how = (
        f"killed by {failure.signal}" if failure.signal else f"exited with code {failure.exit_code}"
    )
    where = failure.slot or failure.host
    headline = f"Worker rank {failure.rank} on node '{where}' ({failure.node_id}) {how}."
    body = "\n".join(f"    {line}" for line in failure.message.splitlines())
    return f"{headline}\n{body}" if body else headline


_FAULTHANDLER_HEADER = "Fatal Python error: Aborted"
"""The first line faulthandler prints when the agent's SIGABRT reaches a hung worker."""

_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ .*:$")
_FRAME_LINE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.+)$')


def main_frames(log_text: str) -> list[re.Match[str]] | None:
    """The main thread's frames in the last faulthandler dump of ``log_text``, innermost
    first; None when the log holds no dump (an empty list: a dump without frames).

    faulthandler lists threads newest first, so the main thread (the first one started) is
    the last block."""
    start = log_text.rfind(_FAULTHANDLER_HEADER)
    if start < 0:
        return None
    blocks: list[list[re.Match[str]]] = []
    for line in log_text[start:].splitlines()[1:]:
        if _THREAD_HEADER.match(line):
            blocks.append([])
        elif (frame := _FRAME_LINE.match(line)) and blocks:
            blocks[-1].append(frame)
        elif line.strip() and blocks and blocks[-1]:
            break  # the dump is over: what follows is the next thing the log holds
    return next((block for block in reversed(blocks) if block), [])


def hung_frame(log_text: str) -> str | None:
    """Where the main thread was in the last faulthandler dump of ``log_text``, as
    ``train.py:42 in all_reduce_step``; None when the log holds no dump.

    The main thread's first ``File`` line is the innermost frame, the one that hung. When
    that frame is in a library (torch's ``all_reduce``), the innermost frame of the user's
    own code follows: ``distributed_c10d.py:3252 in all_reduce, called from train.py:42 in
    step``. Only the file's base name is kept: the sentence names a place, the log holds the
    full path.
    """
    main = main_frames(log_text)
    if not main:
        return None
    where = _place(main[0])
    if _is_library(main[0]["file"]):
        # torch's all_reduce says little alone: name the user's call that led there too.
        caller = next((frame for frame in main if not _is_library(frame["file"])), None)
        if caller is not None:
            where += f", called from {_place(caller)}"
    return where


_LIBRARY = re.compile(r"[/\\](site-packages|dist-packages|lib[/\\]python\d+(\.\d+)?)[/\\]")
"""Installed packages and the standard library: not the user's code."""

_COLLECTIVE_CODE = re.compile(
    r"[/\\]torch[/\\](distributed|autograd|nn[/\\]parallel)[/\\]|[/\\]torch[/\\]_tensor\.py$"
)
"""Where a rank waits for its peers: ``torch.distributed`` (a collective), and ``autograd``
or ``Tensor.backward`` (DDP's gradient all-reduce runs inside ``backward()``; its reducer
waits for the bucket's all-reduce before the backward returns)."""


def waits_in(frames: list[re.Match[str]]) -> str | None:
    """The collective a stack waits in (``all_reduce``, ``backward``): torch's distributed or
    autograd code among its innermost frames, before any frame of the user's own code (other
    libraries in between, such as a wrapper, are passed over); None when the user's code comes
    first: the rank is not waiting for its peers there."""
    for frame in frames:
        if _COLLECTIVE_CODE.search(frame["file"]):
            return (
                "backward"
                if "autograd" in frame["file"] or frame["file"].endswith("_tensor.py")
                else str(frame["function"])
            )
        if not _is_library(frame["file"]):
            return None
    return None


@dataclass(frozen=True)
class StackDump:
    """A faulthandler dump a rank printed: where its main thread was, and what it waits in."""

    where: str | None
    """``train.py:42 in step``, as ``hung_frame`` says it; None for a dump without frames."""
    waits_in: str | None


def dump_after(log: Path, offset: int) -> StackDump | None:
    """The dump ``log`` got after byte ``offset`` (when the agent asked for it), or None."""
    try:
        with open(log, "rb") as file:
            file.seek(offset)
            text = file.read().decode(errors="replace")
    except OSError:
        return None
    frames = main_frames(text)
    if frames is None:
        return None
    return StackDump(hung_frame(text), waits_in(frames))


def printed_a_dump(log: Path, offset: int) -> bool:
    """Whether the rank started printing its dump into ``log`` after byte ``offset``."""
    try:
        with open(log, "rb") as file:
            file.seek(offset)
            return _FAULTHANDLER_HEADER.encode() in file.read()
    except OSError:
        return False


def died_of_a_peer(error_file: Path, log: Path) -> bool:
    """Whether a worker that exited says a peer vanished (``is_echo``'s rule on its own
    error): it was waiting in a collective for that peer."""
    message = error_file_message(error_file) or log_tail(log)
    return _PEER_LOST.search(own_error(message)) is not None


def _is_library(path: str) -> bool:
    return _LIBRARY.search(path) is not None


def _place(frame: re.Match[str]) -> str:
    return f"{Path(frame['file']).name}:{frame['line']} in {frame['function']}"


def hung_sentence(rank: int, log: Path) -> str:
    """The root-cause line's "where": the hung rank's innermost frame from its stack dump."""
    where = hung_frame(log_tail(log, lines=_DUMP_LINES))
    if where is None:
        return f"Rank {rank} left no stack dump in {log} (started without faulthandler?)."
    return f"Rank {rank} hung in {where}; its log has every thread's stack."
