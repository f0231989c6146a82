"""A step that generates text before training on it, with a model whose sampling steps change
once the cache holds ``--from-keys`` keys: from then on each step also makes a 4 MiB buffer
(as a model might switch to another attention path for long contexts). The steps before that
repeat, so the probe's generation step writing reads a rule from them that the later steps do
not follow."""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--new-tokens", type=int, default=48)
parser.add_argument("--from-keys", type=int, default=56)
args = parser.parse_args()

config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                     max_position_embeddings=256, eos_token_id=0, pad_token_id=0)
model = LlamaForCausalLM(config).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)


def long_context_buffer(module, inputs, kwargs):
    cache = kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length() >= args.from_keys:
        module.buffer = torch.empty(1 << 20, device="cuda")  # 4 MiB of float32, each step


model.register_forward_pre_hook(long_context_buffer, with_kwargs=True)
prompts = torch.randint(1, 256, (4, 16), device="cuda")
for _step in range(3):
    with torch.no_grad():
        completions = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                     do_sample=True, max_new_tokens=args.new_tokens)
    model.buffer = None
    model(completions, attention_mask=torch.ones_like(completions),
          labels=completions).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
