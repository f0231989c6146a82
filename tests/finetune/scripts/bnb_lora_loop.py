"""A LoRA fine-tune of a quantized causal LM in a plain PyTorch loop, as PEFT's docs show it for
a model loaded with bitsandbytes: 4-bit (``--bits 4``, FP4 or NF4, with or without double
quantization) or LLM.int8() 8-bit (``--bits 8``, ``Linear8bitLt``), the adapters stepped by
``torch.optim.AdamW`` or one of bitsandbytes' optimizers.

    python bnb_lora_loop.py CHECKPOINT [--bits 4|8] [--quant-type fp4|nf4] [--double-quant]
        [--threshold 0.0] [--optim adamw|adamw8bit|paged_adamw8bit] [--batch-size 2]
        [--seq-len 64] [--steps 3]
"""

import argparse

import bitsandbytes as bnb
import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint")
parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
parser.add_argument("--quant-type", default="fp4")
parser.add_argument("--double-quant", action="store_true")
parser.add_argument("--threshold", type=float, default=0.0)
parser.add_argument("--optim", default="adamw")
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

if args.bits == 4:
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.quant_type,
                                      bnb_4bit_use_double_quant=args.double_quant,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
else:
    quantization = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=args.threshold)
model = AutoModelForCausalLM.from_pretrained(args.checkpoint, quantization_config=quantization,
                                             dtype=torch.float16 if args.bits == 8 else None)
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "v_proj"]))

params = [p for p in model.parameters() if p.requires_grad]
optimizers = {"adamw": torch.optim.AdamW, "adamw8bit": bnb.optim.AdamW8bit,
              "paged_adamw8bit": bnb.optim.PagedAdamW8bit}
optimizer = optimizers[args.optim](params, lr=1e-4)

vocab = model.config.vocab_size
model.train()
for step in range(args.steps):
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.3f}")
