"""Host-side data pipelines as training scripts write them (``--kind NAME``).

- ``shuffle``: a dataset of ``--samples`` items (default 1M) behind a shuffling DataLoader: the
  order comes from ``torch.randperm`` over every index.
- ``mnist``: torchvision's MNIST pattern: the whole set as in-memory uint8 tensors, each item
  read with ``int(target)`` and ``Image.fromarray(img.numpy())``, then a transform to a tensor.
- ``tokens``: text tokenised in Python, ids packed with ``torch.tensor``, a collate function
  that pads to the longest sequence and builds an attention mask.
- ``decide_on_data``: a decision on a value computed from host data (kept), then one on the
  model's output (the loss): only the second one needs real arithmetic.
"""

import argparse

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--kind", required=True)
parser.add_argument("--samples", type=int, default=1_000_000)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--device", default="cuda", help="cpu: the plain CPU run, for timing")
args = parser.parse_args()
device = torch.device(args.device)


class Indexed(Dataset):
    def __init__(self, n):
        self.n = n
        self.labels = torch.randint(0, 10, (n,))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        label = self.labels[i]
        if label < 0:  # a decision on a value of the dataset
            raise ValueError(f"negative label at {i}")
        return torch.full((32,), i % 7, dtype=torch.float32), int(label)


class MNISTLike(Dataset):
    """Data and targets in memory, as torchvision.datasets.MNIST keeps them."""

    def __init__(self, n):
        raw = np.random.default_rng(0).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        self.data = torch.from_numpy(raw)
        self.targets = torch.from_numpy(raw[:, 0, 0].astype(np.int64) % 10)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        img, target = self.data[index], int(self.targets[index])
        img = Image.fromarray(img.numpy(), mode="L")
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).flatten()
        return (x - 0.1307) / 0.3081, target


WORDS = "the quick brown fox jumps over the lazy dog while a cat sleeps".split()
VOCAB = {w: i + 1 for i, w in enumerate(sorted(set(WORDS)))}


class Sentences(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        text = " ".join(WORDS[: 3 + i % (len(WORDS) - 3)])
        return torch.tensor([VOCAB[w] for w in text.split()], dtype=torch.long)


def pad_collate(batch):
    longest = max(len(seq) for seq in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.bool)
    for row, seq in enumerate(batch):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = True
    return ids, mask


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(len(VOCAB) + 1, 64)
        self.out = nn.Linear(64, len(VOCAB) + 1)

    def forward(self, ids, mask):
        return self.out(self.emb(ids)) * mask.unsqueeze(-1)


if args.kind == "tokens":
    loader = DataLoader(Sentences(), batch_size=args.batch, shuffle=True,
                        num_workers=args.workers, collate_fn=pad_collate)
    model = Tagger().to(device)
else:
    data = MNISTLike(args.samples) if args.kind == "mnist" else Indexed(args.samples)
    # decide_on_data reads its first batches in order: its point is the labels' origin
    loader = DataLoader(data, batch_size=args.batch, shuffle=args.kind != "decide_on_data",
                        num_workers=args.workers, pin_memory=True, drop_last=True)
    width = 784 if args.kind == "mnist" else 32
    model = nn.Sequential(nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
best = float("inf")
for step, batch in enumerate(loader):
    if step == args.steps:
        break
    opt.zero_grad()
    if args.kind == "tokens":
        ids, mask = (t.to(device) for t in batch)
        logits = model(ids, mask)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    else:
        x, y = batch
        if args.kind == "decide_on_data" and int(y.max()) >= 10:  # a value from the dataset
            raise SystemExit("bad label")
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    loss.backward()
    opt.step()
    if args.kind == "decide_on_data" and loss.item() < best:  # a value from the model
        best = loss.item()
    print(f"step {step} loss {loss.item():.3f}")
