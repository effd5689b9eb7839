"""Which worker holds a TCP connection to the round's store: the kernel's word, not the script's.

A rank's first act in ``init_process_group`` is to connect its TCPStore client to
``MASTER_ADDR:MASTER_PORT``; the agent sees that connection in ``/proc`` (the worker's socket
inodes in ``/proc/PID/fd``, the connection table of its network namespace in
``/proc/PID/net/tcp`` and ``tcp6``) without any help from the script and without torch. It
is what the restart timeline's ``connected`` phase and the standbys' refill go by for a
script that never beats a heartbeat (a plain torchrun script).

Every read answers None where the process is gone or ``/proc`` cannot say, and the callers
treat None as "not seen yet", never as a fact.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence

log = logging.getLogger(__name__)

ESTABLISHED = "01"
"""The ``st`` column of ``/proc/net/tcp`` for an established connection."""


def socket_inodes(pid: int) -> set[str] | None:
    """The inodes of the sockets that ``pid`` holds open (``socket:[INODE]`` links)."""
    directory = f"/proc/{pid}/fd"
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    inodes = set()
    for name in names:
        try:
            target = os.readlink(f"{directory}/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def established_to(table: str, inodes: Iterable[str], port: int) -> bool:
    """Whether one of ``inodes`` is an established connection to remote ``port`` in ``table``
    (the text of ``/proc/PID/net/tcp`` or ``tcp6``: a header line, then one socket a line:
    ``sl local_address rem_address st ... uid timeout inode``, addresses as ``HEXIP:HEXPORT``).
    """
    wanted = set(inodes)
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != ESTABLISHED or fields[9] not in wanted:
            continue
        _, _, remote_port = fields[2].rpartition(":")
        try:
            if int(remote_port, 16) == port:
                return True
        except ValueError:
            continue
    return False


def connected_to(pid: int, port: int) -> bool | None:
    """Whether ``pid`` holds an established TCP connection to ``port`` (on any address: the
    store's host is the only one that serves the round's port to this job); None if unknown."""
    inodes = socket_inodes(pid)
    if inodes is None:
        return None
    if not inodes:
        return False
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", "rb") as file:
                text = file.read().decode(errors="replace")
        except OSError:
            continue
        if established_to(text, inodes, port):
            return True
    return False


class StoreWatch:
    """Looks, poll after poll, for every local rank's connection to the round's store, and
    says so once (``look`` answers True at the look that completes the set). It stops looking
    at ``until``: a script that never connects (it uses no process group) costs nothing after."""

    def __init__(self, port: int, until: float) -> None:
        self.port = port
        self.until = until
        self.seen: set[int] = set()
        self.done = False

    def look(self, pids: Sequence[int], now: float) -> bool:
        if self.done or now > self.until or not pids:
            return False
        for pid in pids:
            if pid not in self.seen and connected_to(pid, self.port):
                self.seen.add(pid)
        if all(pid in self.seen for pid in pids):
            self.done = True
            log.debug("every local rank is connected to the store on port %d", self.port)
            return True
        return False
