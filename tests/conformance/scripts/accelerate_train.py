"""A Hugging Face ``accelerate`` loop: ``Accelerator(mixed_precision="bf16")``, ``prepare`` of
model, optimizer and DataLoader, ``accelerator.backward``, ``accumulate`` for gradient
accumulation, a transformers model built from its config."""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    return parser.parse_args(argv)


def build_model(args):
    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=256, num_labels=3,
                        max_position_embeddings=128)
    return BertForSequenceClassification(config)


def build_optimizer(args, model):
    return torch.optim.AdamW(model.parameters(), lr=2e-5)


def main():
    args = parse()
    accelerator = Accelerator(mixed_precision="bf16",
                              gradient_accumulation_steps=args.accumulation)
    n = args.batch_size * args.steps * args.accumulation
    ids = torch.randint(0, 1000, (n, args.seq_len))
    dataset = TensorDataset(ids, torch.ones_like(ids), torch.randint(0, 3, (n,)))
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=2)
    model = build_model(args)
    optimizer = build_optimizer(args, model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for step, (input_ids, attention_mask, labels) in enumerate(loader):
        with accelerator.accumulate(model):
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print(f"step {step} on {accelerator.device} loss {out.loss.item():.3f}")


if __name__ == "__main__":
    main()
