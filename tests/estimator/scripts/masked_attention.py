"""Attention with an additive float mask, trained on the GPU through
``F.scaled_dot_product_attention`` (fp32 with a mask: CUDA's memory-efficient kernel)."""

import argparse

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--heads", type=int, default=2)
parser.add_argument("--tokens", type=int, default=33)
args = parser.parse_args()

width = 64 * args.heads
project = torch.nn.Linear(width, 3 * width).cuda()
opt = torch.optim.SGD(project.parameters(), lr=1e-3)
mask = torch.randn(args.batch, args.heads, args.tokens, args.tokens, device="cuda")
for step in range(args.steps):
    x = torch.randn(args.batch, args.tokens, width, device="cuda")
    q, k, v = project(x).view(args.batch, args.tokens, 3, args.heads, 64).unbind(2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=mask)
    opt.zero_grad()
    out.square().mean().backward()
    opt.step()
    print(f"step {step}")
