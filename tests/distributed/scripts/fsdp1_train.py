"""FSDP1 (FullyShardedDataParallel) over a small MLP, as the FSDP tutorial writes it; torchrun sets
the environment. ``--strategy`` is a ShardingStrategy name."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="FULL_SHARD")
args = parser.parse_args()
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).cuda()
model = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy[args.strategy],
                                 device_id=torch.cuda.current_device())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = (torch.randn(16, 512, device="cuda") for _ in range(10))
for batch in batches:
    optimizer.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    optimizer.step()
