"""TRL's ``DPOTrainer`` as its documentation writes it: the policy loaded with
``AutoModelForCausalLM.from_pretrained``, a preference dataset (``prompt``, ``chosen``,
``rejected``) in memory, ``DPOConfig``. By default with a LoRA adapter (``peft_config``): the
reference model is then the policy with its adapter disabled. ``--no-peft``: every weight is
trained and the reference is a second copy of the checkpoint, loaded the same way and passed as
``ref_model``."""

import argparse
import random
import tempfile

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a local checkpoint folder")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=1024)
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--no-peft", action="store_true", help="full fine-tune, a second copy as reference")
parser.add_argument("--cpu", action="store_true", help="train on the CPU (a check without a GPU)")
args = parser.parse_args()

model = AutoModelForCausalLM.from_pretrained(args.model)
tokenizer = AutoTokenizer.from_pretrained(args.model)
ref_model = AutoModelForCausalLM.from_pretrained(args.model) if args.no_peft else None

rng = random.Random(4)
words = "which answer is better the first one is kind and correct the second one is not".split()


def sentence(n):
    return " ".join(rng.choice(words) for _ in range(n))


# prompts of a quarter of the length, answers filling the rest
preferences = Dataset.from_dict({
    "prompt": [sentence(args.seq_len // 4) + "?" for _ in range(64)],
    "chosen": [sentence(args.seq_len) + "." for _ in range(64)],
    "rejected": [sentence(args.seq_len) + "!" for _ in range(64)],
})

training_args = DPOConfig(
    output_dir=tempfile.mkdtemp(prefix="dpo-"),
    per_device_train_batch_size=args.batch_size,
    max_length=args.seq_len,
    max_steps=args.max_steps,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=args.cpu,
    bf16=not args.cpu,
)
peft_config = None if args.no_peft else LoraConfig(
    r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    task_type="CAUSAL_LM")
trainer = DPOTrainer(model=model, ref_model=ref_model, args=training_args,
                     train_dataset=preferences, processing_class=tokenizer,
                     peft_config=peft_config)
trainer.train()
