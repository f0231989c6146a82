"""A Hugging Face Trainer job with a DeepSpeed ZeRO config (``--stage``), the way such jobs are
written: the Trainer hands the model and optimizer to DeepSpeed through Accelerate. With
``--stage 3`` the model is built under ``HfDeepSpeedConfig`` (transformers' ZeRO-3 integration:
``from_config``/``from_pretrained`` construct it inside ``deepspeed.zero.Init``).
``--no-deepspeed`` trains the same model without it (DeepSpeed still imported)."""

import argparse

import deepspeed  # noqa: F401  (imported by jobs that use it, whether or not they do)
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.integrations import HfDeepSpeedConfig

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--no-deepspeed", action="store_true")
parser.add_argument("--out", default="/tmp/xmem-hf-deepspeed")
args = parser.parse_args()

ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": args.stage}}
config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
if args.stage == 3 and not args.no_deepspeed:
    keep = HfDeepSpeedConfig(ds_config)  # must live while the model is built
    model = GPT2LMHeadModel._from_config(config)
else:
    model = GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 512, (32,))
        return {"input_ids": ids, "labels": ids}


training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=4, max_steps=3,
                             deepspeed=None if args.no_deepspeed else ds_config, report_to=[],
                             save_strategy="no", use_cpu=False)
Trainer(model=model, args=training, train_dataset=Tokens()).train()
