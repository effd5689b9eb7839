"""What ``TrainState`` keeps of the training data: where the data stands, at every world size.

Three kinds of data position, found from the loader given to ``TrainState(loader=...)``:

- **An ``ElasticSampler``** (the loader's sampler, or ``TrainState(sampler=...)``): its
  ``(epoch, position)`` is the whole state, as before. A stateful loader's own state is not
  used: it holds a copy of the sampler's state from when the loader prefetched, which would
  move the sampler back.
- **An ``ElasticShards``** dataset: its ``(epoch, step)``, advanced by ``finish_step``. With a
  stateful loader (torchdata's ``StatefulDataLoader``) the loader's state, workers included, is
  kept too: at the same world size, worker count and micro-batch it is restored as it was;
  otherwise each rank starts a new stream of its lanes at the saved position. At every save the
  workers' reports are combined into the job's position and checked against the steps counted.
- **Any other stateful loader**: its state is restored at the same world size and worker count;
  another world size is refused in one sentence, since nothing says how to re-split it.

The loader's state is taken at every ``finish_step`` (the step boundary), not at the save: a save
in the middle of a step (between two micro-batches of an accumulation) must resume at the
step's first sample, which the loader has already handed out.

The per-step sample log (``hpc_elastic.samples``) is written from here too.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from hpc_elastic import contract, samples
from hpc_elastic.errors import DataError
from hpc_elastic.train import _dist, _torchdata
from hpc_elastic.train.resplit import Position, Stream, WorkerReport, combine, handed_out
from hpc_elastic.train.sampler import ElasticSampler
from hpc_elastic.train.shards import ElasticShards

log = logging.getLogger(__name__)


class TrainingData:
    """The loader (or none), its position, its state at the last step boundary, the sample log."""

    def __init__(self, loader: Any = None) -> None:
        self.loader = loader
        dataset = getattr(loader, "dataset", None)
        self.shards = dataset if isinstance(dataset, ElasticShards) else None
        sampler = getattr(loader, "sampler", None)
        self.sampler = sampler if isinstance(sampler, ElasticSampler) else None
        self.stateful = _torchdata.is_stateful(loader) and self.sampler is None
        if loader is not None and not (self.shards or self.sampler or self.stateful):
            raise DataError(
                f"TrainState(loader=...) cannot keep the position of a {type(loader).__name__} "
                f"over {type(dataset).__name__}; give it an ElasticSampler, an ElasticShards "
                f"dataset or a StatefulDataLoader, or pass the sampler instead."
            )
        batch_size = getattr(loader, "batch_size", None)
        if self.shards is not None and batch_size != self.shards.plan.micro_batch_size:
            raise DataError(
                f"The loader's batch_size={batch_size} is not the plan's micro-batch of "
                f"{self.shards.plan.micro_batch_size}: a loader batch must be one micro-batch "
                f"of ElasticShards; set batch_size=plan.micro_batch_size."
            )
        self._at_step: dict[str, Any] | None = None
        self._gathered: list[Any] | None = None
        self._log_dir = samples.directory()
        self._ids: list[int] = []
        self._writers: dict[int, samples.Writer] = {}
        self._clock_inc: int | None = None

    @property
    def epoch(self) -> int | None:
        return self.shards.epoch if self.shards is not None else None

    def set_epoch(self, epoch: int) -> None:
        if self.shards is not None:
            self.shards.set_epoch(epoch)

    @property
    def num_workers(self) -> int:
        return int(getattr(self.loader, "num_workers", 0) or 0)

    # --- every step ------------------------------------------------------------------------

    def log_samples(self, ids: Any) -> None:
        """Note sample ids the current step trains on (only when the sample log is on)."""
        if self._log_dir is None:
            return
        values = ids.tolist() if hasattr(ids, "tolist") else ids
        self._ids.extend(int(value) for value in _flat(values))

    def finish_step(self, step: int, sampler: ElasticSampler | None) -> None:
        """Step ``step`` is trained: log its samples, move the positions, keep the loader's
        state as of this boundary."""
        if self._log_dir is not None:
            self._write(step, sampler)
        if sampler is not None:
            sampler.advance()
        if self.shards is not None:
            self.shards.advance()
        if self.stateful:
            self._at_step = self.loader.state_dict()
            # What the last save gathered is stale now: a state_dict() taken without a save
            # (InPlace hands one to a newcomer) must not restore a loader to it.
            self._gathered = None

    # --- checkpoints -----------------------------------------------------------------------

    def collect(self) -> None:
        """Collective, before a save: every rank's loader state on every rank, checked.

        A state that cannot travel (a NumPy number in a dataset's ``state_dict``) is found on
        its rank before the collective and reported by every rank after it, so no rank waits
        for one that raised."""
        if not self.stateful:
            return
        mine, problem = self._at_step, None
        try:
            _dist.encode(mine)
        except TypeError as error:
            mine, problem = None, f"rank {_dist.rank()}: {error}"
        gathered = _dist.gather_to_all((problem, mine))
        problems = [found for found, _ in gathered if found is not None]
        if problems:
            raise DataError(
                f"The loader's state cannot be saved ({problems[0]}); make the dataset's "
                f"state_dict() return plain Python numbers, strings, lists and dicts."
            )
        self._gathered = [state for _, state in gathered]
        if self.shards is not None:
            self._check(self._gathered)

    def _check(self, states: list[Any]) -> None:
        """The workers' reports of every rank, combined, must be where the steps say."""
        assert self.shards is not None
        found = [self._position_of(rank, state) for rank, state in enumerate(states)]
        reported = [position for position in found if position is not None]
        if reported:
            combined = combine([*reported, self.shards.position], "ranks' loaders and steps")
            log.debug("loaders of %d ranks agree on %s", len(reported), combined)

    def _position_of(self, rank: int, state: dict[str, Any] | None) -> Position | None:
        assert self.shards is not None
        if state is None:
            return None
        iterators, extra = _torchdata.iterator_states(state)
        if any(found is None for found in iterators):  # no worker has read anything yet
            return None
        reports = [
            WorkerReport(s["epoch"], s["step"], s["worker"], s["workers"], s["samples"])
            for s in iterators
        ]
        plan = self.shards.plan
        stream = Stream(
            self.shards.layout,
            Position(reports[0].epoch, reports[0].step),
            rank,
            plan.world_size,
            plan.micro_batch_size,
        )
        return stream.position_after(handed_out(reports, plan.micro_batch_size, extra))

    def state_dict(self) -> dict[str, Any]:
        shards = self.shards
        return {
            "world": _dist.world_size(),
            "workers": self.num_workers,
            "micro": shards.plan.micro_batch_size if shards is not None else None,
            "position": [shards.epoch, shards.position.step] if shards is not None else None,
            "loaders": self._gathered,
        }

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Resume the data where ``saved`` says, at this world size (module docstring)."""
        if not saved:
            return
        if self.shards is not None and saved.get("position") is not None:
            epoch, step = saved["position"]
            self.shards.resume(Position(int(epoch), int(step)))
        loaders = saved.get("loaders")
        if not self.stateful or not loaders or all(state is None for state in loaders):
            return
        world, rank = _dist.world_size(), _dist.rank()
        micro = self.shards.plan.micro_batch_size if self.shards is not None else None
        same = (saved["world"], saved["workers"], saved.get("micro")) == (
            world,
            self.num_workers,
            micro,
        )
        mine = loaders[rank] if same else None
        if mine is not None:
            log.debug("rank %d restores its loader's state (workers included)", rank)
            self.loader.load_state_dict(mine)
            self._at_step = mine
        elif self.shards is None and not same:
            raise DataError(
                f"The checkpoint's loader state is of {saved['world']} ranks with "
                f"{saved['workers']} loader workers each, this run has {world} with "
                f"{self.num_workers}, and nothing says how to re-split a "
                f"{type(getattr(self.loader, 'dataset', None)).__name__}; resume at "
                f"{saved['world']} ranks and {saved['workers']} workers, or read the data "
                f"through elastic.ElasticShards or an ElasticSampler."
            )
        else:
            log.debug("rank %d starts a new stream of its lanes at the saved position", rank)

    # --- the sample log --------------------------------------------------------------------

    def _write(self, step: int, sampler: ElasticSampler | None) -> None:
        assert self._log_dir is not None
        inc = self._incarnation()
        writer = self._writers.get(inc)
        if writer is None:
            writer = self._writers[inc] = samples.Writer(self._log_dir, inc, _dist.rank())
        writer.write(
            samples.Record(
                inc=inc,
                step=step,
                world=_dist.world_size(),
                rank=_dist.rank(),
                ids=tuple(self._ids),
                **self._where(sampler),
            )
        )
        self._ids.clear()

    def _incarnation(self) -> int:
        """The agent's round (an in-place change moves a live process into a new one), else
        rank 0's clock when this process first logged: one collective, once."""
        value = os.environ.get(contract.ROUND_ENV, "")
        if value.isdigit():
            return int(value)
        if self._clock_inc is None:
            self._clock_inc = int(_dist.broadcast_from_rank0(time.time_ns()))
        return self._clock_inc

    def _where(self, sampler: ElasticSampler | None) -> dict[str, int | None]:
        """The step's place in its epoch, before the positions move on."""
        if sampler is not None:
            batch = sampler.global_batch_size
            return {
                "epoch": sampler.epoch,
                "pos": sampler.position // batch,
                "steps": sampler.steps_per_epoch,
                "batch": batch,
                "universe": sampler.size,
            }
        if self.shards is not None:
            layout = self.shards.layout
            return {
                "epoch": self.shards.epoch,
                "pos": self.shards.position.step,
                "steps": layout.steps,
                "batch": layout.global_batch_size,
                "universe": sum(layout.lengths),
            }
        return {}


def _flat(values: Any) -> Iterable[Any]:
    """Ids as one flat sequence, whatever nesting a collated batch gave them."""
    if isinstance(values, list | tuple):
        for value in values:
            yield from _flat(value)
    else:
        yield values
