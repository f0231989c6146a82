"""timm's training loop in miniature: ``create_model`` / ``create_optimizer_v2``, the model moved
with ``model.to(device=device)`` (as timm's train.py does), channels-last, AMP through
``torch.autocast`` with timm's ``NativeScaler``, Mixup with a soft-target loss."""

import argparse

import timm
import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.utils import NativeScaler


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="vit_tiny_patch16_224")
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--opt", default="adamw")
    parser.add_argument("--amp-dtype", default="float16")
    parser.add_argument("--channels-last", action="store_true", default=True)
    parser.add_argument("--steps", type=int, default=6)
    return parser.parse_args(argv)


def build_model(args):
    kwargs = {"img_size": args.img_size} if "vit" in args.model else {}
    return timm.create_model(args.model, pretrained=False, num_classes=args.num_classes,
                             **kwargs)


def build_optimizer(args, model):
    return create_optimizer_v2(model, args.opt, lr=1e-3, weight_decay=0.05)


def main():
    args = parse()
    device = torch.device("cuda")
    model = build_model(args)
    model.to(device=device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(args, model)
    loss_scaler = NativeScaler()
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=args.num_classes)
    criterion = SoftTargetCrossEntropy()
    amp_dtype = getattr(torch, args.amp_dtype)
    model.train()
    for step in range(args.steps):
        images = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
        target = torch.randint(0, args.num_classes, (args.batch_size,))
        images, target = images.to(device), target.to(device)
        images, target = mixup(images, target)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=amp_dtype):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad()
        loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
        print(f"step {step} loss {loss.item():.3f} lr {optimizer.param_groups[0]['lr']}")


if __name__ == "__main__":
    main()
