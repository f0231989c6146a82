"""Builds a model whose widths are computed with tensor arithmetic (like torchvision's RegNet)."""

import torch

widths = (torch.arange(4) * 16.0 + 32).round().to(torch.int64).tolist()
layers = []
prev = 8
for w in widths:
    layers += [torch.nn.Linear(prev, int(w)), torch.nn.ReLU()]
    prev = int(w)
model = torch.nn.Sequential(*layers).cuda()
print("widths", widths)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(5):
    loss = model(torch.randn(4, 8).cuda()).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
