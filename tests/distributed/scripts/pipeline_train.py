"""A two-stage pipeline-parallel job as torch.distributed.pipelining's tutorial writes it
(torchrun --nproc-per-node 2 sets the environment): each rank builds its own stage."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
layers = [nn.Linear(256, 256) for _ in range(4)]
per_stage = len(layers) // world
stage_module = nn.Sequential(*layers[rank * per_stage:(rank + 1) * per_stage]).to(device)
# input_args: one microbatch's shape (required up to torch 2.5, optional from 2.6)
stage = PipelineStage(stage_module, rank, world, device,
                      input_args=torch.randn(16 // 4, 256, device=device))
schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, _t: out.square().mean())
optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
for _step in range(5):
    optimizer.zero_grad()
    if rank == 0:
        schedule.step(torch.randn(16, 256, device=device))
    else:
        schedule.step(target=torch.zeros(16, 256, device=device))
    optimizer.step()
