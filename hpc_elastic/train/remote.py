"""Checkpoints in object storage (``s3://bucket/prefix``): the manifest is the commit.

An object store has no rename and no lock, so the local scheme (write hidden, rename into
place) becomes: write ``step-N/state.pt``, then ``step-N/manifest.json`` last. A checkpoint
counts as committed only once its manifest exists, and is trusted only when its sizes and
its zip CRC-32s match the manifest, so a writer killed mid-upload leaves a prefix without a
manifest, which no reader trusts and the next save removes. Saving a step again writes a
higher version (``step-N.1``) whose manifest commits it before the older copy is deleted.

What the object store cannot give: readers cannot hold a checkpoint against retention (no
``flock``), and the round fence is checked just before the manifest is written rather than
under a lock, so a stale round that passes the check in the same instant as a newer round
claims the prefix could still commit once. The lease check, which runs just before the
manifest too, is what stops a stale worker there.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from hpc_elastic.errors import CheckpointError
from hpc_elastic.train import _integrity, lease
from hpc_elastic.train.checkpoint import (
    _ROUND_MARK,
    FORMAT_VERSION,
    MANIFEST_FILE,
    STATE_FILE,
    Checkpointer,
    TrainState,
    _name,
    _parse_committed,
    _step_and_version,
    verify_files,
)
from hpc_elastic.train.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectCheckpointer(Checkpointer):
    """A ``Checkpointer`` whose directory is an object-storage URL; same API, same settings."""

    url: str = ""

    @classmethod
    def for_url(cls, url: str, **settings: Any) -> ObjectCheckpointer:
        store = ObjectStore(url)
        return cls(Path(store.root), url=url, **settings)

    @cached_property
    def store(self) -> ObjectStore:
        return ObjectStore(self.url)

    @property
    def where(self) -> str:
        return self.url

    @property
    def tier(self) -> str:
        return "remote"

    def committed(self) -> list[Path]:
        """Checkpoints whose manifest exists, newest first."""
        names = [name for name in self.store.names() if _parse_committed(name)]
        paths = [
            self.directory / name
            for name in names
            if self.store.exists(self.store.key(name, MANIFEST_FILE))
        ]
        return sorted(paths, key=_step_and_version, reverse=True)

    def choose(self) -> str | None:
        if self.fencing_round is not None:
            self._claim_round("load a checkpoint")
        return self.newest_or_raise()

    def prepare_staging(self, step: int) -> Path:
        raise CheckpointError(
            f"Sharded checkpoints cannot go to object storage yet ('{self.url}'); give "
            f"save_sharded a shared filesystem directory."
        )

    def _write_payload(self, payload: dict[str, Any], step: int) -> Path:
        """Upload the state, then the manifest (the commit), then drop what it replaces."""
        doing = f"commit step {step}"
        self._claim_round(doing)
        previous = self._versions(step)
        version = max((_step_and_version(path)[1] for path in previous), default=-1) + 1
        name = _name(step) if not previous else f"{_name(step)}.{version}"
        self._remove_uncommitted()
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = buffer.getvalue()
        self.store.put(self.store.key(name, STATE_FILE), data)
        manifest = {"format": FORMAT_VERSION, "step": step, "world_size": payload["world_size"]}
        manifest.update(
            round=self.fencing_round, files={STATE_FILE: {"size": len(data), "zip_crc32": True}}
        )
        manifest = _integrity.seal_manifest(manifest, _integrity.keys())
        lease.check(force=True)
        self._refuse_if_stale(doing)
        self.store.put(self.store.key(name, MANIFEST_FILE), json.dumps(manifest).encode())
        log.debug("committed step %d as %s/%s (round %s)", step, self.url, name, self.fencing_round)
        for old in previous:
            self.store.remove(self.store.key(old.name))
        for old in self._beyond_keep():
            self._remove_old(old)
        return self.directory / name

    def _remove_uncommitted(self) -> None:
        """Prefixes a killed writer left without a manifest: nobody trusts them; drop them."""
        committed = {path.name for path in self.committed()}
        for name in self.store.names():
            if _parse_committed(name) and name not in committed:
                log.debug("removing uncommitted %s/%s", self.url, name)
                self.store.remove(self.store.key(name))

    def _verify(self, checkpoint: Path) -> str | None:
        """As ``verify``: the manifest's format, seal and step, every object's size, the
        zip's CRC-32s."""
        key = self.store.key
        return verify_files(
            lambda: self.store.get(key(checkpoint.name, MANIFEST_FILE)),
            lambda name: self.store.size(key(checkpoint.name, name)),
            lambda name: io.BytesIO(self.store.get(key(checkpoint.name, name))),
            step=_step_and_version(checkpoint)[0],
        )

    def _load_payload(self, path: Path, state: TrainState) -> dict[str, Any]:
        key = self.store.key(path.name, STATE_FILE)
        try:
            data = self.store.get(key)
            payload: dict[str, Any] = torch.load(
                io.BytesIO(data), map_location="cpu", weights_only=True
            )
        except (OSError, RuntimeError, ValueError) as error:
            raise CheckpointError(
                f"Checkpoint '{self.url}/{path.name}' passed its checksum but does not load "
                f"({error}); delete it to resume from the previous one."
            ) from error
        state.load_state_dict(payload)
        return payload

    def _remove_old(self, checkpoint: Path) -> None:
        log.debug("removing %s/%s (beyond the retention policy)", self.url, checkpoint.name)
        self.store.remove(self.store.key(checkpoint.name))

    def _marks(self) -> list[tuple[str, int]]:
        return [
            (match.group(1), int(match.group(2)))
            for name in self.store.names()
            if (match := _ROUND_MARK.match(name))
        ]

    def _add_mark(self, name: str) -> None:
        self.store.put(self.store.key(name), b"")

    def _drop_mark(self, name: str) -> None:
        self.store.remove(self.store.key(name))
