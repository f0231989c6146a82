"""A model trained with one of bitsandbytes' optimizers, as its docs show: swap
``torch.optim.AdamW`` for ``bnb.optim.AdamW8bit`` (blockwise 8-bit state) or a paged one
(``PagedAdamW``, ``PagedAdamW8bit``, ``PagedAdamW32bit``: state in CUDA managed memory).

    python bnb_optim_loop.py [--optim adamw8bit|adam8bit|paged_adamw|paged_adamw8bit|
        paged_adamw32bit] [--width 1024] [--batch-size 32] [--steps 3]
"""

import argparse

import bitsandbytes as bnb
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--optim", default="adamw8bit")
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                      nn.Linear(args.width, args.width // 4)).cuda()
optimizers = {"adamw8bit": bnb.optim.AdamW8bit, "adam8bit": bnb.optim.Adam8bit,
              "paged_adamw": bnb.optim.PagedAdamW, "paged_adamw8bit": bnb.optim.PagedAdamW8bit,
              "paged_adamw32bit": bnb.optim.PagedAdamW32bit}
optimizer = optimizers[args.optim](model.parameters(), lr=1e-3)

for _step in range(args.steps):
    x = torch.randn(args.batch_size, args.width, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
