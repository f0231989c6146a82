"""A DDP training script as the PyTorch DDP tutorial writes it (torchrun sets the environment).

``--report PATH`` writes what DDP's reducer says about its gradient buckets after each backward
pass (``Reducer._get_zeros_like_grad_buckets``: a GradBucket like each of its buckets), for the tests
to compare with the probe's trace.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--bucket-cap-mb", type=float, default=None)
parser.add_argument("--bucket-view", action="store_true")
parser.add_argument("--report", default="")
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--checkpoint", action="store_true",
                    help="activation checkpointing of every layer and its activation")
parser.add_argument("--static-graph", action="store_true")
parser.add_argument("--fp16-compress", action="store_true",
                    help="DDP's built-in FP16_COMPRESS communication hook")
parser.add_argument("--find-unused-parameters", action="store_true")
parser.add_argument("--unused-layer", action="store_true",
                    help="a layer the forward pass never uses (what find_unused_parameters is for)")
args = parser.parse_args()

dist.init_process_group(backend="nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)


def block(layer, x):
    """A layer and its activation: what activation checkpointing recomputes in backward."""
    return nn.functional.gelu(layer(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(args.width, args.width)
                                      for _ in range(args.layers)])
        self.unused = nn.Linear(args.width, args.width) if args.unused_layer else None

    def forward(self, x):
        for layer in self.layers:
            x = (torch.utils.checkpoint.checkpoint(block, layer, x, use_reentrant=False)
                 if args.checkpoint else block(layer, x))
        return x


model = Model().cuda()
options = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=args.bucket_view,
          static_graph=args.static_graph, find_unused_parameters=args.find_unused_parameters,
          **options)
if args.fp16_compress:
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
for _step in range(10):
    batch = torch.randn(args.batch, args.width, device="cuda")
    loss = ddp(batch).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if args.report:
        sizes = [b.buffer().numel() * b.buffer().element_size()
                 for b in ddp.reducer._get_zeros_like_grad_buckets()]
        with open(args.report, "w") as fh:
            json.dump({"bucket_sizes": sizes,
                       "world_size": dist.get_world_size(), "rank": dist.get_rank(),
                       "backend": dist.get_backend()}, fh)
    optimizer.step()
