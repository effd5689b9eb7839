"""Turn a dead worker into a ``Failure``: who, how, and the traceback it left behind."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

from hpc_elastic.rendezvous.api import Failure

_MAX_MESSAGE = 2000
_TAIL_LINES = 15

_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|ECONNRESET|Broken pipe"
    r"|Connection refused|NCCL communicator was aborted|ProcessGroupNCCL.*(abort|timeout)"
    r"|Socket Timeout|Timed out waiting|DistNetworkError|DistStoreError",
    re.IGNORECASE,
)
"""Errors a rank raises when a *peer* vanished: an echo of another failure, not a root cause."""


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
        text = path.read_bytes()[-16384:].decode(errors="replace")
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
    message = "\n".join(part for part in (reason, detail) if part)
    return Failure(
        node_id=node_id,
        host=host,
        rank=rank,
        exit_code=exit_code,
        signal=signal_name,
        message=message[-_MAX_MESSAGE:],
        time=time.time(),
        slot=slot,
    )


def is_echo(failure: Failure) -> bool:
    """True if the rank most likely failed because a peer died (so the peer is the cause)."""
    return failure.signal is None and _PEER_LOST.search(failure.message) is not None


def summary(failure: Failure) -> str:
    """One headline sentence plus the indented traceback, printed once by the agent."""
    how = (
        f"killed by {failure.signal}" if failure.signal else f"exited with code {failure.exit_code}"
    )
    where = failure.slot or failure.host
    headline = f"Worker rank {failure.rank} on node '{where}' ({failure.node_id}) {how}."
    body = "\n".join(f"    {line}" for line in failure.message.splitlines())
    return f"{headline}\n{body}" if body else headline
