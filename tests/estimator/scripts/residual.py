"""Gradients summed by autograd itself: residual junctions, a tied weight, a formula's own add.

Plain PyTorch, written for a GPU; it also runs on the CPU. With ``--record FILE`` it writes the
sizes of the host allocations of its last backward, recorded by torch.profiler with no dispatch
mode active: what autograd allocates on plain tensors, the oracle for the probe's trace.
"""

import argparse
import json
import os
import tempfile

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--record", default="")
args = parser.parse_args()

torch.manual_seed(0)
# distinct sizes: residual gradients 3,072 B, tied weight 6,144 B, mix 4,096 B, logits 4,608 B
vocab, width, batch, seq = 48, 32, 3, 8
device = "cuda" if torch.cuda.is_available() else "cpu"


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
        self.mix = torch.nn.Parameter(torch.randn(width, width) / width)

    def forward(self, ids):
        h = self.blocks(self.embed(ids))
        h = h @ self.mix + torch.tanh(h @ self.mix)  # one weight used twice, no view
        logits = h @ self.embed.weight.t()  # tied weight, its first gradient through t()
        part = h[..., : width // 2]  # atan2's backward adds temporaries of its own (1,536 B)
        return logits, torch.atan2(part, part.detach() + 1.0).mean()


def backward(loss):
    if not args.record:
        loss.backward()
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path, encoding="utf-8") as fh:
        events = json.load(fh)["traceEvents"]
    sizes = [e["args"]["Bytes"] for e in events
             if e.get("name") == "[memory]" and e["args"]["Bytes"] > 0]
    with open(args.record, "w", encoding="utf-8") as fh:
        json.dump(sizes, fh)


model = Model().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    logits, extra = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()) + extra
    opt.zero_grad()
    backward(loss) if step == 2 else loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
