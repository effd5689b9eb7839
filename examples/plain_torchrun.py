"""A plain torchrun DDP script, made elastic: every changed or added line is marked ``# elastic``.

    torchrun --nproc-per-node=2 examples/plain_torchrun.py

Before: ``DistributedSampler`` plus ``sampler.set_epoch(epoch)``, and nothing to resume from.
After: the sampler, the loop counters and the stop check come from ``hpc_elastic.train``, so a
restart, a requeue or a different number of ranks continues where the last checkpoint left off.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import hpc_elastic.train as elastic  # elastic

STEPS = 200
GLOBAL_BATCH = 48


def train() -> None:
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(960, 16), torch.randn(960, 1))
    model = DistributedDataParallel(nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = elastic.ElasticSampler(dataset, GLOBAL_BATCH, seed=0)  # elastic
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dist.get_world_size(), sampler=sampler)
    state = elastic.TrainState(model, optimizer, sampler=sampler)  # elastic
    elastic.load(state)  # elastic

    while state.step < STEPS:  # elastic
        for inputs, targets in loader:
            optimizer.zero_grad()
            torch.autograd.backward(nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            state.finish_step()  # elastic
            stop = elastic.should_stop(state.step)  # elastic
            if state.step == STEPS:  # elastic
                elastic.finish()  # elastic: the loop is over, the agent stops timing it
            if stop or state.step % 50 == 0:  # elastic
                elastic.save(state)  # elastic
            if stop:  # elastic
                elastic.exit_preempted()  # elastic
            if state.step == STEPS:
                break


if __name__ == "__main__":
    dist.init_process_group("gloo")
    train()
    gc.collect()  # elastic: free DDP before its process group (see docs/training.md)
    dist.barrier()
    dist.destroy_process_group()
