"""torchvision's ImageFolder over a folder of generated images (made by the script, as a
dataset-preparation step would), torchvision transforms, a DataLoader with workers over a
1M-index shuffle (``Subset`` over the images repeated, ``shuffle=True``: a ``randperm`` of 1M,
no DistributedSampler), a torchvision ResNet, SGD with momentum."""

import argparse
import os
import tempfile

import numpy as np
import torch
import torchvision
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--indices", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda:0", help="cpu: the plain CPU run, for timing")
    return parser.parse_args(argv)


def make_folder(root, classes=3, per_class=8):
    rng = np.random.default_rng(0)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c}"), exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(80, 96, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, f"class{c}", f"{i}.png"))


def build_model(args):
    return torchvision.models.__dict__[args.arch](num_classes=3)


def build_optimizer(args, model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def main():
    args = parse()
    root = args.root or tempfile.mkdtemp(prefix="imagefolder-")
    make_folder(root)
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    folder = datasets.ImageFolder(root, transforms.Compose([
        transforms.RandomResizedCrop(64), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    repeated = Subset(folder, [i % len(folder) for i in range(args.indices)])
    loader = DataLoader(repeated, batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, pin_memory=True)
    device = torch.device(args.device)
    model = build_model(args).to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = build_optimizer(args, model)
    model.train()
    for i, (images, target) in enumerate(loader):
        if i == args.steps:
            break
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"[{i}] loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
