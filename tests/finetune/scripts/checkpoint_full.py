"""A full fine-tune as the Transformers docs' "training in native PyTorch" writes it: a pretrained
causal LM loaded with ``from_pretrained(..., torch_dtype=torch.bfloat16)`` (a local folder or a
Hub id), moved to the GPU, AdamW on every parameter, batches tokenised with the checkpoint's own
tokenizer."""

import argparse
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a checkpoint folder or a Hub model id")
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
started = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
print(f"from_pretrained: {time.perf_counter() - started:.2f} s", file=sys.stderr)
device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
model.to(device)
model.train()

optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
texts = ["a model learns from data and every step the loss falls a little"] * args.batch_size
for step in range(args.steps):
    batch = tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                      max_length=args.seq_len)
    batch = {k: v.to(device) for k, v in batch.items()}
    outputs = model(**batch, labels=batch["input_ids"])
    outputs.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {outputs.loss.item():.4f}")
