"""Checkpoints that a crash cannot corrupt and a requeue cannot confuse.

A checkpoint is a directory ``step-00000020/`` holding ``state.pt`` and ``manifest.json``
(file sizes). It is written under a hidden temporary name, fsynced, and renamed into place,
so a committed name always holds a complete checkpoint. Loading picks the highest step whose
sizes and checksums match and falls back, with a warning, past corrupt ones.

For replicated (DDP) models rank 0 writes one file holding the model once and every rank's
RNG state. Sharded models go through ``hpc_elastic.train.sharded`` instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hpc_elastic import events
from hpc_elastic.errors import CheckpointError
from hpc_elastic.train import _dist, rng
from hpc_elastic.train.sampler import ElasticSampler

CHECKPOINT_DIR_ENV = "HPC_ELASTIC_CHECKPOINT_DIR"
FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
_COMMITTED = re.compile(r"^step-(\d{8,})$")

log = logging.getLogger(__name__)


def default_directory() -> Path:
    """The agent's job directory survives a requeue; without an agent, ./checkpoints does too."""
    configured = os.environ.get(CHECKPOINT_DIR_ENV)
    return Path(configured) if configured else Path.cwd() / "checkpoints"


class TrainState:
    """Everything a training loop must get back after a restart to continue as if nothing happened.

    ``step`` counts optimizer steps; ``epoch`` lives in the sampler when there is one, so the
    two can never disagree. ``extras`` holds the user's own values (tensors, numbers, strings,
    and lists or dicts of them).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optimizer | None = None,
        scheduler: LRScheduler | None = None,
        sampler: ElasticSampler | None = None,
        extras: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.extras: dict[str, Any] = extras if extras is not None else {}
        self.step = 0
        self._epoch = 0

    @property
    def epoch(self) -> int:
        return self.sampler.epoch if self.sampler is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(value)
        self._epoch = value

    def finish_step(self) -> None:
        """Count one optimizer step, and the samples it consumed."""
        self.step += 1
        if self.sampler is not None:
            self.sampler.advance()

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "model": _unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "sampler": self.sampler.state_dict() if self.sampler else None,
            "extras": self.extras,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _unwrap(self.model).load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self._epoch = state["epoch"]
        if self.sampler is not None and state["sampler"] is not None:
            self.sampler.load_state_dict(state["sampler"])
        self.extras.update(state["extras"])


@dataclass(frozen=True)
class Checkpointer:
    """Saves and loads ``TrainState`` in one directory, keeping the newest ``keep`` checkpoints.

    ``save`` and ``load`` are collectives: call them on every rank at the same step.
    """

    directory: Path
    keep: int = 3

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise CheckpointError(
                f"keep={self.keep} would delete every checkpoint; keep at least 1."
            )

    @classmethod
    def at(cls, directory: Path | str | None = None, keep: int = 3) -> Checkpointer:
        """A checkpointer for ``directory``, or for the job's default directory."""
        return cls(Path(directory) if directory is not None else default_directory(), keep)

    def committed(self) -> list[Path]:
        """Committed checkpoints, newest (highest step) first."""
        try:
            names = [entry.name for entry in self.directory.iterdir()]
        except FileNotFoundError:
            return []
        steps = sorted(
            (int(match.group(1)) for name in names if (match := _COMMITTED.match(name))),
            reverse=True,
        )
        return [self.directory / _name(step) for step in steps]

    def save(self, state: TrainState) -> Path:
        """Write ``state`` from rank 0 and return once it is committed, on every rank."""
        payload = {
            "format": FORMAT_VERSION,
            "world_size": _dist.world_size(),
            "rng": _dist.gather_to_all(rng.capture()),
            **state.state_dict(),
        }
        outcome: Path | str = self.directory / _name(state.step)
        if _dist.rank() == 0:
            try:
                self._write(payload, state.step)
            except (OSError, RuntimeError) as error:
                outcome = (
                    f"Could not write checkpoint step {state.step} to '{self.directory}' "
                    f"({error}); check the directory's space and permissions."
                )
            else:
                events.emit("checkpoint", step=state.step, path=str(outcome))
        outcome = _dist.broadcast_from_rank0(outcome)
        if isinstance(outcome, str):
            raise CheckpointError(outcome)
        return outcome

    def load(self, state: TrainState) -> Path | None:
        """Restore the newest intact checkpoint into ``state``; None when there is none yet."""
        chosen = _dist.broadcast_from_rank0(self.newest_intact() if _dist.rank() == 0 else None)
        if isinstance(chosen, str):
            raise CheckpointError(chosen)
        if chosen is None:
            return None
        payload = _read(chosen / STATE_FILE)
        state.load_state_dict(payload)
        saved_rng = payload["rng"]
        rng.restore(saved_rng[_dist.rank() % len(saved_rng)])
        return chosen

    def _write(self, payload: dict[str, Any], step: int) -> Path:
        staging = self.prepare_staging(step)
        path = staging / STATE_FILE
        try:
            torch.save(payload, path)
            _fsync_file(path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # a full disk must not stay full of it
            raise
        files = {STATE_FILE: {"size": path.stat().st_size, "zip_crc32": True}}
        return self.commit(staging, step, payload["world_size"], files)

    def prepare_staging(self, step: int) -> Path:
        """A fresh hidden directory to write ``step`` into; removes half-written leftovers."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(".step-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        staging = self.directory / f".{_name(step)}.tmp-{os.getpid()}"
        staging.mkdir()
        return staging

    def commit(
        self, staging: Path, step: int, world_size: int, files: dict[str, dict[str, int]]
    ) -> Path:
        """Seal ``staging`` with its manifest and rename it into place; then drop the oldest."""
        manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size}
        _write_synced(staging / MANIFEST_FILE, json.dumps({**manifest, "files": files}).encode())
        _fsync_directory(staging)
        final = self.directory / _name(step)
        if final.exists():
            replaced = final.rename(self.directory / f".{_name(step)}.old-{os.getpid()}")
            staging.rename(final)
            shutil.rmtree(replaced)
        else:
            staging.rename(final)
        _fsync_directory(self.directory)
        for old in self.committed()[self.keep :]:
            shutil.rmtree(old)
        return final

    def newest_intact(self) -> Path | str | None:
        """Rank 0's choice: a path, None for a fresh start, or why nothing can be trusted."""
        candidates = self.committed()
        for candidate in candidates:
            problem = verify(candidate)
            if problem is None:
                return candidate
            log.warning(
                "Checkpoint '%s' is unusable (%s); falling back to the previous one.",
                candidate,
                problem,
            )
        if candidates:
            return (
                f"No intact checkpoint in '{self.directory}' ({len(candidates)} corrupt); move "
                f"them aside to start from scratch."
            )
        return None


def save(state: TrainState, directory: Path | str | None = None, keep: int = 3) -> Path:
    """Save ``state`` as the newest checkpoint in ``directory`` (default: the job's)."""
    return Checkpointer.at(directory, keep).save(state)


def load(state: TrainState, directory: Path | str | None = None) -> Path | None:
    """Resume ``state`` from the newest intact checkpoint; None when there is none yet."""
    return Checkpointer.at(directory).load(state)


def verify(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be trusted, or None when every file is whole and intact.

    Sizes catch truncation; for ``torch.save`` files the CRC-32 that torch already stores for
    every record in the zip catches corruption, so saving pays for no checksum of its own.
    """
    try:
        manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
        if manifest.get("format") != FORMAT_VERSION:
            return f"format {manifest.get('format')!r} is not {FORMAT_VERSION}"
        for name, expected in manifest["files"].items():
            size = (checkpoint / name).stat().st_size
            if size != expected["size"]:
                return f"{name} truncated: {size} of {expected['size']} bytes"
            if expected.get("zip_crc32"):
                with zipfile.ZipFile(checkpoint / name) as archive:
                    if (bad := archive.testzip()) is not None:
                        return f"{name} record '{bad}' fails its CRC-32"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile) as error:
        return f"unreadable: {error}"
    return None


def _read(path: Path) -> dict[str, Any]:
    """Memory-maps the file: rank 0's checksum pass just read it, so this costs no second read."""
    try:
        payload: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError) as error:
        raise CheckpointError(
            f"Checkpoint '{path}' passed its checksum but does not load ({error}); "
            f"move it aside to resume from the previous one."
        ) from error
    return payload


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """DDP's ``module.`` prefix stays out of the file, so it loads into a bare model too."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _name(step: int) -> str:
    return f"step-{step:08d}"


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
