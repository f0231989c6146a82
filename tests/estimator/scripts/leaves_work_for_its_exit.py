"""A training script that leaves work for its exit: an ``atexit`` handler that writes a file
(``--marker``), two helper processes of its own (``multiprocessing``, daemons, as a prefetcher
or a metrics sender is) that write their process ids into ``--pids`` and then wait for work that
never comes, and a file in the MLflow store the environment names (MLFLOW_TRACKING_URI, as
MLflow's own file store would make it)."""

import argparse
import atexit
import multiprocessing
import os
import time
from urllib.parse import urlsplit

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--marker", required=True)
parser.add_argument("--pids", required=True)
args = parser.parse_args()


def on_exit():
    with open(args.marker, "w") as handle:
        handle.write("the script's exit handler ran\n")


atexit.register(on_exit)

uri = os.environ.get("MLFLOW_TRACKING_URI", "")
if uri.startswith("file://"):
    store = urlsplit(uri).path
    os.makedirs(store, exist_ok=True)
    with open(os.path.join(store, "meta.yaml"), "w") as handle:
        handle.write("a run's metadata\n")


def helper(folder):
    with open(os.path.join(folder, str(os.getpid())), "w"):
        pass
    time.sleep(600)


helpers = [multiprocessing.Process(target=helper, args=(args.pids,), daemon=True)
           for _ in range(2)]
for process in helpers:
    process.start()
model = nn.Linear(16, 16).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(8, 16, device="cuda")).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
