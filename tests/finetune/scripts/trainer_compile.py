"""A ``torch.compile``d fine-tune, both ways users write it: ``--style trainer`` (default) asks
the Transformers ``Trainer`` for it with ``TrainingArguments(torch_compile=True)``; ``--style
loop`` compiles the pretrained model itself, ``model = torch.compile(model)``, and trains it in
a hand-written loop with ``torch.optim.AdamW`` under bf16 autocast."""

import argparse
import random
import tempfile

import torch
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
parser.add_argument("--style", choices=("trainer", "loop"), default="trainer")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=1024)
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--cpu", action="store_true", help="train on the CPU (a check without a GPU)")
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

rng = random.Random(2)
words = "compiled graphs fuse the kernels of every layer into fewer launches".split()
rows = [" ".join(rng.choice(words) for _ in range(args.seq_len + 8)) for _ in range(64)]
dataset = Dataset.from_dict({"text": rows}).map(
    lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.seq_len),
    batched=True, remove_columns=["text"])
collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)

if args.style == "trainer":
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="compile-"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        torch_compile=True,
        bf16=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=args.cpu,
    )
    Trainer(model=model, args=training_args, train_dataset=dataset,
            data_collator=collator).train()
else:
    device = "cpu" if args.cpu else "cuda"
    model.to(device)
    model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                         collate_fn=collator)
    model.train()
    for step, batch in enumerate(loader):
        if step == args.max_steps:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.3f}")
