"""QLoRA as bitsandbytes' and PEFT's docs show it: a causal LM loaded in 4-bit
(``BitsAndBytesConfig``), ``prepare_model_for_kbit_training``, LoRA adapters on every linear
layer, a few steps of the Hugging Face ``Trainer``.

    python bnb_qlora_trainer.py CHECKPOINT [--quant-type nf4|fp4] [--no-double-quant]
        [--optim adamw_torch|paged_adamw_8bit|...] [--batch-size 2] [--seq-len 64] [--steps 3]
"""

import argparse

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint")
parser.add_argument("--quant-type", default="nf4")
parser.add_argument("--no-double-quant", action="store_true")
parser.add_argument("--optim", default="adamw_torch")
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", default="/tmp/bnb-qlora-out")
args = parser.parse_args()

bnb_config = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type=args.quant_type,
    bnb_4bit_use_double_quant=not args.no_double_quant,
    bnb_4bit_compute_dtype=torch.bfloat16,
)
model = AutoModelForCausalLM.from_pretrained(args.checkpoint, quantization_config=bnb_config,
                                             dtype=torch.bfloat16)
model = prepare_model_for_kbit_training(model)
lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                  "up_proj", "down_proj"])
model = get_peft_model(model, lora)

vocab = model.config.vocab_size
rows = [{"input_ids": [(i * 7 + j) % vocab for j in range(args.seq_len)]} for i in range(64)]
for row in rows:
    row["labels"] = list(row["input_ids"])
    row["attention_mask"] = [1] * args.seq_len
dataset = Dataset.from_list(rows)

training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=args.batch_size,
                             max_steps=args.steps, learning_rate=2e-4, bf16=True,
                             optim=args.optim, logging_steps=1, save_strategy="no",
                             report_to=[], gradient_checkpointing=True)
trainer = Trainer(model=model, args=training, train_dataset=dataset,
                  data_collator=default_data_collator)
trainer.train()
