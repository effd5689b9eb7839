"""Checkpoints that a crash cannot corrupt and a requeue cannot confuse.

A checkpoint is a directory ``step-00000020/`` holding ``state.pt`` and ``manifest.json``
(file sizes). It is written under a hidden temporary name, fsynced, and renamed into place,
so a committed name always holds a complete checkpoint. Loading picks the highest step whose
sizes and checksums match and falls back, with a warning, past corrupt ones. That commit
protocol (staging, the round marks that fence a replaced writer, the manifest, the rename,
verifying, retention) is ``hpc_elastic.train.commit``'s; this module is the save and load API
on top of it.

For replicated (DDP) models rank 0 writes one file holding the model once and every rank's
RNG state. Sharded models go through ``hpc_elastic.train.sharded`` instead. In object storage
(``s3://...``, ``ObjectCheckpointer`` at the end of this module) the manifest, written last,
is the commit.

With ``asynchronous=True`` a save only copies the state into host memory on the training
thread; serialising, fsyncing and the same fenced commit run behind the loop (see
``hpc_elastic.train.background``).
"""

from __future__ import annotations

import copy
import io
import logging
import os
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from hpc_elastic import contract, events
from hpc_elastic.errors import CheckpointError, CheckpointFencedError, UsageError
from hpc_elastic.protocol import lease
from hpc_elastic.train import (
    _dist,
    background,
    local_tier,
    preemption,
    rng,
    storage,
)
from hpc_elastic.train.commit import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    STATE_FILE,
    Commits,
    ObjectCommits,
    checkpoint_name,
    fenced,
    may_remove,
    reading,
    remove_unless_read,
    retained,
    step_and_version,
    verify,
    verify_files,
    write_synced,
)
from hpc_elastic.train.data import TrainingData
from hpc_elastic.train.sampler import ElasticSampler

CHECKPOINT_DIR_ENV = contract.CHECKPOINT_DIR_ENV
ROUND_ENV = contract.ROUND_ENV
JOB_ENV = "TORCHELASTIC_RUN_ID"
ASYNC_ENV = contract.CHECKPOINT_ASYNC_ENV
WHEN_BUSY_ENV = contract.CHECKPOINT_WHEN_BUSY_ENV
KEEP_ENV = contract.CHECKPOINT_KEEP_ENV
KEEP_EVERY_ENV = contract.CHECKPOINT_KEEP_EVERY_ENV
WHEN_BUSY_CHOICES = contract.CHECKPOINT_WHEN_BUSY_CHOICES
DEFAULT_KEEP = contract.DEFAULT_CHECKPOINT_KEEP
WRITERS = ("thread", "process")
LOCAL_WORLD_ENV = "LOCAL_WORLD_SIZE"
"""torchrun's (and the agent's) count of ranks on this node."""

log = logging.getLogger(__name__)

__all__ = [  # with the commit protocol's names that callers import from here (commit.py)
    "ASYNC_ENV",
    "CHECKPOINT_DIR_ENV",
    "DEFAULT_KEEP",
    "FORMAT_VERSION",
    "JOB_ENV",
    "KEEP_ENV",
    "KEEP_EVERY_ENV",
    "LOCAL_WORLD_ENV",
    "MANIFEST_FILE",
    "ROUND_ENV",
    "STATE_FILE",
    "WHEN_BUSY_CHOICES",
    "WHEN_BUSY_ENV",
    "WRITERS",
    "Checkpointer",
    "ObjectCheckpointer",
    "TrainState",
    "default_directory",
    "emit_loaded",
    "everyone",
    "fenced",
    "load",
    "may_remove",
    "on_rank0",
    "reading",
    "remove_unless_read",
    "retained",
    "round_from_environment",
    "save",
    "skips_while_busy",
    "snapshot",
    "verify",
    "verify_files",
]


def default_directory() -> Path:
    """The agent's job directory survives a requeue; without an agent, ./checkpoints does too."""
    configured = os.environ.get(CHECKPOINT_DIR_ENV)
    return Path(configured) if configured else Path.cwd() / contract.CHECKPOINTS_DIR


