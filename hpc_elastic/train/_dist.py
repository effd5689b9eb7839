"""The few facts about the default process group that every training helper needs.

Everything works without a process group too: a plain script is rank 0 of a world of one.

Small values (checkpoint paths, outcomes, RNG states) travel between ranks as JSON inside a
byte tensor, never as a pickle: torch's object collectives unpickle whatever rank 0 sends, and
rank 0 is whoever answers at ``MASTER_ADDR``, so a forged master address would run code on
every node. ``encode``/``decode`` know a closed set of types; anything else is refused.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from hpc_elastic.errors import CheckpointError
from hpc_elastic.train.collectives import collective

T = TypeVar("T")
_log = logging.getLogger(__name__)

_TENSOR_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.bool,
    )
}
"""Tensor element types a value may carry; the name travels, the type is looked up here."""


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def collective_device() -> torch.device:
    """NCCL only reduces CUDA tensors; gloo and the rest reduce CPU ones."""
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if active():
        with collective("barrier"):
            dist.barrier()


def broadcast_from_rank0(value: T) -> T:
    """Rank 0's value on every rank, so all ranks act on one decision."""
    if not active():
        return value
    device = collective_device()
    payload = encode(value) if rank() == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    with collective("broadcast"):
        dist.broadcast(size, src=0)
        data = _as_tensor(payload, int(size.item()), device)
        dist.broadcast(data, src=0)
    return decode(_as_bytes(data, int(size.item())))  # type: ignore[no-any-return]


def broadcast_bytes(data: bytes | None, source: int) -> bytes:
    """``source``'s raw bytes on every rank, as a uint8 tensor: nothing received is unpickled
    (``broadcast_object_list`` would run whatever a forged peer sent)."""
    if not active():
        assert data is not None
        return data
    device = collective_device()
    payload = data if rank() == source and data is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    with collective("broadcast"):
        dist.broadcast(size, src=source)
        tensor = _as_tensor(payload, int(size.item()), device)
        dist.broadcast(tensor, src=source)
    return _as_bytes(tensor, int(size.item()))


def exchange_bytes(
    data: bytes | None, to: int | None, source: int | None, group: dist.ProcessGroup | None
) -> bytes | None:
    """Send ``data`` to rank ``to`` and receive from rank ``source`` at the same time (either
    may be None); return what was received. CPU tensors: ``group`` must be a gloo group.

    Both directions are posted before either is waited on, so a ring in which every rank
    sends to its successor and receives from its predecessor cannot deadlock. Raw bytes
    only: nothing received is unpickled.
    """
    sending = data if data is not None else b""
    pending: list[dist.Work | None] = []
    size_in = torch.zeros(1, dtype=torch.int64)
    if to is not None:
        pending.append(dist.isend(torch.tensor([len(sending)], dtype=torch.int64), to, group))
    if source is not None:
        pending.append(dist.irecv(size_in, source, group))
    _wait_all(pending)
    pending = []
    buffer = torch.zeros(int(size_in.item()), dtype=torch.uint8)
    if to is not None and sending:
        outgoing = torch.frombuffer(bytearray(sending), dtype=torch.uint8)
        pending.append(dist.isend(outgoing, to, group))
    if source is not None and buffer.numel():
        pending.append(dist.irecv(buffer, source, group))
    _wait_all(pending)
    return _as_bytes(buffer, buffer.numel()) if source is not None else None


def _wait_all(pending: list[dist.Work | None]) -> None:
    with collective("exchange"):
        for request in pending:
            if request is not None:  # None: this process is not in the group
                request.wait()


def gather_to_all(value: T) -> list[T]:
    """Every rank's value, indexed by rank."""
    if not active():
        return [value]
    device = collective_device()
    payload = encode(value)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size())]
    with collective("all_gather"):
        dist.all_gather(sizes, size)
        longest = max(int(each.item()) for each in sizes)
        # all_gather wants tensors of one shape: pad every payload to the longest, then trim.
        gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in sizes]
        dist.all_gather(gathered, _as_tensor(payload, longest, device))
    return [
        decode(_as_bytes(data, int(each.item())))
        for data, each in zip(gathered, sizes, strict=True)
    ]


def _as_tensor(payload: bytes, length: int, device: torch.device) -> torch.Tensor:
    buffer = torch.zeros(length, dtype=torch.uint8)
    if payload:
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buffer.to(device)


def _as_bytes(data: torch.Tensor, length: int) -> bytes:
    return bytes(data[:length].cpu().numpy().tobytes())


def encode(value: object) -> bytes:
    """``value`` as JSON bytes; None, bool, int, float, str, Path, tuple, list, dict and tensor."""
    return json.dumps(_tagged(value), separators=(",", ":")).encode()


def decode(payload: bytes) -> Any:
    """The value ``encode`` made; anything else is a CheckpointError, never code."""
    try:
        return _untagged(json.loads(payload))
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, RuntimeError) as error:
        _log.debug("refusing a value from another rank: %s", error)
        raise CheckpointError(
            f"Another rank sent a value that is not one hpc-elastic encodes ({error!r:.200}); "
            "check that every rank runs the same hpc-elastic and that MASTER_ADDR is the job's."
        ) from error


def _tagged(value: object) -> object:
    """A JSON tree of ``[tag, ...]`` lists, so a tuple stays a tuple and a str key a str key."""
    if value is None or isinstance(value, bool | int | float | str):
        return ["v", value]
    if isinstance(value, Path):
        return ["path", str(value)]
    if isinstance(value, tuple | list):
        return ["tuple" if isinstance(value, tuple) else "list", [_tagged(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[_tagged(k), _tagged(v)] for k, v in value.items()]]
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
        name = str(value.dtype).removeprefix("torch.")
        data = base64.b64encode(raw.numpy().tobytes()).decode()
        return ["tensor", name, list(value.shape), data]
    raise TypeError(f"cannot send a {type(value).__name__} between ranks")


def _untagged(node: Any) -> Any:
    tag = node[0]
    if tag == "v":
        value = node[1]
        if value is None or isinstance(value, bool | int | float | str):
            return value
    elif tag == "path":
        return Path(str(node[1]))
    elif tag in ("tuple", "list"):
        items = [_untagged(item) for item in node[1]]
        return tuple(items) if tag == "tuple" else items
    elif tag == "dict":
        return {_untagged(key): _untagged(value) for key, value in node[1]}
    elif tag == "tensor":
        return _tensor(node[1], node[2], node[3])
    raise ValueError(f"unknown value tag {tag!r:.40}")


def _tensor(name: str, shape: list[int], data: str) -> torch.Tensor:
    dtype = _TENSOR_DTYPES[name]
    raw = bytearray(base64.b64decode(data, validate=True))
    if not raw:
        return torch.zeros(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.frombuffer(raw, dtype=torch.uint8).to(torch.bool).reshape(shape)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()
