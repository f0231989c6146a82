"""A step of online RL as TRL's GRPO takes it: sample completions with ``model.generate``,
decode them to text with the tokenizer, score the text, train on prompt plus completion.

The score is a Python function of the text (its length) by default; ``--reward-model`` scores
``prompt + completion`` with a second model instead, tokenizing the text into tensors as TRL does
for a reward model (``padding=True``: the longest text sets the length). The tokenizer is a BPE
model trained here on a few lines, so the script needs nothing from the network."""

import argparse

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

parser = argparse.ArgumentParser()
parser.add_argument("--reward-model", action="store_true")
args = parser.parse_args()

text = ["the quick brown fox jumps over the lazy dog and the loss falls step by step",
        "attention looks at every token and memory grows with batch and sequence length"] * 20
bpe = Tokenizer(models.BPE(unk_token="<unk>"))
bpe.pre_tokenizer = pre_tokenizers.Metaspace()
bpe.decoder = decoders.Metaspace()
bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>",
                                    pad_token="</s>")

config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(tokenizer), n_positions=128,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
model = GPT2LMHeadModel(config).cuda()
scorer = GPT2ForSequenceClassification(GPT2Config(**{**config.to_dict(), "num_labels": 1})).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
prompts = ["the quick brown fox", "memory grows with"] * 2
ordinary = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
print("longest token characters", max(len(tokenizer.decode([i])) for i in ordinary))
for _step in range(3):
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to("cuda")
    with torch.no_grad():
        sequences = model.generate(**batch, do_sample=True, max_new_tokens=8)
    completions = tokenizer.batch_decode(sequences[:, batch["input_ids"].shape[1]:],
                                         skip_special_tokens=True)
    print("completion characters", [len(c) for c in completions])
    if args.reward_model:
        scored = tokenizer([p + c for p, c in zip(prompts, completions)], return_tensors="pt",
                           padding=True).to("cuda")
        with torch.no_grad():
            rewards = scorer(**scored).logits[:, 0]
    else:
        rewards = torch.tensor([-abs(20 - len(c)) for c in completions], dtype=torch.float32,
                               device="cuda")
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    logits = model(sequences).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(
        -1, sequences[:, 1:, None]).squeeze(-1)
    (-(logprobs.sum(-1) * advantages).mean()).backward()
    optimizer.step()
    optimizer.zero_grad()
