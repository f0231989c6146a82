"""A step whose sizes depend on values: the selection named by the first argument.

known: rows picked by a mask made from the labels (host data: its value is known)
mask, nonzero, unique, masked_select: picked by values the model computes on the GPU
repeat: rows repeated by counts the model computes (no bound without their values)
wrapped: the same, inside a library that wraps every failure in its own exception
"""

import sys

import torch
from torch import nn

kind = sys.argv[1]
torch.manual_seed(0)
model = nn.Linear(64, 64).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
labels = torch.randint(0, 10, (8, 128))
labels[:, :32] = -100  # the prompt's tokens: no loss there
labels = labels.cuda()


def repeat_rows(h):
    counts = (h[..., 0] > 0).long().flatten()
    return torch.repeat_interleave(h.flatten(0, 1), counts, dim=0)


def library_call(h):
    try:
        return repeat_rows(h)
    except BaseException as exc:  # noqa: BLE001 - as some libraries do
        raise RuntimeError("the library's step failed") from exc


for _step in range(3):
    h = model(torch.randn(8, 128, 64, device="cuda"))
    if kind == "known":
        picked = h[labels != -100]
    elif kind == "mask":
        picked = h[h[..., 0] > 0]
    elif kind == "nonzero":
        picked = h[torch.nonzero(h[..., 0] > 0, as_tuple=True)]
    elif kind == "unique":
        picked = h * torch.unique(h.argmax(-1)).numel()
    elif kind == "masked_select":
        picked = torch.masked_select(h, h > 0)
    elif kind == "repeat":
        picked = repeat_rows(h)
    elif kind == "wrapped":
        picked = library_call(h)
    loss = picked.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
