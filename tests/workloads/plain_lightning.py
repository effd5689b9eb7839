"""A Lightning script, not ours: ``Trainer(strategy=DDPStrategy(...))`` starts the group.

The script never names the process group: Lightning's DDP strategy starts it (``env://``)
inside ``trainer.fit``, as it finds torchrun's environment. Nothing of hpc_elastic is
imported. Each step is one all-reduce of a tiny linear model's gradients (DDP) and a 0.1 s
sleep; rank 0 appends ``<time> <step> <world> <restart count> <pid>`` to ``<out>/progress``
after every step (the format of train_gloo.py, which the benchmark reads). Needs the
``lightning`` package; the benchmark skips this workload without it.
"""

import argparse
import os
import time
from pathlib import Path

# Lightning is no dependency of the project: type-checked where it is installed, else Any.
import lightning.pytorch as pl  # type: ignore[import-not-found, unused-ignore]
import torch
from lightning.pytorch.strategies import (  # type: ignore[import-not-found, unused-ignore]
    DDPStrategy,
)
from torch.utils.data import DataLoader, IterableDataset


class Batches(IterableDataset):  # type: ignore[type-arg]
    """One tiny batch after another, for as many steps as the trainer asks."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            yield torch.ones(4), torch.ones(1)


class Tiny(pl.LightningModule):  # type: ignore[misc, unused-ignore]
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.out = out
        self.restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def training_step(self, batch, index):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
        if self.global_rank == 0:
            with (self.out / "progress").open("a") as progress:
                progress.write(
                    f"{time.time():.3f} {self.global_step} {self.trainer.world_size} "
                    f"{self.restarts} {os.getpid()}\n"
                )
        time.sleep(0.1)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(args.out), DataLoader(Batches(), batch_size=None))


if __name__ == "__main__":
    main()
