"""A stack of square linear layers trained with Adam: much model state, a little compute.
``--width`` and ``--depth`` size it (2048 x 32: 134M fp32 parameters, 1 GiB of Adam moments).
Adam's single-tensor path (``foreach=False``): its moments are ``zeros_like`` each parameter."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=2048)
parser.add_argument("--depth", type=int, default=32)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False)
                              for _ in range(args.depth)]).cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
for _ in range(args.steps):
    x = torch.randn(8, args.width, device="cuda")
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
