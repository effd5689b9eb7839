"""The pure parts of a server's start: which ports it takes, and its ``zoo.cfg``.

Every node of the dev cluster is 127.0.0.1, and on a real cluster another job may hold any
fixed port, so no port is fixed: each server picks its client, quorum and election ports at
run time and publishes them (``files.Server``) for the others. A port is *claimed* by binding
and listening on it (``server.PortClaim``), and the claims are held until every server has
published: two servers on one host can then never pick the same port, and a listening socket
keeps it even from a socket with ``SO_REUSEADDR``. They are let go just before ZooKeeper
starts; the candidates lie below Linux's ephemeral range (``contract.DEFAULT_ZK_PORTS``), so no
outgoing connection takes one in that moment.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from hpc_elastic import contract
from hpc_elastic.ensemble.files import Server
from hpc_elastic.errors import EnsembleError, UsageError

PORTS_PER_SERVER = 3
"""Client, quorum (followers to the leader) and leader election."""
INIT_LIMIT_S = 30
"""Seconds a follower may take to connect and sync to a new leader (``initLimit``)."""
SYNC_LIMIT_S = 10
"""Seconds a follower may lag behind the leader before it is dropped (``syncLimit``): a loaded
node's JVM pauses for seconds, and a dropped follower disconnects its clients."""
SNAP_RETAIN = 3
PURGE_INTERVAL_HOURS = 1
DIGEST_PROVIDER = "org.apache.zookeeper.server.auth.DigestAuthenticationProvider"
SUPERUSER = "hpc-elastic"
"""The digest user of ZooKeeper's superuser, whose secret is the run directory's
``reconfig.secret``: the same user name the rendezvous client authenticates as
(``rendezvous.zookeeper.DIGEST_USER``), so that its client opened with that secret is the
superuser. Only the superuser may ``reconfig`` (it writes ``/zookeeper/config``)."""
PARTICIPANT = "participant"
OBSERVER = "observer"

_PORT_RANGE = re.compile(r"^\s*(\d{1,5})\s*:\s*(\d{1,5})\s*$")


def parse_ports(text: str) -> tuple[int, int]:
    """``--ports LOW:HIGH``: where a site's firewall lets nodes reach each other's servers."""
    match = _PORT_RANGE.match(text)
    if match is not None:
        low, high = int(match.group(1)), int(match.group(2))
        if low >= 1024 and high <= 65535 and high - low + 1 >= PORTS_PER_SERVER:
            return low, high
    raise UsageError(
        f"--ports '{text}' is not LOW:HIGH with 1024 <= LOW, HIGH <= 65535 and room for "
        f"{PORTS_PER_SERVER} ports; give e.g. '{contract.DEFAULT_ZK_PORTS[0]}:"
        f"{contract.DEFAULT_ZK_PORTS[1]}'."
    )


def port_candidates(ports: tuple[int, int], rng: random.Random) -> list[int]:
    """Every port of the range, in a random order: servers starting together on one host
    then try different ports first, instead of fighting over the lowest."""
    candidates = list(range(ports[0], ports[1] + 1))
    rng.shuffle(candidates)
    return candidates


