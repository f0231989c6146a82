"""A LoRA fine-tune as the PEFT quicktour writes it, in a plain PyTorch loop: a pretrained causal
LM loaded with ``from_pretrained`` in bf16 (a local folder or a Hub id), ``get_peft_model`` with
``LoraConfig`` on the attention projections, moved to the GPU, AdamW on the adapter's parameters,
batches tokenised with the checkpoint's own tokenizer."""

import argparse
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a checkpoint folder or a Hub model id")
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=128)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--lora-r", type=int, default=8)
parser.add_argument("--device-map", default=None, help='e.g. "cuda" or "auto"')
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
started = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                             device_map=args.device_map)
print(f"from_pretrained: {time.perf_counter() - started:.2f} s", file=sys.stderr)
lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
model = get_peft_model(model, lora)
model.print_trainable_parameters()
if args.device_map is None:  # else from_pretrained placed it
    model.to("cuda")
model.train()

optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
texts = ["the quick brown fox jumps over the lazy dog and the model learns from it"] * args.batch_size
for step in range(args.steps):
    batch = tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                      max_length=args.seq_len).to("cuda")
    outputs = model(**batch, labels=batch["input_ids"])
    outputs.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {outputs.loss.item():.4f}")
