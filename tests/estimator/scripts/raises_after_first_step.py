"""Fails after its first optimizer step (a data pipeline that breaks on the second batch)."""

import torch

model = torch.nn.Linear(8, 8).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    if step == 1:
        raise RuntimeError("corrupt record in shard 3")
    loss = model(torch.randn(4, 8, device="cuda")).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
