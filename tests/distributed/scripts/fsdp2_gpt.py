"""A GPT-style model trained with FSDP2 (``fully_shard`` per block, then the root), as torchtitan
and the FSDP2 tutorial write it; torchrun sets the environment.

``--checkpoint`` wraps each block in activation checkpointing; ``--reshard-after-forward 0``
keeps gathered parameters between forward and backward.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--vocab", type=int, default=1024)
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--checkpoint", action="store_true")
parser.add_argument("--reshard-after-forward", type=int, default=1)
parser.add_argument("--cpu-offload", action="store_true",
                    help="fully_shard(offload_policy=CPUOffloadPolicy()): shards on the host")
# Device-neutral choices, so the host oracle (fsdp2_oracle.py) runs the same ops as the traced
# GPU job: attention written out (no SDPA kernel choice), the optimizer's per-tensor loop.
parser.add_argument("--portable", action="store_true")


class Block(nn.Module):
    def __init__(self, hidden, heads, portable=False):
        super().__init__()
        self.heads = heads
        self.portable = portable
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.portable:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
            y = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.wte = nn.Embedding(args.vocab, args.hidden)
        self.wpe = nn.Embedding(args.seq, args.hidden)
        self.blocks = nn.ModuleList(Block(args.hidden, args.heads, args.portable) for _ in range(args.layers))
        self.ln = nn.LayerNorm(args.hidden)
        self.head = nn.Linear(args.hidden, args.vocab, bias=False)
        self.checkpoint = args.checkpoint

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln(x))


def build(args, device):
    model = GPT(args).to(device)
    options = {"reshard_after_forward": bool(args.reshard_after_forward)}
    if getattr(args, "cpu_offload", False):
        options["offload_policy"] = CPUOffloadPolicy()
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def make_optimizer(args, model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False if args.portable else None)


def main():
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_device_mesh("cuda", (dist.get_world_size(),))
    model = build(args, "cuda")
    optimizer = make_optimizer(args, model)
    for _ in range(10):
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, args.vocab), idx.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
