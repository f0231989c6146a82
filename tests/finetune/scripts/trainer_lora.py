"""Transformers ``Trainer`` with a PEFT LoRA adapter, as the PEFT and Transformers guides show
it: a pretrained causal LM loaded in bf16, ``get_peft_model`` with ``LoraConfig(r=16)`` on the
attention projections, a ``datasets.Dataset`` tokenised and grouped into blocks of
``--seq-len`` tokens (the causal language-modeling guide's ``group_texts``), bf16 mixed
precision, ``DataCollatorForLanguageModeling(mlm=False)``."""

import argparse
import random
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a local checkpoint folder")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=1024)
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--lora-r", type=int, default=16)
parser.add_argument("--cpu", action="store_true", help="train on the CPU (a check without a GPU)")
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
model = get_peft_model(model, lora)
model.print_trainable_parameters()

rng = random.Random(0)
words = "the model reads a long document about memory and learns to predict the next word".split()
# enough text for 8 batches of blocks, whatever the batch and block size
n_words = 8 * args.batch_size * args.seq_len
texts = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(n_words // 200 + 1)]
raw = Dataset.from_dict({"text": texts})


def tokenize(batch):
    return tokenizer(batch["text"])


def group_texts(examples):
    joined = {k: sum(examples[k], []) for k in examples}
    total = (len(joined["input_ids"]) // args.seq_len) * args.seq_len
    return {k: [t[i:i + args.seq_len] for i in range(0, total, args.seq_len)]
            for k, t in joined.items()}


tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
blocks = tokenized.map(group_texts, batched=True)

training_args = TrainingArguments(
    output_dir=tempfile.mkdtemp(prefix="lora-"),
    per_device_train_batch_size=args.batch_size,
    learning_rate=2e-4,
    max_steps=args.max_steps,
    bf16=True,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=args.cpu,
)
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=blocks,
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
trainer.train()