def choose_ports(count: int, candidates: Iterable[int], claim: Callable[[int], bool]) -> list[int]:
    """The first ``count`` candidates that ``claim`` takes (it binds one and holds it, or
    says no), or one sentence when the candidates run out."""
    chosen: list[int] = []
    tried = 0
    for port in candidates:
        if port in chosen:
            continue
        tried += 1
        if claim(port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise EnsembleError(
        f"Only {len(chosen)} of the {count} ports a ZooKeeper server needs were free among the "
        f"{tried} tried; give a range with more free ports with --ports LOW:HIGH."
    )


def missing_peers(published: Mapping[int, Server], servers: int) -> list[int]:
    """The myids (1..servers) that have not published their ports yet."""
    return [myid for myid in range(1, servers + 1) if myid not in published]


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``zoo.cfg`` says about one server."""

    myid: int
    data_dir: str
    txlog_dir: str
    client_port: int
    peers: Sequence[Server] = ()
    """Every server of the ensemble, this one included; empty for a standalone server."""
    joiners: Sequence[Server] = ()
    """Servers about to join (this one, on a spare node), listed as observers (below)."""
    super_digest: str = ""
    """``super_digest``'s value: reconfiguration on, for that superuser only; empty: off."""
    tick_ms: int = contract.ZK_TICK_MS
    min_session_ms: int = contract.ZK_MIN_SESSION_MS
    max_session_ms: int = contract.ZK_MAX_SESSION_MS


def timing(tick_ms: int = contract.ZK_TICK_MS) -> dict[str, str]:
    """``zoo.cfg``'s timing: the tick, and the followers' limits in ticks of it."""
    return {
        "tickTime": str(tick_ms),
        "initLimit": str(ticks(INIT_LIMIT_S, tick_ms)),
        "syncLimit": str(ticks(SYNC_LIMIT_S, tick_ms)),
    }


def ticks(seconds: float, tick_ms: int) -> int:
    """A limit of ``seconds`` in ZooKeeper's ticks of ``tick_ms``, never shorter."""
    return math.ceil(seconds * 1000 / tick_ms)


def render_zoo_cfg(config: ServerConfig) -> str:
    """The server's configuration, secure by default (docs/cluster-setup.md, "Security"):

    - only ``srvr``, ``mntr`` and ``ruok`` answer (``conf``, ``cons``, ``dump``, ``envi``, ``wchp``
      would tell anyone on the network the session ids, paths and environment);
    - no AdminServer (an HTTP port of its own, with the same commands);
    - the digest scheme every job's ACL uses, named, with SHA1 pinned: kazoo's
      ``make_digest_acl`` hashes with SHA1, so a site default of another algorithm would
      silently lock every job out of its own nodes; ACLs are never skipped;
    - snapshots and transaction logs in node-local directories, the oldest purged hourly;
    - dynamic reconfiguration only with a superuser (``super_digest``): ZooKeeper lets only
      the superuser write ``/zookeeper/config`` unless ACLs are skipped, which they never are.
      Its digest is a ZooKeeper setting here, not a ``-D`` on java's command line, where any
      user of the node could read it (``ps``); this file is the user's alone.

    With reconfiguration on, every ``server.N`` line carries its client port (``;port``), as
    the members that ZooKeeper hands a joiner must; ZooKeeper moves the lines to a dynamic
    file of its own at the first election (``zoo.cfg.dynamic.<version>``) and keeps that file
    up to date. A joiner is listed as an observer: ZooKeeper's documented way to start a
    server that is not a member yet, so that no two joiners can ever form a quorum of their
    own; it adopts the ensemble's configuration from the leader and becomes a participant
    when ``reconfig`` adds it.
    """
    lines = [
        f"# hpc-elastic: ZooKeeper server {config.myid}"
        + (f" of {len(config.peers)}" if config.peers else " (standalone)"),
        *(f"{key}={value}" for key, value in timing(config.tick_ms).items()),
        f"minSessionTimeout={config.min_session_ms}",
        f"maxSessionTimeout={config.max_session_ms}",
        f"dataDir={config.data_dir}",
        f"dataLogDir={config.txlog_dir}",
        f"clientPort={config.client_port}",
        f"autopurge.snapRetainCount={SNAP_RETAIN}",
        f"autopurge.purgeInterval={PURGE_INTERVAL_HOURS}",
        f"4lw.commands.whitelist={','.join(contract.ZK_FOUR_LETTER_WORDS)}",
        "admin.enableServer=false",
        f"authProvider.1={DIGEST_PROVIDER}",
        "DigestAuthenticationProvider.digestAlg=SHA1",
        "skipACL=no",
    ]
    reconfig = bool(config.super_digest) and bool(config.peers)
    if reconfig:
        lines += [
            "reconfigEnabled=true",
            f"DigestAuthenticationProvider.superDigest={config.super_digest}",
        ]
    else:
        lines.append("reconfigEnabled=false")
    listed = [(peer, PARTICIPANT) for peer in config.peers]
    listed += [(joiner, OBSERVER) for joiner in config.joiners]
    for server, role in sorted(listed, key=lambda item: item[0].myid):
        lines.append(
            server_line(server, role)
            if reconfig
            else f"server.{server.myid}={server.host}:{server.quorum_port}:{server.election_port}"
        )
    return "\n".join(lines) + "\n"


def server_line(server: Server, role: str = PARTICIPANT) -> str:
    """``server.N=host:quorum:election:role;client``: a server as ``zoo.cfg``, the dynamic
    configuration and ``reconfig -add`` spell it."""
    return (
        f"server.{server.myid}={server.host}:{server.quorum_port}:{server.election_port}"
        f":{role};{server.client_port}"
    )


def super_digest(secret: str) -> str:
    """``DigestAuthenticationProvider.superDigest``'s value for ``SUPERUSER`` with ``secret``:
    ``user:base64(sha1(user:secret))``, the digest ZooKeeper computes from a client's
    ``addauth digest user:secret`` (with SHA1, the algorithm ``render_zoo_cfg`` pins)."""
    digest = hashlib.sha1(f"{SUPERUSER}:{secret}".encode()).digest()  # ZooKeeper's choice, pinned
    return f"{SUPERUSER}:{base64.b64encode(digest).decode()}"


_SERVER_LINE = re.compile(r"^server\.(\d+)=[^:]+:\d+:\d+(?::(participant|observer))?(?:;.*)?$")


def dynamic_members(text: str) -> dict[int, str]:
    """The servers of a dynamic configuration (``/zookeeper/config``, a
    ``zoo.cfg.dynamic.<version>`` file, or the ``server.N`` lines of a ``zoo.cfg``): myid ->
    role (participant unless it says observer)."""
    found: dict[int, str] = {}
    for line in text.splitlines():
        match = _SERVER_LINE.match(line.strip().replace(" ", ""))
        if match is not None:
            found[int(match.group(1))] = match.group(2) or PARTICIPANT
    return found


def zookeeper_owns(zoo_cfg: str, dynamic: Callable[[str], str | None], myid: int) -> bool:
    """Whether a server started again in place should keep the configuration ZooKeeper left
    in its directory: its ``zoo.cfg`` names a dynamic file (``dynamicConfigFile=``) that
    exists (``dynamic`` reads it, None when it is missing) and lists this server as a
    participant. That file is the ensemble's last configuration as this server saw it, with
    its version, and ZooKeeper's guide says never to alter it. A joiner that was not added
    yet finds itself absent from it and could not boot with it: it is started from our
    configuration again, as a joiner."""
    for line in zoo_cfg.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "dynamicConfigFile" and value.strip():
            text = dynamic(value.strip())
            return text is not None and dynamic_members(text).get(myid) == PARTICIPANT
    return False


def quorum(servers: int) -> int:
    """Servers that must be up for the ensemble to serve: a majority."""
    return servers // 2 + 1


def survives(servers: int) -> int:
    """Servers an ensemble of this size may lose and still serve."""
    return servers - quorum(servers)
