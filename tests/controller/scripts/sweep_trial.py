"""A sweep's trial: a small model trained for a few steps, or (``--end``) a trial that is killed
(as the kernel kills a process past its memory limit), hangs, fails its arguments, or loads far
more into host memory than an estimation pod has."""

import argparse
import os
import signal
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--end", choices=("train", "killed", "hangs", "fails", "hogs"), default="train")
args = parser.parse_args()
if args.end == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
if args.end == "hangs":
    time.sleep(600)
if args.end == "hogs":
    cache = bytearray(3 << 30)  # 3 GiB of "preloaded dataset", touched page by page
    for offset in range(0, len(cache), 4096):
        cache[offset] = 1
if args.end == "fails":
    raise ValueError("bad arguments: --end fails")
model = torch.nn.Linear(args.width, args.width).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(8, args.width, device="cuda")).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
