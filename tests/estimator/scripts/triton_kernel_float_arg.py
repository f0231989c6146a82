"""A Triton kernel that casts a float argument inside the kernel (``eps.to(tl.float32)``, as
Liger's RMSNorm does): it compiles for a GPU, while Triton's interpreter passes the float as a
Python number and cannot run it on the host."""

import torch
import triton
import triton.language as tl
from torch import nn


@triton.jit
def shift_kernel(x_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    x = tl.load(x_ptr + offsets, mask=keep)
    tl.store(out_ptr + offsets, x + eps.to(tl.float32), mask=keep)


model = nn.Linear(64, 64).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(3):
    h = model(torch.randn(8, 64, device="cuda"))
    out = torch.empty_like(h)
    shift_kernel[(1,)](h, out, h.numel(), 1e-6, BLOCK=1024)
    (h * out.detach()).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
