"""A Hugging Face ``Trainer`` fine-tuning loop: a tokenizer built with the ``tokenizers`` library
(word-level, trained on the script's own text) wrapped as ``PreTrainedTokenizerFast``, a
dataset tokenised in Python, ``DataCollatorForLanguageModeling`` (padding, labels), a GPT-2
model from its config, ``TrainingArguments`` with bf16, gradient accumulation and dataloader
workers."""

import argparse
import tempfile

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=6)
    return parser.parse_args(argv)


TEXT = [f"sample {i} says the quick brown fox jumps over {i % 7} lazy dogs" * (1 + i % 3)
        for i in range(2000)]


def build_tokenizer():
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def build_model(args):
    config = GPT2Config(vocab_size=len(build_tokenizer()), n_positions=128, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=4)
    return GPT2LMHeadModel(config)


def build_optimizer(args, model):
    return None  # the Trainer builds AdamW itself


class TextDataset(torch.utils.data.Dataset):
    def __init__(self, tokenizer):
        self.items = [tokenizer(t, truncation=True, max_length=64)["input_ids"] for t in TEXT]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def main():
    args = parse()
    tokenizer = build_tokenizer()
    model = build_model(args)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="trainer-"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation, max_steps=args.max_steps, bf16=True,
        logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=2)
    trainer = Trainer(model=model, args=training_args, train_dataset=TextDataset(tokenizer),
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()


if __name__ == "__main__":
    main()
