"""Fails before its first optimizer step."""

import torch


def build():
    raise ValueError("bad config: hidden size must be even")


model = build()
torch.optim.SGD(model.parameters(), lr=0.1).step()
