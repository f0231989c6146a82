"""bf16 products summed into an fp32 accumulator with ``torch.addmm(..., out_dtype=torch.float32,
out=acc)``, as TRL's fused LM head does chunk by chunk."""

import torch
from torch import nn

head = nn.Linear(64, 512, bias=False).cuda().to(torch.bfloat16)
optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
for _step in range(3):
    hidden = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # inside a custom autograd Function there: no derivative of its own
        acc = torch.zeros(32, 512, device="cuda", dtype=torch.float32)
        torch.addmm(acc, hidden, head.weight.t(), out_dtype=torch.float32, out=acc)
        logits = torch.addmm(acc, hidden, head.weight.t(), out_dtype=torch.float32)
    (head(hidden).float() * logits).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