class TrainState:
    """Everything a training loop must get back after a restart to continue as if nothing happened.

    ``step`` counts optimizer steps; ``epoch`` lives in the sampler (or the ``ElasticShards``)
    when there is one, so the two can never disagree. ``extras`` holds the user's own values
    (tensors, numbers, strings, and lists or dicts of them). ``loader``: a loader whose
    position is kept too, at any world size (``hpc_elastic.train.data``): one with an
    ``ElasticSampler`` (then ``sampler`` may be left out), one over ``ElasticShards``, or a
    stateful one (torchdata's ``StatefulDataLoader``, whose state, workers included, is saved).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optimizer | None = None,
        scheduler: LRScheduler | None = None,
        sampler: ElasticSampler | None = None,
        extras: dict[str, Any] | None = None,
        *,
        loader: Any = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = TrainingData(loader)
        self.sampler = sampler if sampler is not None else self.data.sampler
        self.extras: dict[str, Any] = extras if extras is not None else {}
        self.step = 0
        self._epoch = 0

    @property
    def epoch(self) -> int:
        if self.sampler is not None:
            return self.sampler.epoch
        return self.data.epoch if self.data.epoch is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self.sampler is not None:
            self.sampler.set_epoch(value)
        self.data.set_epoch(value)
        self._epoch = value

    def finish_step(self) -> None:
        """Count one optimizer step, and the samples it consumed."""
        self.step += 1
        self.data.finish_step(self.step, self.sampler)

    def log_samples(self, ids: Any) -> None:
        """Note ids of samples this step trains on, for the sample log (``hpc-elastic events
        JOB --data``); does nothing unless ``$HPC_ELASTIC_SAMPLE_LOG`` asks for the log."""
        self.data.log_samples(ids)

    def collect(self) -> None:
        """Collective, before a save: gather what each rank alone knows (its loader's state)."""
        self.data.collect()

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "model": _unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "sampler": self.sampler.state_dict() if self.sampler else None,
            "extras": self.extras,
            "data": self.data.state_dict(),
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
        self.data.load_state_dict(state.get("data"))  # None in checkpoints from before it
        self.extras.update(state["extras"])


def _env_text(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _env_count(name: str, default: int) -> int:
    """A whole number from the agent's environment; a bad one is a usage error, not a crash."""
    value = os.environ.get(name)
    if not value:
        return default
    if not value.isdigit():
        raise UsageError(f"{name}={value!r} is not a whole number; set it to one such as 3.")
    return int(value)


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise UsageError(f"{name}={value!r} is not a yes or no; set it to 1 or 0.")


def round_from_environment() -> int | None:
    """The agent's rendezvous round for this worker, or None outside the agent."""
    value = os.environ.get(ROUND_ENV)
    if not value:
        return None
    if not value.isdigit():
        raise UsageError(
            f"{ROUND_ENV}={value!r} is not a round number; unset it outside the hpc-elastic agent."
        )
    return int(value)


@dataclass(frozen=True)
class Checkpointer:
    """Saves and loads ``TrainState`` in one directory, keeping the newest ``keep`` checkpoints.

    ``save``, ``load`` and ``wait`` are collectives: call them on every rank at the same step.
    ``round`` is the agent's rendezvous round (``$HPC_ELASTIC_ROUND``): a writer whose round is
    older than the newest one that began writing in the directory is refused (fencing). Without
    a round (plain torchrun) nothing is fenced.

    ``keep_every=K`` also keeps every checkpoint whose step is a multiple of K. With
    ``asynchronous=True`` a save returns once the state is copied to host memory and commits
    behind the loop; ``when_busy`` says what a save does while the previous one still commits:
    ``"wait"`` for it, or ``"skip"`` this one (with a ``checkpoint_skipped`` event). Every
    setting defaults to the agent's environment (``$HPC_ELASTIC_CHECKPOINT_*``).

    Why some thirty methods: a save and a load each take one of four paths (synchronous or
    asynchronous, with or without the node-local tier), each made of a few small steps, and
    five methods are one-line doors to the commit protocol (``commit.Commits``: staging,
    fencing, the manifest and rename, verifying, retention), kept under the names the sharded
    savers and other callers use. The protocol itself lives in ``commit.py``.
    """

    directory: Path
    keep: int = field(default_factory=lambda: _env_count(KEEP_ENV, DEFAULT_KEEP))
    round: int | None = field(default_factory=round_from_environment)
    job: str = field(default_factory=lambda: os.environ.get(JOB_ENV, ""))
    """Rounds count from 1 again in a new job that resumes from this directory, so a round
    is only compared with rounds of the same job (``$TORCHELASTIC_RUN_ID``)."""
    keep_every: int = field(default_factory=lambda: _env_count(KEEP_EVERY_ENV, 0))
    asynchronous: bool = field(default_factory=lambda: _env_flag(ASYNC_ENV))
    when_busy: str = field(default_factory=lambda: _env_text(WHEN_BUSY_ENV, "wait"))
    local_directory: Path | None = field(
        default_factory=lambda: _env_path(local_tier.LOCAL_DIR_ENV)
    )
    """Node-local tier (see ``hpc_elastic.train.local_tier``); None: no local tier."""
    persist_every: int = field(default_factory=lambda: _env_count(local_tier.PERSIST_EVERY_ENV, 1))
    """With a local tier, write the shared tier at every ``persist_every``-th save only."""
    writer: str = "thread"
    """Who serialises an asynchronous save: ``"thread"``, or ``"process"`` (opt-in: a worker
    process fed from shared memory, see ``hpc_elastic.train.writer_process``)."""
    ranks_per_node: int = field(default_factory=lambda: _env_count(LOCAL_WORLD_ENV, 1))
    """Sharded local tier: a rank's peer copy goes to the same local rank on the next node
    (torchrun's ``$LOCAL_WORLD_SIZE``); tests that stand ranks for nodes set 1."""
    private_root: Path | None = None
    """Set on the node-local tier's own checkpointers (``_local``): ``directory`` lies under
    this root (``local_directory``), which must be ours and writable by no one else, every
    directory from it down is ours, 0700 and no link, and every file is 0600
    (``local_tier.private_tree``). Node-local disks (/tmp, NVMe) are shared by every user of
    the node: a root another user made first, holding a forged newest step, is refused."""
    _saves: list[int] = field(default_factory=lambda: [0], init=False, repr=False, compare=False)
    _built_in_round: int | None = field(
        default_factory=round_from_environment, init=False, repr=False, compare=False
    )
    """The agent's round when this checkpointer was built, to see that ``InPlace`` moved the
    process into another one since (``fencing_round``)."""

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise CheckpointError(
                f"keep={self.keep} would delete every checkpoint; keep at least 1."
            )
        if self.keep_every < 0:
            raise CheckpointError(
                f"keep_every={self.keep_every} is negative; use 0 to keep no extra steps."
            )
        if self.persist_every < 1:
            raise CheckpointError(
                f"persist_every={self.persist_every} would never write the shared tier; use "
                f"1 or more."
            )
        if self.writer not in WRITERS or (self.writer == "process" and not self.asynchronous):
            raise CheckpointError(
                f"writer={self.writer!r} is not one of {', '.join(WRITERS)} for "
                f"{'asynchronous' if self.asynchronous else 'synchronous'} saves; use "
                f"'thread', or 'process' with asynchronous=True."
            )
        if self.when_busy not in WHEN_BUSY_CHOICES:
            raise CheckpointError(
                f"when_busy={self.when_busy!r} is not one of {', '.join(WHEN_BUSY_CHOICES)}; "
                f"choose 'wait' to wait for the commit in flight or 'skip' to skip the save."
            )

    @property
    def fencing_round(self) -> int | None:
        """The round this worker's commits carry and are fenced by: ``round``, unless
        ``InPlace`` has since moved this very process into another round (it changes
        ``$HPC_ELASTIC_ROUND`` under the running loop). Then the new round's number: a
        checkpointer built before an in-place change must neither be refused as an older
        round's writer nor stamp the new round's checkpoints with the old number, and the loop
        should not have to rebuild it. Rank and world size need no such care: every collective
        here asks the current process group. ``round=None`` (no fencing) stays None."""
        if self.round is None:
            return None
        now = round_from_environment()
        if now is not None and now != self._built_in_round:
            return now
        return self.round

    @classmethod
    def at(cls, directory: Path | str | None = None, keep: int | None = None) -> Checkpointer:
        """A checkpointer for ``directory`` (a path or an fsspec URL such as
        ``s3://bucket/prefix``), or for the job's default directory."""
        location = directory if directory is not None else os.environ.get(CHECKPOINT_DIR_ENV)
        settings = {} if keep is None else {"keep": keep}
        if location is not None and storage.is_url(location):
            return ObjectCheckpointer.for_url(str(location), **settings)
        chosen = Path(location) if location is not None else default_directory()
        return cls(chosen) if keep is None else cls(chosen, keep=keep)

    @property
    def where(self) -> str:
        """The location as users wrote it, for messages."""
        return str(self.directory)

    @property
    def tier(self) -> str:
        """This location's name in ``checkpoint_loaded`` events (object storage: remote)."""
        return "shared"

    @property
    def _commits(self) -> Commits:
        """This location's commit protocol (``hpc_elastic.train.commit``). It asks
        ``fencing_round`` at every use, since ``InPlace`` may change it under the loop."""
        return Commits(
            self.directory,
            lambda: self.fencing_round,
            job=self.job,
            keep=self.keep,
            keep_every=self.keep_every,
            private_root=self.private_root,
        )

    def committed(self) -> list[Path]:
        """Committed checkpoints, newest (highest step, then latest re-save) first."""
        return self._commits.committed()

    def save(self, state: TrainState) -> Path | None:
        """Write ``state`` from rank 0; return its checkpoint's path on every rank.

        Synchronous: returns once it is committed. Asynchronous: returns once the state is
        copied, with the path it will be committed as (``wait()`` waits for that), or None
        when ``when_busy="skip"`` skipped it.
        """
        lease.check()
        if self.asynchronous:
            return self._save_in_background(state)
        background.drain_if_used()
        state.collect()
        saved_rng = _dist.gather_to_all(rng.capture())
        if self.local_directory is not None and not self._save_locally(state, saved_rng):
            return self._local().directory / checkpoint_name(state.step)
        with preemption.saving():
            written = on_rank0(
                lambda: str(self._write(state, saved_rng)),
                f"write checkpoint step {state.step} to '{self.where}'",
            )
        if _dist.rank() == 0:
            events.emit(events.Kind.CHECKPOINT, step=state.step, path=written)
        return Path(str(written))

    def wait(self) -> None:
        """Collective: wait for the commit in flight; raise its error on every rank.

        The loop cannot beat meanwhile, so the heartbeat says "checkpoint" as during a save.
        """
        with preemption.saving():
            background.drain()

    def _local(self) -> Checkpointer:
        """This rank's node-local tier: one writer (this rank), so no round to fence."""
        assert self.local_directory is not None
        directory = local_tier.rank_directory(self.local_directory)
        return Checkpointer(
            directory,
            keep=local_tier.LOCAL_KEEP,
            round=None,
            local_directory=None,
            private_root=self.local_directory,
        )

    def _persisting(self) -> bool:
        """Count this save (every rank counts alike); True when it goes to the shared tier."""
        self._saves[0] += 1
        return local_tier.persists(self._saves[0], self.persist_every)

    def _save_locally(self, state: TrainState, saved_rng: list[dict[str, Any]]) -> bool:
        """Every rank commits to its local tier; True when the shared tier is due as well
        (and not deferred: ``_local_first``)."""
        persist = self._persisting()
        defer = persist and self._local_first(state.step)
        local = self._local()
        with preemption.saving():
            everyone(
                lambda: local._write_payload(
                    _owing(self._payload(state, saved_rng), defer), state.step
                ),
                f"write checkpoint step {state.step} to the local tier '{local.directory}'",
            )
        events.emit(
            events.Kind.CHECKPOINT,
            step=state.step,
            tier="local",
            rank=_dist.rank(),
            **_deferred(defer),
        )
        return persist and not defer

    def _local_first(self, step: int) -> bool:
        """Collective, at a save due for the shared tier: True on every rank when the loop is
        stopping (``should_stop`` answered stop, on every rank alike), a deadline's signal
        stopped it, and the job asks such a stop's save to go to the local tier first
        (``--grace-action local``: an agent found that a whole save no longer fits the time
        Slurm leaves). The shared copy is then deferred to the next start (``_replicate``).
        The signal may reach some ranks only, and the agents publish the request in the job
        directory, which ranks may read a moment apart, so any rank that asks decides for all."""
        if not preemption.stopping():
            return False
        mine = local_tier.local_first_requested(preemption.requested())
        wanted = any(_dist.gather_to_all(mine))
        if wanted and _dist.rank() == 0:
            log.info(
                "Stop save of step %d goes to the node-local tier only (--grace-action local); "
                "the shared tier gets it at the next start.",
                step,
            )
        return wanted

    def _save_in_background(self, state: TrainState) -> Path | None:
        """Snapshot on the training thread, then serialise and commit behind it (rank 0)."""
        if skips_while_busy(self.when_busy, state.step):
            return None
        background.mark_used()
        background.drain()
        state.collect()
        saved_rng = _dist.gather_to_all(rng.capture())
        step = state.step
        if self.local_directory is not None:
            return self._save_locally_in_background(state, saved_rng)

        def start() -> str:
            self._start_writer()
            payload = snapshot(self._payload(state, saved_rng), shared=self.writer == "process")
            background.submit(
                lambda: str(self._commit_snapshot(payload, step)),
                f"write checkpoint step {step} to '{self.where}'",
            )
            return str(self.directory / checkpoint_name(step))

        planned = on_rank0(start, f"copy checkpoint step {step} into host memory")
        return Path(str(planned))

    def _save_locally_in_background(
        self, state: TrainState, saved_rng: list[dict[str, Any]]
    ) -> Path:
        """Every rank snapshots; its worker commits locally, then rank 0's to the shared tier
        when it is due."""
        step, persist, local = state.step, self._persisting(), self._local()
        defer = persist and self._local_first(step)
        shared = persist and not defer and _dist.rank() == 0

        def commit(payload: dict[str, Any]) -> str:
            with preemption.saving():
                written = local._write_payload(payload, step)
            events.emit(
                events.Kind.CHECKPOINT,
                step=step,
                tier="local",
                rank=_dist.rank(),
                mode="async",
                **_deferred(defer),
            )
            return str(self._commit_snapshot(payload, step)) if shared else str(written)

        def start() -> None:
            if shared:
                self._start_writer()
            payload = snapshot(self._payload(state, saved_rng), shared=self.writer == "process")
            background.submit(
                lambda: commit(_owing(payload, defer)), f"write checkpoint step {step}"
            )

        everyone(start, f"copy checkpoint step {step} into host memory")
        return local.directory / checkpoint_name(step)

    def _commit_snapshot(self, payload: dict[str, Any], step: int) -> Path:
        """The background half of an asynchronous save, on rank 0's worker thread."""
        with preemption.saving():
            written = self._write_payload(payload, step)
        events.emit(events.Kind.CHECKPOINT, step=step, path=str(written), mode="async")
        return written

    def load(self, state: TrainState) -> Path | None:
        """Restore the newest intact checkpoint into ``state``; None when there is none yet.

        Rank 0 claims the directory for this round and picks the checkpoint; every rank then
        reads it, and all agree on the outcome, so a rank whose read fails cannot leave the
        others to wait for it in their first collective.
        """
        lease.check()
        chosen = on_rank0(self.choose, f"choose a checkpoint in '{self.where}'")
        if self.local_directory is not None:
            return self._load_with_local_tier(state, chosen)
        if chosen is None:
            return None
        path = Path(chosen)
        self._restore(state, lambda: self._load_payload(path, state), path)
        log.debug("resumed from %s at step %d", path, state.step)
        if _dist.rank() == 0:
            emit_loaded(state.step, self.tier)
        return path

    def _load_with_local_tier(self, state: TrainState, shared: str | None) -> Path | None:
        """Load from this rank's local copy, else a peer's over the process group, else the
        shared tier; every rank emits ``checkpoint_loaded`` with the tier it used."""
        found: list[Path | str | None] = []
        everyone(  # a local tier refused on one rank stops every rank, not just that one
            lambda: found.append(self._local().newest_intact()),
            f"read the local tier '{self.local_directory}'",
        )
        mine = found[0]
        my_step = step_and_version(mine)[0] if isinstance(mine, Path) else None
        local_steps = _dist.gather_to_all(my_step)
        shared_step = step_and_version(Path(shared))[0] if shared is not None else None
        tier, step, holders = local_tier.choose_source(local_steps, shared_step)
        if step is None:
            return None
        source = tier
        if tier == "shared":
            tier = self.tier
            assert shared is not None
            path = Path(shared)
            payload = self._restore(state, lambda: self._load_payload(path, state), path)
        elif all(found == step for found in local_steps):
            # Every rank holds this step: each maps its own file, as a shared-tier load does,
            # instead of reading it into memory and deserialising a copy (twice as slow).
            assert isinstance(mine, Path)
            path, local = mine, self._local()
            payload = self._restore(state, lambda: local._load_payload(path, state), path)
        else:
            if _dist.rank() in holders:
                assert isinstance(mine, Path)
                path, data = mine, (mine / STATE_FILE).read_bytes()
            else:
                path, data, tier = self._local().directory / checkpoint_name(step), None, "peer"
            received = _dist.broadcast_bytes(data, holders[0])  # raw bytes, no pickle
            payload = self._restore(
                state, lambda: _loaded(state, local_tier.load_bytes(received)), path
            )
        emit_loaded(state.step, tier, _dist.rank())
        log.debug("rank %d resumed from the %s tier at step %d", _dist.rank(), tier, state.step)
        # Every rank read the same checkpoint, so every rank decides alike.
        owed = payload.get(local_tier.SHARED_OWED) is True
        if source == "local" and local_tier.owes_shared(owed, step, shared_step):
            self._replicate(payload, step)
        return path

    def _replicate(self, payload: dict[str, Any], step: int) -> None:
        """Collective: write a checkpoint restored from the local tier (or a peer) to the
        shared tier, from rank 0, before training goes on: the shared copy its stop's save
        deferred (``--grace-action local``). Every rank raises if it fails, as a save does."""
        log.debug("step %d was saved to the local tier only: copying it to '%s'", step, self.where)
        shared = {key: value for key, value in payload.items() if key != local_tier.SHARED_OWED}
        with preemption.saving():
            written = on_rank0(
                lambda: str(self._write_payload(shared, step)),
                f"copy checkpoint step {step} from the local tier to '{self.where}'",
            )
        if _dist.rank() == 0:
            events.emit(events.Kind.CHECKPOINT, step=step, path=written, replicated="local")

    def _restore(
        self, state: TrainState, read: Callable[[], dict[str, Any]], path: Path
    ) -> dict[str, Any]:
        """Read on every rank, restore the RNG, and agree on the outcome (as ``load``); the
        payload read."""
        problem: str | None = None
        try:
            payload = read()
            saved_rng = payload["rng"]
            rng.restore(saved_rng[_dist.rank() % len(saved_rng)])
        except Exception as error:
            problem = f"rank {_dist.rank()}: {error}"
            raise
        finally:
            problems = [found for found in _dist.gather_to_all(problem) if found is not None]
        if problems:
            raise CheckpointError(
                f"Could not load '{path}' on every rank ({problems[0]}); fix that rank's "
                f"cause and restart."
            )
        return payload

    def _load_payload(self, path: Path, state: TrainState) -> dict[str, Any]:
        """Read one checkpoint into ``state`` (held open, so retention leaves it alone)."""
        with reading(path):
            payload = _read(path / STATE_FILE)
            state.load_state_dict(payload)
        return payload

    def choose(self) -> str | None:
        """Rank 0's part of a load: claim the directory for this round, pick the newest."""
        commits = self._commits
        commits.claim_for_load()
        return commits.newest_or_raise()

    def _write(self, state: TrainState, saved_rng: list[dict[str, Any]]) -> Path:
        return self._write_payload(self._payload(state, saved_rng), state.step)

    @staticmethod
    def _payload(state: TrainState, saved_rng: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "world_size": _dist.world_size(),
            "rng": saved_rng,
            **state.state_dict(),
        }

    def write_serialised(self, data: bytes, step: int, world_size: int) -> Path:
        """Commit an already serialised ``torch.save`` payload as checkpoint ``step``: a
        sharded local-tier copy, written once and also sent to the ring neighbour."""
        staging = self.prepare_staging(step)
        path = staging / STATE_FILE
        try:
            write_synced(path, data, self._commits.file_mode)
        except BaseException:
            self._commits.abandon(staging)
            raise
        files = {STATE_FILE: {"size": len(data), "zip_crc32": True}}
        return self.commit(staging, step, world_size, files)

    def _write_payload(self, payload: dict[str, Any], step: int) -> Path:
        staging = self.prepare_staging(step)
        path = staging / STATE_FILE
        try:
            self._save_file(payload, path)
        except BaseException:
            commits = self._commits
            commits.abandon(staging)
            with suppress(OSError):  # say "a newer round removed it" rather than "no such file"
                commits.refuse_if_stale(f"commit step {step}")
            raise
        files = {STATE_FILE: {"size": path.stat().st_size, "zip_crc32": True}}
        return self.commit(staging, step, payload["world_size"], files)

    def _start_writer(self) -> None:
        """With ``writer="process"``: have a live writer before the commit needs it."""
        if self.writer == "process":
            from hpc_elastic.train import writer_process  # noqa: PLC0415 (opt-in)

            writer_process.ensure_started()

    def _save_file(self, payload: dict[str, Any], path: Path) -> None:
        """``state.pt``, fsynced: here, or in the writer process (``writer="process"``)."""
        if self.writer == "process":
            from hpc_elastic.train import writer_process  # noqa: PLC0415 (opt-in)

            writer_process.write(payload, path)
            return
        if self.private_root is not None:  # made 0600 first; torch.save keeps the mode
            mode = self._commits.file_mode
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode))
        torch.save(payload, path)
        _fsync_file(path)

    def prepare_staging(self, step: int) -> Path:
        """A fresh hidden directory to write ``step`` into (``Commits.prepare_staging``)."""
        return self._commits.prepare_staging(step)

    def commit(
        self, staging: Path, step: int, world_size: int, files: dict[str, dict[str, Any]]
    ) -> Path:
        """Seal ``staging`` with its manifest and rename it into place (``Commits.commit``)."""
        return self._commits.commit(staging, step, world_size, files)

    def newest_intact(self) -> Path | str | None:
        """Rank 0's choice: a path, None for a fresh start, or why nothing can be trusted."""
        return self._commits.newest_intact()

    def newest_or_raise(self) -> str | None:
        """The newest intact checkpoint's path as text, None for a fresh start, or an error."""
        return self._commits.newest_or_raise()


