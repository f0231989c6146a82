"""What the tracker scripts share: a small Llama checkpoint fine-tuned by transformers' Trainer.

Run under the probe, the model goes to the (virtual) GPU as the Trainer puts it there; run
with ``--cpu`` (plain Python, no probe), the same script trains on the CPU, which is how the
tests show that the script does reach the tracker or the Hub when nothing turns it off.
"""

import argparse


def arguments(description):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="a checkpoint folder (save_pretrained)")
    parser.add_argument("--output", required=True, help="the Trainer's output_dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (no probe)")
    return parser


def train(options, report_to, **extra):
    """Fine-tune ``options.model`` for ``options.steps`` steps, reporting to ``report_to``."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    torch.manual_seed(0)
    data = [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
            for ids in torch.randint(4, 400, (8, 32))]
    args = TrainingArguments(output_dir=options.output, per_device_train_batch_size=2,
                             max_steps=options.steps, learning_rate=1e-4, logging_steps=1,
                             report_to=report_to, use_cpu=options.cpu, **extra)
    Trainer(model=model, args=args, train_dataset=data).train()
