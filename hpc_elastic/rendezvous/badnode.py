"""The bad-node record as the stores keep it: one per host in the user's book.

``zookeeper.BadNodeBook`` keeps each record in a znode named by the host, and
``memory.MemoryBadNodeBook`` in a dict, encoded alike; both need the record's shape, its
typed decoding and the host check that makes a host one znode name. They live here, below
the stores, so that the stores need nothing from the agent. The rules over the records (what
is current, what expires, what goes into ``ExcNodeList``) and the user's book as the
commands reach it are ``agent/badnodes.py``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from hpc_elastic import decoding
from hpc_elastic.decoding import Check, MalformedError, seconds, shown, text
from hpc_elastic.errors import RendezvousError, UsageError, one_line

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BadNode:
    host: str
    reason: str
    since: float
    until: float
    job: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> BadNode:
        """The record in ``data``, each field of its type (``BADNODE_FIELDS``), or one
        ``RendezvousError`` sentence naming the field and its value."""
        return _BADNODE.decode(data)

    @classmethod
    def decode(cls, data: bytes) -> BadNode | None:
        """``parse``, but None for a record we cannot read: a forgotten node is safer than a
        crash of the preflight or of ``hpc-elastic nodes``."""
        try:
            return cls.parse(data)
        except RendezvousError as error:
            logger.debug("badnodes: ignoring a record: %s", error)
            return None


def _host(value: object, where: str) -> object:
    """A node name as ``check_host`` accepts it: text, printable, usable as one znode name."""
    if type(value) is not str:
        raise MalformedError(f"'{where}' is {shown(value)}, not a string")
    try:
        return check_host(value)
    except UsageError:
        raise MalformedError(f"'{where}' is {shown(value)}, not a node name") from None


BADNODE_FIELDS: dict[str, Check] = {
    "host": _host,
    "reason": text(),
    "since": seconds,
    "until": seconds,
    "job": text(),
}
"""``BadNode``'s fields (``hpc_elastic.decoding``): a host of ``["x"]`` is no node (``str()``
made it ``"['x']"``), a time is finite (NaN never expires); ``job`` may be missing (older
records)."""
_BADNODE = decoding.JsonRecord(
    BadNode,
    BADNODE_FIELDS,
    RendezvousError,
    "The bad-node record {subject} is not one hpc-elastic writes ({why}); clear it with "
    "'hpc-elastic nodes clear NODE'.",
    defaults=True,
)


def check_host(host: str) -> str:
    """A host name usable as one znode name, or a UsageError that quotes it."""
    if not host or "/" in host or host in (".", "..") or not host.isprintable():
        raise UsageError(
            f"'{one_line(host)}' is not a node name; give a host name as Slurm lists it, "
            "e.g. 'node017'."
        )
    return host