def emit_loaded(step: int | None, tier: str, rank: int | None = None) -> None:
    """The ``checkpoint_loaded`` event that ``status`` reads: one per restart from rank 0
    (``rank`` None) when every rank read the same tier, else one per rank."""
    details = events.LoadedDetails(step=step, tier=tier, rank=rank)
    events.emit(events.Kind.CHECKPOINT_LOADED, **details.to_details())


def skips_while_busy(when_busy: str, step: int) -> bool:
    """Collective: True on every rank when ``when_busy="skip"`` and a commit is in flight on
    any rank; then this save is skipped, with a log line and a ``checkpoint_skipped`` event."""
    if when_busy != "skip" or not background.any_busy():
        return False
    log.info("Skipping checkpoint step %d: the previous one is still committing.", step)
    if _dist.rank() == 0:
        events.emit(events.Kind.CHECKPOINT_SKIPPED, step=step, reason="commit in flight")
    return True


def on_rank0(action: Callable[[], str | None], what: str) -> str | None:
    """Rank 0 runs ``action``; every rank returns its result or raises its error.

    Rank 0 reaches the broadcast whatever it hits (the ``finally``), so the other ranks learn
    of any failure at once instead of waiting in the broadcast until the process group's
    timeout. Only plain strings travel.
    """
    outcome: dict[str, Any] = {"error": f"Rank 0 stopped before it could {what}; see its log."}
    if _dist.rank() == 0:
        try:
            outcome = {"value": action()}
        except CheckpointFencedError as error:
            outcome = {"error": str(error), "fenced": True}
            raise
        except CheckpointError as error:
            outcome = {"error": str(error)}
            raise
        except Exception as error:
            log.debug("rank 0 could not %s", what, exc_info=True)
            outcome = {"error": background.failure(what, error)}
            raise CheckpointError(outcome["error"]) from error
        finally:
            outcome = _dist.broadcast_from_rank0(outcome)
    else:
        outcome = _dist.broadcast_from_rank0(outcome)
    if "error" in outcome:
        kind = CheckpointFencedError if outcome.get("fenced") else CheckpointError
        raise kind(outcome["error"])
    value: str | None = outcome["value"]
    return value


