"""A model compiled as the first argument says: default, a mode, the method form, a
decorated loss function, or a compiled function the step never calls (``unused``)."""

import sys

import torch
from torch import nn

how = sys.argv[1]
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
if how == "default":
    model = torch.compile(model)
elif how == "method":
    model.compile()
elif how == "decorator":
    @torch.compile(dynamic=False)
    def loss_of(out):
        return out.square().mean()
elif how == "unused":
    @torch.compile
    def never_called(x):
        return x * 2
else:
    model = torch.compile(model, mode=how)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _step in range(4):
    out = model(torch.randn(16, 32, device="cuda"))
    loss = loss_of(out) if how == "decorator" else out.square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
