"""Gradients summed by autograd itself: residual junctions, a tied weight, a formula's own add.

A GPU run accumulates the first two in place; the third (atan2's backward adds two temporaries
of its own) allocates. Plain PyTorch, written for a GPU.
"""

import torch

torch.manual_seed(0)
vocab, width, batch, seq = 48, 32, 3, 8  # distinct sizes: weight 6,144 B, logits 4,608 B


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.Sequential(Block(), Block())

    def forward(self, ids):
        h = self.blocks(self.embed(ids))
        logits = h @ self.embed.weight.t()  # the embedding is used twice: a tied weight
        return logits, torch.atan2(h, h.detach() + 1.0).mean()


model = Model().cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    logits, extra = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()) + extra
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