def everyone(action: Callable[[], object], what: str) -> None:
    """Every rank runs ``action``; if any rank fails, every rank raises its sentence at once."""
    problem: str | None = None
    try:
        action()
    except CheckpointError as error:
        problem = str(error)
    except Exception as error:
        log.debug("rank %d could not %s", _dist.rank(), what, exc_info=True)
        problem = f"rank {_dist.rank()}: " + background.failure(what, error)
    problems = [found for found in _dist.gather_to_all(problem) if found is not None]
    if problems:
        raise CheckpointError(problems[0])


def _owing(payload: dict[str, Any], owed: bool) -> dict[str, Any]:
    """``payload`` marked as owing its shared copy (``local_tier.SHARED_OWED``) when ``owed``."""
    return {**payload, local_tier.SHARED_OWED: True} if owed else payload


def _deferred(owed: bool) -> dict[str, str]:
    """The ``checkpoint`` event's detail for a local-tier save whose shared copy is deferred."""
    return {"shared": "deferred"} if owed else {}


def _loaded(state: TrainState, payload: dict[str, Any]) -> dict[str, Any]:
    state.load_state_dict(payload)
    return payload


def save(
    state: TrainState, directory: Path | str | None = None, keep: int | None = None
) -> Path | None:
    """Save ``state`` as the newest checkpoint in ``directory`` (default: the job's)."""
    return Checkpointer.at(directory, keep).save(state)


