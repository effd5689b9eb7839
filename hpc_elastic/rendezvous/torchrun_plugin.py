"""``torchrun --rdzv-backend=zookeeper``: torch's RendezvousHandler on our ZooKeeper rendezvous.

Registered through the ``torchrun.handlers`` entry point. The only module in this package
besides ``hpc_elastic/train`` that imports torch. Each round, the rank-0 node hosts a fresh
TCPStore on the round's published master port; the workers share it
(``use_agent_store``), so a restarted worker group never reads a previous round's address.
Survivors restart as soon as a watch fires: ``num_nodes_waiting`` is just ``changed``.

Options (``--rdzv-conf key=value,...``): ``last_call_timeout`` and ``session_timeout`` in
seconds, ``join_timeout`` (seconds below MIN nodes before failing) and ``zk_auth_file``, or
``zk_open_acl=1`` to run without a secret on purpose (otherwise refused).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from hpc_elastic import errors
from hpc_elastic.rendezvous.api import NodeInfo, RendezvousSettings
from hpc_elastic.rendezvous.handler import StoreRendezvous
from hpc_elastic.rendezvous.secret import read_secret_file
from hpc_elastic.rendezvous.zookeeper import connect
from hpc_elastic.spec import NodeRange

STORE_TIMEOUT = timedelta(seconds=300)


class ZooKeeperRendezvousHandler(RendezvousHandler):
    """Adapts a StoreRendezvous to torch's handler protocol, converting errors both ways."""

    def __init__(self, rendezvous: StoreRendezvous) -> None:
        self._rendezvous = rendezvous
        self._store: TCPStore | None = None

    def get_backend(self) -> str:
        return "zookeeper"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        self._store = None
        try:
            round_ = self._rendezvous.next_round()
        except errors.RendezvousClosedError as error:
            # torch 2.13's launch_agent crashes on its own RendezvousGracefulExitError
            # (agent.run returns None), so a late agent leaves the way torchrun's
            # @record entry point treats as a clean exit.
            print(f"hpc-elastic: {error}", file=sys.stderr)
            raise SystemExit(0) from error
        except errors.HpcElasticError as error:
            raise RendezvousError(str(error)) from error
        rank = round_.group_rank(self._rendezvous.node.node_id)
        self._store = TCPStore(
            round_.master_addr,
            round_.master_port,
            is_master=rank == 0,
            timeout=STORE_TIMEOUT,
            wait_for_workers=False,
        )
        store: Store = PrefixStore(f"hpc-elastic/{round_.number}", self._store)
        return RendezvousInfo(
            store=store,
            rank=rank,
            world_size=len(round_.members),
            bootstrap_store_info=RendezvousStoreInfo(round_.master_addr, round_.master_port),
        )

    def is_closed(self) -> bool:
        document = self._rendezvous.document()
        return document is None or document.closed

    def set_closed(self) -> None:
        self._rendezvous.close()

    def num_nodes_waiting(self) -> int:
        """Torch's agent restarts its workers when this is positive; a watch sets it."""
        return 1 if self._rendezvous.changed.is_set() else 0

    def get_run_id(self) -> str:
        return self._rendezvous.settings.run_id

    def shutdown(self) -> bool:
        """Like torch's own handlers: the first agent to finish closes the job for all."""
        try:
            self._rendezvous.close()
            self._rendezvous.leave()
        except errors.HpcElasticError:
            return False
        return True


def create_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it with no arguments and registers
    what it returns as the factory of ``--rdzv-backend=zookeeper``."""
    return handler_for


def handler_for(params: RendezvousParameters) -> RendezvousHandler:
    try:
        settings = RendezvousSettings(
            run_id=params.run_id,
            nodes=NodeRange(params.min_nodes, params.max_nodes),
            last_call=float(params.get("last_call_timeout", 2.0)),
            session_timeout=float(params.get("session_timeout", 6.0)),
            min_wait=float(params.get("join_timeout", 600.0)),
        )
        auth_file = params.get("zk_auth_file")
        secret = read_secret_file(Path(auth_file)) if auth_file else None
        local_addr = params.local_addr or socket.getfqdn()
        node = NodeInfo(
            node_id=f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            host=local_addr,
            nproc=1,
        )
        open_acl = str(params.get("zk_open_acl", "0")).lower() in ("1", "true", "yes")
        rendezvous = connect(params.endpoint, settings, node, secret=secret, open_acl=open_acl)
    except errors.HpcElasticError as error:
        raise RendezvousError(str(error)) from error
    return ZooKeeperRendezvousHandler(rendezvous)
