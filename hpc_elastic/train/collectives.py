"""Mark a rank's collectives, so that a hang names the rank that stopped, not those waiting.

When one rank stops, every other rank soon waits for it in a collective, on every node, and
every agent sees its ranks make no progress. The agents tell the waiting ranks from the one
that stopped by the collective marker each rank keeps beside its heartbeat
(``heartbeat.CollectiveMarker``), and by their stacks when there is none
(docs/unattended.md, "Who hung"). The training helpers mark their own collectives
(``should_stop``, the checkpoint's); a script marks its own with either of::

    import hpc_elastic.train as elastic

    with elastic.collective("all_reduce"):
        dist.all_reduce(loss)

    elastic.watch_collectives()  # once, after init: every torch.distributed collective

A marked collective costs two small writes (``pwrite`` into a file opened once). Outside a job
(no heartbeat file) it costs nothing. Not marked: DDP's gradient all-reduce, which runs inside
``backward()`` in C++ (the agents read it from the stack: a rank in ``backward`` waits for its
peers), and collectives started with ``async_op=True`` (the wait comes later, in
``Work.wait``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hpc_elastic.protocol.heartbeat import CollectiveMarker

log = logging.getLogger(__name__)

MARKER = CollectiveMarker()
"""This process's marker; the heartbeat file it sits by is read from the environment at the
first collective."""

WATCHED = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)
"""The blocking collectives (and point-to-point calls) of ``torch.distributed`` that
``watch_collectives`` marks."""

_WRAPPED = "__hpc_elastic_marked__"


@contextmanager
def collective(op: str) -> Iterator[None]:
    """Mark the ``with`` block as this rank waiting in collective ``op`` (a name for people:
    "all_reduce", "broadcast of the checkpoint path", ...; letters, digits and ``_.:-`` are
    kept)."""
    with MARKER.marked(op):
        yield


def watch_collectives() -> None:
    """Mark every blocking ``torch.distributed`` collective this process calls from now on
    through the module (``dist.all_reduce(...)``), for scripts that call them directly.
    Calling it twice changes nothing."""
    import torch.distributed as dist  # noqa: PLC0415 (torch only when asked)

    for name in WATCHED:
        function = getattr(dist, name, None)
        if function is None or getattr(function, _WRAPPED, False):
            continue
        setattr(dist, name, _marking(name, function))
    log.debug("collectives of torch.distributed are marked")


def _marking(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def marked(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op"):
            return function(*args, **kwargs)  # it returns at once; the wait is not here
        with MARKER.marked(name):
            return function(*args, **kwargs)

    setattr(marked, _WRAPPED, True)
    return marked