def load(state: TrainState, directory: Path | str | None = None) -> Path | None:
    """Resume ``state`` from the newest intact checkpoint; None when there is none yet."""
    return Checkpointer.at(directory).load(state)


def snapshot(value: Any, *, shared: bool = False) -> Any:
    """A private host-memory copy of a state dict: tensors copied, containers rebuilt.

    The training thread goes on changing the model the moment an asynchronous save returns, so
    the worker must serialise a copy. Where CUDA exists the copies go to pinned memory (the
    fastest device-to-host path) and one synchronize waits for all of them at the end.

    The host buffers are kept and reused by the next snapshot (same place in the state dict,
    same shape and dtype): allocating, and for pinned memory registering, a gigabyte at every
    save costs more than the copy itself. That is safe because at most one commit is in
    flight and a snapshot is only taken after the previous commit ended. The price is one
    copy of the state kept in host memory between saves.

    ``shared``: the buffers live in shared memory instead (not pinned: a pinned buffer cannot
    be shared), so the writer process reads them where they are.
    """
    pinned = torch.cuda.is_available() and not shared
    # Shared buffers are kept apart, so that checkpointers of both kinds in one process
    # (the bench takes turns between them) do not reallocate each other's at every save.
    copied = _copy(value, (pinned, shared), ("shared",) if shared else ())
    if pinned:
        torch.cuda.synchronize()
    return copied


