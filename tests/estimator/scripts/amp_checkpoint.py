"""Adam/AdamW/SGD, autocast with GradScaler (fp16) or without (bf16), activation checkpointing:
the torch code paths that differ most across releases, in one small GPU script."""

import argparse

import torch
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", default="adamw", choices=("adam", "adamw", "sgd"))
parser.add_argument("--amp", default="", choices=("", "fp16", "bf16"))
parser.add_argument("--grad-ckpt", action="store_true")
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        if args.grad_ckpt:
            return x + checkpoint(self.net, x, use_reentrant=False)
        return x + self.net(x)


model = torch.nn.Sequential(Block(32), Block(32), torch.nn.Linear(32, 10)).cuda()
optimizers = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
opt = optimizers[args.optimizer](model.parameters(), lr=1e-3)
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
scaler = torch.cuda.amp.GradScaler(enabled=args.amp == "fp16")
for _ in range(args.steps):
    x = torch.randn(8, 32, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
