"""Train a torchvision image classifier for a few steps on random images.

A plain PyTorch training loop with nothing of xmem in it: this is the kind of script users hand to
``xmem estimate -- python examples/train_cnn.py ...``. It runs on a GPU when there is one and on
the CPU otherwise. The data is synthetic (random images and labels, made on the host and copied to
the device the way a data loader's batches are), so nothing is downloaded.

Example:
    python examples/train_cnn.py --model resnet50 --batch-size 32 --optimizer sgd --steps 5
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch
import torchvision
from torch import nn

OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def classifier_names() -> List[str]:
    """The image classifiers torchvision can build by name (detection, video... excluded)."""
    return torchvision.models.list_models(module=torchvision.models)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18",
                        help="any torchvision classifier name, e.g. resnet50, vit_b_16, "
                        "efficientnet_b0 (default: resnet18)")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--optimizer", type=str.lower, default="sgd", choices=sorted(OPTIMIZERS),
                        help="case-insensitive (default: sgd)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("--amp", choices=sorted(AMP_DTYPES),
                        help="mixed precision with torch.autocast (fp16 adds a GradScaler)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.model not in classifier_names():
        parser.error(f"unknown torchvision classifier {args.model!r}; "
                     f"choose one of: {', '.join(classifier_names())}")
    for flag in ("num_classes", "batch_size", "image_size", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    model = torchvision.models.get_model(args.model, weights=None, num_classes=args.num_classes)
    model = model.to(device)
    model.train()
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    amp_dtype = AMP_DTYPES.get(args.amp)
    # fp16 gradients can underflow: scale the loss. A disabled scaler passes everything through.
    # torch.amp.GradScaler from 2.3; torch 2.2 has CUDA's own only
    scaler = (torch.amp.GradScaler(device, enabled=args.amp == "fp16")
              if hasattr(torch.amp, "GradScaler")
              else torch.cuda.amp.GradScaler(enabled=args.amp == "fp16"))

    # Random batches stand in for a data loader: built on the host, then copied to the device.
    data = torch.Generator().manual_seed(args.seed)
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    for step in range(1, args.steps + 1):
        images = torch.randn(shape, generator=data).to(device)
        labels = torch.randint(0, args.num_classes, (args.batch_size,), generator=data).to(device)

        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=amp_dtype, enabled=amp_dtype is not None):
            output = model(images)
            # Inception-style models also return auxiliary logits while training.
            logits = output.logits if hasattr(output, "logits") else output
            loss = loss_fn(logits, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