_buffers: dict[tuple[Any, ...], torch.Tensor] = {}


def _copy(value: Any, memory: tuple[bool, bool], where: tuple[Any, ...]) -> Any:
    if isinstance(value, torch.Tensor):
        return _copy_tensor(value, memory, where)
    if isinstance(value, dict):
        # A shallow copy keeps the dict's type and attributes (a state dict's ``_metadata``).
        rebuilt = copy.copy(value)
        for key, item in value.items():
            rebuilt[key] = _copy(item, memory, (*where, key))
        return rebuilt
    if isinstance(value, list):
        return [_copy(item, memory, (*where, index)) for index, item in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_copy(item, memory, (*where, index)) for index, item in enumerate(value))
    return copy.deepcopy(value)


def _copy_tensor(
    value: torch.Tensor, memory: tuple[bool, bool], where: tuple[Any, ...]
) -> torch.Tensor:
    """Into the reused buffer for ``where``; anything but a plain dense tensor is cloned.
    ``memory``: (pinned, shared), as ``snapshot`` chose."""
    pinned, shared = memory
    source = value.detach()
    if type(source) is not torch.Tensor or source.layout != torch.strided:
        copied = source.to("cpu", copy=True)
        return _shared(copied) if shared else copied
    pin = pinned and source.is_cuda
    buffer = _buffers.get(where)
    if buffer is None or _layout(buffer) != (source.shape, source.dtype, pin, shared):
        buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
        _buffers[where] = _shared(buffer) if shared else buffer
    return buffer.copy_(source, non_blocking=pin)


