"""FSDP1 (FullyShardedDataParallel) over a small MLP, as the FSDP tutorial writes it; torchrun sets
the environment. ``--strategy`` is a ShardingStrategy name; ``--no-limit-all-gathers``,
``--mixed-precision`` (bf16 parameters, gradient reduction and buffers) and ``--cpu-offload``
(parameters and their gradients kept on the host) are FSDP1's options of those names."""

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="FULL_SHARD")
parser.add_argument("--no-limit-all-gathers", action="store_true")
parser.add_argument("--mixed-precision", action="store_true")
parser.add_argument("--cpu-offload", action="store_true")
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--checkpoint", action="store_true",
                    help="activation checkpointing of every block (apply_activation_checkpointing)")
parser.add_argument("--wrap-layers", action="store_true",
                    help="each Linear its own FSDP unit (auto_wrap_policy), the model the root")
args = parser.parse_args()
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


class Block(nn.Module):
    """A Linear and its activation: what activation checkpointing recomputes in backward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(512, 512)

    def forward(self, x):
        return nn.functional.gelu(self.linear(x))


model = nn.Sequential(*[Block() for _ in range(6)]).cuda()
options = {}
if args.mixed_precision:
    options["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.bfloat16,
                                                buffer_dtype=torch.bfloat16)
if args.cpu_offload:
    options["cpu_offload"] = CPUOffload(offload_params=True)
if args.wrap_layers:
    options["auto_wrap_policy"] = ModuleWrapPolicy({nn.Linear})
model = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy[args.strategy],
                                 device_id=torch.cuda.current_device(),
                                 limit_all_gathers=not args.no_limit_all_gathers, **options)
if args.checkpoint:
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=partial(checkpoint_wrapper,
                                             checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: isinstance(module, Block))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = (torch.randn(args.batch, 512, device="cuda") for _ in range(10))
for batch in batches:
    optimizer.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    optimizer.step()
