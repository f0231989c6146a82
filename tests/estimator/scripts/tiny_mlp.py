"""A tiny training script used by the estimator tests: plain PyTorch, written for a GPU."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--amp", default="")
parser.add_argument("--decide-on-loss", action="store_true")
parser.add_argument("--checkpoint", default="")
parser.add_argument("--optimizer", default="adamw")
args = parser.parse_args()

assert torch.cuda.is_available(), "needs a GPU"
device = torch.device("cuda")
props = torch.cuda.get_device_properties(0)
print(f"gpu {torch.cuda.get_device_name(0)} {props.total_memory} cc {props.major}.{props.minor}")
model = torch.nn.Sequential(
    torch.nn.Linear(args.hidden, 4 * args.hidden), torch.nn.GELU(),
    torch.nn.Dropout(0.1), torch.nn.Linear(4 * args.hidden, 10),
).cuda()
opt = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[args.optimizer](
    model.parameters(), lr=1e-3)
best = float("inf")
for step in range(args.steps):
    x = torch.randn(args.batch, args.hidden).to(device)
    y = torch.randint(0, 10, (args.batch,), device="cuda")
    opt.zero_grad(set_to_none=True)
    if args.amp:
        with torch.autocast("cuda", dtype=getattr(torch, args.amp)):
            loss = torch.nn.functional.cross_entropy(model(x), y)
    else:
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    value = loss.item()
    print(f"step {step} loss {value:.4f} on {x.device} cuda={x.is_cuda}")
    if args.decide_on_loss and value < best:
        best = value
if args.checkpoint:
    with open(args.checkpoint, "w") as fh:
        fh.write("done")