def _layout(buffer: torch.Tensor) -> tuple[Any, ...]:
    shared = buffer.is_shared()  # type: ignore[no-untyped-call]
    return buffer.shape, buffer.dtype, buffer.is_pinned(), shared


def _shared(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` moved into shared memory, where a writer process can map it."""
    moved: torch.Tensor = tensor.share_memory_()  # type: ignore[no-untyped-call]
    return moved


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


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


@dataclass(frozen=True)
class ObjectCheckpointer(Checkpointer):
    """A ``Checkpointer`` whose directory is an object-storage URL (``s3://bucket/prefix``);
    same API, same settings. ``Checkpointer.at`` chooses it for a URL.

    An object store has no rename and no lock, so the local scheme (write hidden, rename into
    place) becomes: write ``step-N/state.pt``, then ``step-N/manifest.json`` last. A checkpoint
    counts as committed only once its manifest exists, and is trusted only when its sizes and
    its zip CRC-32s match the manifest, so a writer killed mid-upload leaves a prefix without
    a manifest, which no reader trusts and the next save removes. Saving a step again writes a
    higher version (``step-N.1``) whose manifest commits it before the older copy is deleted.

    What the object store cannot give: readers cannot hold a checkpoint against retention (no
    ``flock``), and the round fence is checked just before the manifest is written rather
    than under a lock, so a stale round that passes the check in the same instant as a newer
    round claims the prefix could still commit once. The lease check, which runs just before
    the manifest too, is what stops a stale worker there. fsspec stays behind ``storage.py``.
    """

    url: str = ""

    @classmethod
    def for_url(cls, url: str, **settings: Any) -> ObjectCheckpointer:
        store = storage.ObjectStore(url)
        return cls(Path(store.root), url=url, **settings)

    @cached_property
    def store(self) -> storage.ObjectStore:
        return storage.ObjectStore(self.url)

    @property
    def where(self) -> str:
        return self.url

    @property
    def tier(self) -> str:
        return "remote"

    @property
    def _commits(self) -> ObjectCommits:
        return ObjectCommits(
            self.directory,
            lambda: self.fencing_round,
            job=self.job,
            keep=self.keep,
            keep_every=self.keep_every,
            private_root=self.private_root,
            store=self.store,
        )

    def _write_payload(self, payload: dict[str, Any], step: int) -> Path:
        """Upload the state, then the manifest (the commit), then drop what it replaces
        (``ObjectCommits.upload``); the state is serialised only once the prefix is claimed."""

        def serialise() -> bytes:
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            return buffer.getvalue()

        return self._commits.upload(step, payload["world_size"], serialise)

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
