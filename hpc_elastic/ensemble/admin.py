"""ZooKeeper's superuser: the one client that changes the ensemble's membership (``reconfig``).

Since 3.5.3 ZooKeeper lets only the superuser, or a user it granted write access to
``/zookeeper/config``, reconfigure an ensemble, unless ACLs are skipped altogether
(``skipACL=yes``), which would open every job's nodes to anyone: this ensemble never does. The
superuser is a digest user whose secret lies in the user's private run directory
(``files.make_secret``); the servers hold only its digest (``zoocfg.super_digest``).

The session is the rendezvous client's (``rendezvous.zookeeper.open_client``, the module that
drives kazoo), opened with the superuser's secret: it authenticates as its digest user,
``rendezvous.zookeeper.DIGEST_USER``, which is ``zoocfg.SUPERUSER``, so the servers see the
superuser. Only the supervisor of the ensemble's job loads this module, never the CLI.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hpc_elastic.ensemble import zoocfg
from hpc_elastic.ensemble.files import Ensemble, Server
from hpc_elastic.errors import EnsembleError, HpcElasticError

log = logging.getLogger(__name__)

CONFIG_NODE = "/zookeeper/config"
"""Where ZooKeeper keeps its dynamic configuration; anyone may read it."""
SESSION_S = 10.0
RETRY_PAUSE_S = 1.0


def needed(members: dict[int, str], joiner: int, leaving: int) -> tuple[bool, bool]:
    """(add ``joiner``, remove ``leaving``): what a ``reconfig`` must still do, given the
    members of the last committed configuration (myid -> role). Both False: done, which is
    also how a reconfig that committed while its answer was lost is recognized."""
    return members.get(joiner) != zoocfg.PARTICIPANT, leaving in members


def replace_member(
    ensemble: Ensemble, joiner: Server, leaving: int, secret: str, timeout: float
) -> dict[int, str]:
    """Make ``joiner`` (synced, a non-voting follower) a participant and ``leaving`` no
    member, in one incremental ``reconfig``; returns the members it committed. Retried
    until ``timeout`` while ZooKeeper refuses for a passing reason (another reconfig in
    progress, the new configuration's quorum not yet synced, a lost connection)."""
    from hpc_elastic.rendezvous.zookeeper import (  # noqa: PLC0415 (kazoo: the supervisor only)
        DIGEST_USER,
        ZooKeeperAddress,
        open_client,
    )

    if DIGEST_USER != zoocfg.SUPERUSER:  # the trick above holds only while they agree
        raise EnsembleError(
            f"The rendezvous client authenticates as '{DIGEST_USER}', but the ensemble's "
            f"superuser is '{zoocfg.SUPERUSER}'; this is a bug of hpc-elastic, please report it."
        )
    hosts = [server.address for server in ensemble.servers if server.myid != leaving]
    address = ZooKeeperAddress.parse(",".join([*hosts, joiner.address]))
    deadline = time.monotonic() + timeout
    try:
        client = open_client(address, secret, SESSION_S, connect_timeout=timeout)
    except HpcElasticError as error:
        raise EnsembleError(
            f"No server of the ensemble at '{address}' answered the superuser within "
            f"{timeout:g} s, so server {joiner.myid} cannot take the place of server "
            f"{leaving}; check `hpc-elastic zk status`."
        ) from error
    last = "no answer"
    try:
        while True:
            try:
                members = _members(client)
                join, leave = needed(members, joiner.myid, leaving)
                if not join and not leave:
                    log.debug("reconfig done: members %s", members)
                    return members
                log.debug("reconfig: add %s, remove %s", join and joiner.myid, leave and leaving)
                client.reconfig(
                    joining=zoocfg.server_line(joiner) if join else None,
                    leaving=str(leaving) if leave else None,
                    new_members=None,
                )
                continue  # read the configuration back: it is the answer that counts
            except Exception as error:  # kazoo's errors, which this module does not import
                last = f"{type(error).__name__}: {error}".rstrip(": ")
                log.debug("reconfig refused: %s", last)
                if type(error).__name__ == "NoAuthError":
                    raise EnsembleError(
                        "ZooKeeper refused the superuser's reconfig (NoAuthError): the "
                        "servers do not know the secret in the run directory; stop the "
                        "ensemble with `hpc-elastic zk stop --force` and start it again."
                    ) from error
            if time.monotonic() >= deadline:
                raise EnsembleError(
                    f"ZooKeeper did not add server {joiner.myid} in the place of server "
                    f"{leaving} within {timeout:g} s (last: {last[:200]}); see the servers' "
                    "logs in the run directory and `hpc-elastic zk status`."
                )
            time.sleep(RETRY_PAUSE_S)
    finally:
        client.stop()
        client.close()


def _members(client: Any) -> dict[int, str]:
    """The last committed configuration, read after a ``sync`` so that the server answering
    is up to date with the leader (ZooKeeper's guide)."""
    client.sync(CONFIG_NODE)
    data, _stat = client.get(CONFIG_NODE)
    return zoocfg.dynamic_members(bytes(data).decode(errors="replace"))
