"""The agent's hand-over of a new round to a surviving worker (in-place mode), torch-free.

The agent (which never imports torch) writes with ``write_assignment`` and reads the worker's
acknowledgement with ``read_ack``; ``hpc_elastic.train.inplace`` is the worker's side (and
``hpc_elastic.train.assignment`` re-exports this module for scripts that import it there). Both
files live in the agent's private run directory, on the node's own disk: a worker looks at its
file once per step, which on a shared file system could cost a round trip (and its attribute
cache could hide the change for seconds).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic import contract
from hpc_elastic.decoding import Check, JsonRecord, record, text, whole
from hpc_elastic.errors import AgentError

log = logging.getLogger(__name__)

ASSIGNMENT_FILE_ENV = contract.ASSIGNMENT_FILE_ENV
ROUND_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    contract.ROUND_ENV,
)
"""The worker variables that change from one round to the next; all else stays as spawned.
``TORCHELASTIC_USE_AGENT_STORE`` does: whether the round's store is the agent's (then rank 0
joins it as a client) or rank 0's own to open depends on the round (agent/storehost.py)."""

_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe")
"""Words of the errors a collective raises when a peer is gone (gloo says ``Connection closed
by peer`` from ``gloo/transport/tcp``; an aborted NCCL group names NCCL)."""


@dataclass(frozen=True)
class Assignment:
    """One worker's round: its number and the variables of ``ROUND_KEYS`` it sets."""

    round: int
    env: Mapping[str, str]


def write_assignment(path: Path, assignment: Assignment) -> None:
    """The agent's side: replace ``path`` at once (write + rename), so a reader never sees half."""
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(json.dumps({"round": assignment.round, "env": dict(assignment.env)}))
    os.replace(staged, path)


ASSIGNMENT_FIELDS: dict[str, Check] = {
    "round": whole(0),
    "env": record(dict, {name: text() for name in ROUND_KEYS}),
}
"""What ``write_assignment`` writes (``hpc_elastic.decoding``): a round number (never ``true``
or ``2.0``) and exactly the variables of ``ROUND_KEYS``, as text: only the round's own
variables may change under a running worker."""
_ASSIGNMENT = JsonRecord(
    Assignment,
    ASSIGNMENT_FIELDS,
    AgentError,
    "The round assignment {subject} is not one this agent writes ({why}); check that the "
    "agent and the workers run the same hpc-elastic version.",
)


def decode_assignment(data: bytes) -> Assignment:
    """The assignment in ``data``, each field of its type, or one ``AgentError`` sentence
    naming the field and its value."""
    return _ASSIGNMENT.decode(data)


def read_assignment(path: Path) -> Assignment | None:
    """The round in ``path``, or None when there is none or it is not one the agent writes
    (the worker goes on in its round; the agent, without an acknowledgement, restarts it)."""
    try:
        return decode_assignment(path.read_bytes())
    except (OSError, AgentError) as error:
        log.debug("no assignment in %s: %s", path, error)
        return None


def ack_path(assignment_file: Path) -> Path:
    return assignment_file.with_name(assignment_file.name + ".ack")


def write_ack(assignment_file: Path, round_number: int) -> None:
    """The worker's side: it took up ``round_number``."""
    path = ack_path(assignment_file)
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(str(round_number))
    os.replace(staged, path)


def read_ack(assignment_file: Path) -> int | None:
    """The round the worker last took up, or None before any."""
    try:
        return int(ack_path(assignment_file).read_text())
    except (OSError, ValueError):
        return None


def is_collective_error(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because a peer went away: a ``DistError``
    (newer torch raises those), or a RuntimeError whose text names the transport (gloo raises
    a plain RuntimeError). Anything else is the step's own failure and is never retried."""
    if not isinstance(error, RuntimeError):
        return False
    if type(error).__name__ in ("DistError", "DistBackendError", "DistNetworkError"):
        return True
    text = str(error).lower()
    return any(marker in text for marker in _COLLECTIVE_MARKERS)
