"""A pretrained causal LM loaded with ``from_pretrained`` and moved to the GPU, its values
checked: each buffer the checkpoint does not hold (non-persistent ones: a rotary embedding's
``inv_freq``) must equal the same buffer of the model built from its config alone, as on a GPU
machine. A mismatch ends the script with the buffers that differ; else it trains a few steps."""

import argparse
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a checkpoint folder")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model),
                                         dtype=torch.bfloat16)
expected = dict(built.named_buffers())
loaded = dict(model.named_buffers())
wrong = sorted(name for name, value in expected.items()
               if name not in loaded or not torch.equal(loaded[name], value))
if not expected or wrong:
    sys.exit(f"buffers that differ from the model built from its config: {wrong or 'none held'}")
print(f"buffers: {len(expected)} equal to the model built from its config", file=sys.stderr)

model.to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.arange(32, device="cuda").reshape(2, 16) % model.config.vocab_size
for _ in range(args.steps):
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
