"""TRL's ``GRPOTrainer`` as its quick start writes it: the model given by its path, a dataset of
prompts in memory, a small reward function (here: completions near 20 characters score best), and
``GRPOConfig`` with TRL's own generation (``use_vllm=False``: ``model.generate`` in the training
process). ``--batch-size`` is the per-device batch of completions, ``--seq-len`` the prompt plus
completion length (half each). ``--peft`` trains a LoRA adapter instead of every weight."""

import argparse
import random
import tempfile

from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a local checkpoint folder")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=1024)
parser.add_argument("--num-generations", type=int, default=4)
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--peft", action="store_true")
parser.add_argument("--cpu", action="store_true", help="train on the CPU (a check without a GPU)")
args = parser.parse_args()

rng = random.Random(5)
words = "write a short poem about the sea and the sky in one line".split()
prompts = Dataset.from_dict({"prompt": [" ".join(rng.choice(words) for _ in range(args.seq_len // 2))
                                        for _ in range(64)]})


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(
    output_dir=tempfile.mkdtemp(prefix="grpo-"),
    per_device_train_batch_size=args.batch_size,
    num_generations=args.num_generations,
    max_completion_length=args.seq_len // 2,
    use_vllm=False,
    max_steps=args.max_steps,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=args.cpu,
    bf16=not args.cpu,
)
trainer = GRPOTrainer(
    model=args.model,
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=prompts,
    peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                 "o_proj"], task_type="CAUSAL_LM")
    if args.peft else None,
)
trainer.train()
