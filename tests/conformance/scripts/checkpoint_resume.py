"""Resuming from a checkpoint: ``torch.load(path, map_location="cuda")`` of a dict with the
model's and the optimizer's state (written by an earlier run: here by the script itself when the
run: ``python checkpoint_resume.py --write PATH`` makes one on the host), ``load_state_dict`` into
a model already on the GPU, ``del checkpoint`` to free the loaded copy, then training on with
Adam."""

import argparse

import torch
from torch import nn


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default="")
    parser.add_argument("--write", default="", help="write a checkpoint to resume from, and stop")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    return parser.parse_args(argv)


def build_model(args):
    w = args.width
    return nn.Sequential(nn.Linear(w, 2 * w), nn.BatchNorm1d(2 * w), nn.ReLU(),
                         nn.Linear(2 * w, w), nn.ReLU(), nn.Linear(w, 10))


def build_optimizer(args, model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def write_checkpoint(args, path):
    """What an earlier run on the host left behind: weights and an Adam state after one step."""
    model = build_model(args)
    optimizer = build_optimizer(args, model)
    model(torch.randn(4, args.width)).sum().backward()
    optimizer.step()
    torch.save({"epoch": 1, "state_dict": model.state_dict(),
                "optimizer": optimizer.state_dict()}, path)


def main():
    args = parse()
    if args.write:
        write_checkpoint(args, args.write)
        return
    path = args.resume
    model = build_model(args).cuda()
    optimizer = build_optimizer(args, model)
    checkpoint = torch.load(path, map_location="cuda")
    start_epoch = checkpoint["epoch"]
    model.load_state_dict(checkpoint["state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    del checkpoint
    print(f"=> loaded checkpoint '{path}' (epoch {start_epoch})")
    for step in range(args.steps):
        x = torch.randn(args.batch_size, args.width, device="cuda")
        y = torch.randint(0, 10, (args.batch_size,), device="cuda")
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
