"""TRL's other trainers as its documentation writes them, the model given by its path and a
dataset in memory (``--trainer``):

- ``reward``: ``RewardTrainer`` on ``chosen``/``rejected`` texts (a sequence-classification head
  with one output);
- ``kto``: ``KTOTrainer`` on prompts and completions labelled desirable or not (a reference
  model: the adapter-disabled policy with ``--peft``, a second copy without);
- ``rloo``: ``RLOOTrainer`` with its own generation (two completions per prompt, half of
  ``--seq-len`` each) and a reward function;
- ``dpo-ipo``: ``DPOTrainer`` with ``loss_type=["ipo"]``.

``--peft`` trains a LoRA adapter (r 16, q/v) instead of every weight."""

import argparse
import random
import tempfile

from datasets import Dataset
from peft import LoraConfig

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a local checkpoint folder")
parser.add_argument("--trainer", required=True, choices=["reward", "kto", "rloo", "dpo-ipo"])
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=1024)
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--peft", action="store_true")
args = parser.parse_args()

rng = random.Random(7)
words = "a helpful answer says what the user asked for and nothing else".split()


def sentence(n):
    return " ".join(rng.choice(words) for _ in range(n))


peft_config = LoraConfig(
    r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
    task_type="SEQ_CLS" if args.trainer == "reward" else "CAUSAL_LM") if args.peft else None
common = dict(output_dir=tempfile.mkdtemp(prefix=f"{args.trainer}-"),
              per_device_train_batch_size=args.batch_size, max_steps=args.max_steps,
              logging_steps=1, save_strategy="no", report_to="none", bf16=True)
# texts of a few words per token budget: the trainers drop or truncate longer rows
few = max(1, args.seq_len // 8)

if args.trainer == "reward":
    from trl import RewardConfig, RewardTrainer

    pairs = Dataset.from_dict({"chosen": [sentence(few) for _ in range(64)],
                               "rejected": [sentence(few) for _ in range(64)]})
    trainer = RewardTrainer(model=args.model, args=RewardConfig(max_length=args.seq_len, **common),
                            train_dataset=pairs, peft_config=peft_config)
elif args.trainer == "kto":
    from trl import KTOConfig, KTOTrainer

    labelled = Dataset.from_dict({"prompt": [sentence(few) for _ in range(64)],
                                  "completion": [sentence(few) for _ in range(64)],
                                  "label": [i % 2 == 0 for i in range(64)]})
    trainer = KTOTrainer(model=args.model, args=KTOConfig(max_length=args.seq_len, **common),
                         train_dataset=labelled, peft_config=peft_config)
elif args.trainer == "rloo":
    from trl import RLOOConfig, RLOOTrainer

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    prompts = Dataset.from_dict({"prompt": [sentence(few) for _ in range(64)]})
    trainer = RLOOTrainer(model=args.model, reward_funcs=reward_len,
                          args=RLOOConfig(num_generations=2,
                                          max_completion_length=args.seq_len // 2, **common),
                          train_dataset=prompts, peft_config=peft_config)
else:
    from trl import DPOConfig, DPOTrainer

    preferences = Dataset.from_dict({"prompt": [sentence(few) for _ in range(64)],
                                     "chosen": [sentence(few) for _ in range(64)],
                                     "rejected": [sentence(few) for _ in range(64)]})
    trainer = DPOTrainer(model=args.model,
                         args=DPOConfig(loss_type=["ipo"], max_length=args.seq_len, **common),
                         train_dataset=preferences, peft_config=peft_config)
trainer.train()
