"""A loss computed by a hand-written Triton kernel on tensors the script allocates, as TRL's
chunked log-probabilities and Liger's fused losses do. ``--check`` says whether the kernel's
output is right (a run with real values)."""

import sys

import torch
import triton
import triton.language as tl
from torch import nn


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=keep) * 2.0, mask=keep)


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)  # the kernel's output: made here, by the caller
        scale_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


model = nn.Linear(256, 256).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(3):
    h = model(torch.randn(64, 256, device="cuda"))
    scaled = Scale.apply(h)
    if "--check" in sys.argv:
        print("kernel output right:", bool(torch.equal(scaled, h * 2.0)))
    scaled.float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
