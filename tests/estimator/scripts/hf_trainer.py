"""Hugging Face Trainer on a tiny GPT-2 built from a config, synthetic tokens (no network)."""

import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
model = GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (32,))
        return {"input_ids": ids, "labels": ids.clone()}


out = tempfile.mkdtemp()
args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=10,
                         logging_steps=1, save_strategy="no", report_to=[],
                         dataloader_num_workers=0, gradient_accumulation_steps=2)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.train()
with open(os.path.join(out, "finished"), "w") as fh:
    fh.write("done")
