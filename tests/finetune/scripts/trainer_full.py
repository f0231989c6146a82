"""A full fine-tune with the Transformers ``Trainer``, as its guides write one: a pretrained
causal LM from ``from_pretrained`` (the checkpoint's own dtype, transformers' default), every
parameter trained with ``optim="adamw_torch_fused"``, ``gradient_checkpointing=True``, bf16, a
``datasets.Dataset`` tokenised with truncation and padding to ``--seq-len`` tokens."""

import argparse
import random
import tempfile

from datasets import Dataset
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
parser.add_argument("--no-gradient-checkpointing", action="store_true")
parser.add_argument("--cpu", action="store_true", help="train on the CPU (a check without a GPU)")
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model)

rng = random.Random(1)
vocabulary = "a fine tune updates every weight of the network with the gradient of its loss".split()
# each document longer than a block: every row is padded or truncated to exactly --seq-len
docs = [" ".join(rng.choice(vocabulary) for _ in range(args.seq_len + 16)) for _ in range(64)]
dataset = Dataset.from_dict({"text": docs}).map(
    lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.seq_len,
                            padding="max_length"),
    batched=True, remove_columns=["text"])

training_args = TrainingArguments(
    output_dir=tempfile.mkdtemp(prefix="full-"),
    per_device_train_batch_size=args.batch_size,
    learning_rate=1e-5,
    max_steps=args.max_steps,
    optim="adamw_torch_fused",
    gradient_checkpointing=not args.no_gradient_checkpointing,
    bf16=True,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=args.cpu,
)
trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                  processing_class=tokenizer)
trainer.train()
