"""A compiled model whose code reads data pointers (as RNNBase.flatten_parameters and many
checkpoint-sharing helpers do), with warnings shown as the default filter shows them."""

import warnings

import torch
from torch import nn

warnings.simplefilter("default")
model = torch.compile(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda())
shared = {p.data_ptr() for p in model.parameters()}
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(4):
    loss = model(torch.randn(16, 32, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} over {len(shared)} tensors")
