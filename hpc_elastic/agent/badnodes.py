"""Bad nodes remembered across jobs: the pure rules over the records, and the user's book.

A node that failed its health preflight is remembered for a set time (``DEFAULT_TTL``), per
user, so the user's next jobs keep it in Slurm's ``ExcNodeList`` too. Where the records live
(a ZooKeeper node under the user's prefix) is ``rendezvous/zookeeper.py``'s business, and
their shape (``BadNode``) is ``rendezvous/badnode.py``'s, below the stores that keep it; here
are the rules, and what ``hpc-elastic nodes`` and ``doctor`` do with a user's book (``Book``),
so all of it is tested on the in-memory book (``rendezvous/memory.py``). ``open_book`` is the
one way the commands reach the real one.
"""

from __future__ import annotations

import getpass
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from hpc_elastic.contract import DEFAULT_BAD_NODE_TTL, USER_SECRET_FILE_ENV
from hpc_elastic.errors import RendezvousError, UsageError, one_line
from hpc_elastic.rendezvous.badnode import BadNode, check_host

logger = logging.getLogger(__name__)

DEFAULT_TTL = DEFAULT_BAD_NODE_TTL
"""How long a remembered bad node stays excluded (``contract.DEFAULT_BAD_NODE_TTL``)."""


def remembered(host: str, reason: str, now: float, ttl: float, job: str = "") -> BadNode:
    """The record for a node found bad at ``now``; it is forgotten ``ttl`` seconds later."""
    if ttl <= 0:
        raise UsageError(f"A bad node must be remembered a positive time, not '{ttl:g}' s.")
    return BadNode(check_host(host), reason, since=now, until=now + ttl, job=job)


def current(records: Iterable[BadNode], now: float) -> list[BadNode]:
    """The records not yet expired, by host; of two for one host the later expiry wins."""
    latest: dict[str, BadNode] = {}
    for record in records:
        if record.until > now and (
            record.host not in latest or record.until > latest[record.host].until
        ):
            latest[record.host] = record
    return [latest[host] for host in sorted(latest)]


def expired(records: Iterable[BadNode], now: float) -> list[str]:
    """Hosts whose records may be deleted."""
    return sorted({record.host for record in records if record.until <= now})


def exclude_list(records: Iterable[BadNode], now: float, also: Iterable[str] = ()) -> str:
    """Slurm's ``ExcNodeList`` value: the current bad nodes plus ``also``, sorted, no repeats."""
    hosts = {record.host for record in current(records, now)} | set(also)
    return ",".join(sorted(hosts))


# --- the user's book: what `hpc-elastic nodes` and `doctor` do with it ---------------------


class Book(Protocol):
    """One user's remembered bad nodes, wherever they are kept: ``zookeeper.BadNodeBook``
    on a real ensemble, ``memory.MemoryBadNodeBook`` in tests."""

    def remember(self, record: BadNode) -> None: ...

    def records(self) -> list[BadNode]: ...

    def forget(self, hosts: Iterable[str]) -> None: ...


def listing(book: Book, now: float) -> list[BadNode]:
    """The user's bad nodes not yet expired, by host; expired records are deleted on the way,
    so the book does not grow with every node that ever failed."""
    records = book.records()
    stale = expired(records, now)
    if stale:
        logger.debug("badnodes: forgetting expired records of %s", ", ".join(stale))
        book.forget(stale)
    return current(records, now)


@dataclass(frozen=True)
class Cleared:
    """What ``clear`` did: the hosts forgotten, and those asked for that were not listed."""

    forgotten: tuple[str, ...]
    unknown: tuple[str, ...]


def clear(book: Book, hosts: Iterable[str] = ()) -> Cleared:
    """Forget ``hosts``, or every record of the user when none is given. A host that is not
    in the book is reported, not an error: clearing is what the user wanted either way."""
    asked = {check_host(host) for host in hosts}
    known = {record.host for record in book.records()}
    chosen = sorted(known & asked) if asked else sorted(known)
    book.forget(chosen)
    logger.debug("badnodes: cleared %s", ", ".join(chosen) or "nothing")
    return Cleared(tuple(chosen), tuple(sorted(asked - known)))


def _stamp(seconds: float) -> str:
    """UTC, to the second: the user compares it with Slurm's and the logs' times."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _left(seconds: float) -> str:
    """``3h12m``, ``4m``: how long a node stays excluded, at a glance."""
    minutes = max(0, int(seconds // 60))
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m"


def table(records: Iterable[BadNode], now: float) -> list[str]:
    """The lines ``hpc-elastic nodes`` prints: node, since, until (and time left), reason."""
    rows = [
        (
            record.host,
            _stamp(record.since),
            f"{_stamp(record.until)} ({_left(record.until - now)} left)",
            one_line(record.reason),
        )
        for record in records
    ]
    if not rows:
        return ["No bad nodes remembered: every node may run your jobs."]
    header = ("NODE", "SINCE", "UNTIL", "REASON")
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(3)]
    return [
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[3]])
        for row in [header, *rows]
    ]


def as_json(records: Iterable[BadNode]) -> list[dict[str, object]]:
    """``hpc-elastic nodes --json``: one object per node, the record's own fields."""
    return [asdict(record) for record in records]


# --- opening the user's book on the ensemble the jobs use -----------------------------------

LOCAL_SCHEME = "local:"
"""``local_store.SCHEME``, spelt here so the CLI does not import the local store."""
OPEN_TIMEOUT = 5.0
"""Seconds ``nodes`` and ``doctor`` wait for ZooKeeper: a person is waiting, not a job."""


def read_user_secret(path: Path) -> str:
    """The user's secret, read and never created: a command that only looks must not mint a
    secret that the agents' book (made with theirs) would then refuse."""
    from hpc_elastic.rendezvous.secret import read_secret_file  # noqa: PLC0415

    where = path.expanduser()
    if not where.is_file():
        raise RendezvousError(
            f"No user secret at '{where}', so no agent of yours has remembered a bad node with "
            f"it; if your agents use another file, give --user-secret-file FILE (or "
            f"{USER_SECRET_FILE_ENV})."
        )
    try:
        return read_secret_file(where)
    except RendezvousError as error:  # Its sentence names the job's --zk-auth-file.
        raise RendezvousError(
            f"Cannot read the user secret '{where}'; check that it is yours and readable "
            "(chmod 600)."
        ) from error


@contextmanager
def open_book(
    zk: str, secret_file: Path, user: str | None = None, timeout: float = OPEN_TIMEOUT
) -> Iterator[Book]:
    """The user's book on the ZooKeeper at ``zk``, open for the ``with`` block. Every way this
    fails is a one-sentence ``HpcElasticError``: a local store, no secret, no answer, or an
    ACL that refuses the secret."""
    if zk.startswith(LOCAL_SCHEME):
        raise UsageError(
            f"--zk '{zk}' is a local store, which remembers no bad nodes (its agents skip the "
            "memory); give the ZooKeeper HOST:PORT your cluster jobs use."
        )
    secret = read_user_secret(secret_file)
    from hpc_elastic.rendezvous import zookeeper  # noqa: PLC0415 (kazoo: only when asked)

    # The command's one sentence says it all; kazoo's retries on stderr are not news.
    logging.getLogger("kazoo").addHandler(logging.NullHandler())
    name = user or getpass.getuser()
    logger.debug("badnodes: opening user %s's book on %s", name, zk)
    with zookeeper.bad_node_book(zk, name, secret, connect_timeout=timeout) as book:
        yield book
