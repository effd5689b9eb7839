"""ZooKeeper's four-letter words ``srvr`` and ``mntr``: asked over a plain socket, parsed by pure
functions, and judged (``health``, ``quorum_state``). No kazoo: ``zk status`` and ``zk start``'s
wait for a leader need no session, only each server's own account of itself.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

NOT_SERVING = "not currently serving requests"
"""What a server without a quorum answers to every word but ``ruok``."""
MODES = ("leader", "follower", "standalone", "observer")


def ask(host: str, port: int, word: str, timeout: float = 2.0) -> str:
    """The server's whole answer to ``word``; raises OSError when it cannot be reached."""
    with socket.create_connection((host, port), timeout=timeout) as connection:
        connection.sendall(word.encode())
        chunks = []
        while chunk := connection.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def parse_mntr(text: str) -> dict[str, str]:
    """``mntr``: one ``key<TAB>value`` a line (``zk_server_state  leader``)."""
    pairs = (line.split("\t", 1) for line in text.splitlines() if "\t" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def parse_srvr(text: str) -> dict[str, str]:
    """``srvr``: one ``Key: value`` a line (``Mode: follower``, ``Connections: 3``)."""
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


@dataclass(frozen=True)
class Health:
    """One server's state as it describes itself."""

    address: str
    mode: str
    """leader, follower, standalone, observer, "no quorum" (up, not serving) or down."""
    clients: int | None = None
    latency_avg_ms: float | None = None
    latency_max_ms: float | None = None
    version: str = ""
    error: str = ""
    """Why it counts as down: what the connection attempt said."""

    @property
    def serving(self) -> bool:
        return self.mode in MODES


def _number(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def from_mntr(address: str, text: str) -> Health:
    """A server's health from its ``mntr`` answer (pure)."""
    if NOT_SERVING in text:
        return Health(address, "no quorum")
    values = parse_mntr(text)
    clients = _number(values.get("zk_num_alive_connections"))
    return Health(
        address,
        values.get("zk_server_state", "unknown"),
        None if clients is None else int(clients),
        _number(values.get("zk_avg_latency")),
        _number(values.get("zk_max_latency")),
        values.get("zk_version", "").split(",")[0].split("-")[0],
    )


def from_srvr(address: str, text: str) -> Health:
    """A server's health from its ``srvr`` answer (pure), when ``mntr`` is not allowed."""
    if NOT_SERVING in text:
        return Health(address, "no quorum")
    values = parse_srvr(text)
    latency = values.get("Latency min/avg/max", "").split("/")
    clients = _number(values.get("Connections"))
    return Health(
        address,
        values.get("Mode", "unknown"),
        None if clients is None else int(clients),
        _number(latency[1]) if len(latency) == 3 else None,
        _number(latency[2]) if len(latency) == 3 else None,
        values.get("Zookeeper version", "").split(",")[0].split("-")[0],
    )


def health(host: str, port: int, timeout: float = 2.0) -> Health:
    """Ask one server how it is: ``mntr``, else ``srvr`` (a whitelist may allow only one)."""
    address = f"{host}:{port}"
    try:
        text = ask(host, port, "mntr", timeout)
        if text.strip() and "is not executed because it is not in the whitelist" not in text:
            return from_mntr(address, text)
        return from_srvr(address, ask(host, port, "srvr", timeout))
    except OSError as error:
        log.debug("zookeeper server %s does not answer: %s", address, error)
        return Health(address, "down", error=error.strerror or str(error))


def synced(values: dict[str, str]) -> bool:
    """Whether a server (a joiner, above all) follows the leader with its data in sync, from
    its ``mntr``: ``zk_peer_state`` is ``following - broadcast`` (3.6 and newer; the leader's
    is ``leading - broadcast``). A joiner reports ``follower`` while it is still a non-voting
    one, so the state alone does not tell; without ``zk_peer_state`` it is all there is."""
    peer_state = values.get("zk_peer_state")
    if peer_state is not None:
        return peer_state.endswith("broadcast")
    return values.get("zk_server_state") in ("follower", "observer", "leader")


def quorum_state(healths: Sequence[Health]) -> str:
    """``serving`` (every server up, one leader), ``degraded`` (serving, but a server is down
    or not serving) or ``no quorum`` (nobody leads: clients are turned away)."""
    leading = any(health.mode in ("leader", "standalone") for health in healths)
    if not leading:
        return "no quorum"
    if all(health.serving for health in healths):
        return "serving"
    return "degraded"
