"""TRL's ``SFTTrainer`` with a LoRA adapter (``peft_config=LoraConfig(...)``), as TRL's
documentation writes it: the model given by its path, an in-memory ``datasets.Dataset``,
``SFTConfig`` for the rest. Variants, one flag each:

- default: a language-modeling dataset (``text``), every row padded or truncated to
  ``max_length``;
- ``--packing``: the same rows packed into ``max_length`` blocks (``packing=True``);
- ``--padding-free``: rows flattened into one sequence per batch (``padding_free=True``; the rows
  are tokenised and truncated first, as TRL asks when ``max_length`` is not enforced);
- ``--completion-only``: a prompt/completion dataset with ``completion_only_loss=True``;
- ``--liger``: ``use_liger_kernel=True`` (Liger's Triton kernels).
"""

import argparse
import random
import tempfile

from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a local checkpoint folder")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=1024)
parser.add_argument("--max-steps", type=int, default=100)
variant = parser.add_mutually_exclusive_group()
variant.add_argument("--packing", action="store_true")
variant.add_argument("--padding-free", action="store_true")
variant.add_argument("--completion-only", action="store_true")
variant.add_argument("--liger", action="store_true")
parser.add_argument("--cpu", action="store_true", help="train on the CPU (a check without a GPU)")
args = parser.parse_args()

rng = random.Random(3)
words = "supervised tuning teaches the model to answer each question with a short reply".split()


def sentence(n):
    return " ".join(rng.choice(words) for _ in range(n))


if args.completion_only:
    dataset = Dataset.from_dict({
        "prompt": [sentence(args.seq_len // 4) + "?" for _ in range(64)],
        "completion": [sentence(args.seq_len // 2) + "." for _ in range(64)],
    })
else:
    # rows of different lengths, most longer than a block, some shorter
    dataset = Dataset.from_dict({"text": [sentence(rng.randint(args.seq_len // 4, args.seq_len))
                                          for _ in range(64)]})

config = SFTConfig(
    output_dir=tempfile.mkdtemp(prefix="sft-"),
    per_device_train_batch_size=args.batch_size,
    max_steps=args.max_steps,
    max_length=None if args.padding_free else args.seq_len,
    packing=args.packing,
    padding_free=args.padding_free,
    completion_only_loss=True if args.completion_only else None,
    use_liger_kernel=args.liger,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=args.cpu,
    bf16=not args.cpu,
)
if args.padding_free:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = dataset.map(lambda row: tokenizer(row["text"], truncation=True,
                                                max_length=args.seq_len),
                          remove_columns=["text"])

trainer = SFTTrainer(
    model=args.model,
    args=config,
    train_dataset=dataset,
    peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           task_type="CAUSAL_LM"),
)
trainer.train()
