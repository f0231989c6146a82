"""Three generations, the later two from prompts 8 tokens longer than the first, with a model
that, once the cache holds 64 keys or more, makes a 256 MiB buffer at each step that starts
with a multiple of 8 keys, kept until the generation ends. The first generation never reaches
64 keys; the later ones reach them at one position of the period, at step 42 of 48."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                     max_position_embeddings=256, eos_token_id=0, pad_token_id=0)
model = LlamaForCausalLM(config).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
kept = []


def every_eighth_key_past_64(module, inputs, kwargs):
    cache = kwargs.get("past_key_values")
    if cache is not None:
        keys = cache.get_seq_length()
        if keys >= 64 and keys % 8 == 0:
            kept.append(torch.empty(64 << 20, device="cuda"))  # 256 MiB of float32


model.register_forward_pre_hook(every_eighth_key_past_64, with_kwargs=True)
for prompt_length in (16, 24, 24):
    prompts = torch.randint(1, 256, (4, prompt_length), device="cuda")
    with torch.no_grad():
        completions = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                     do_sample=True, max_new_tokens=48)
    kept.clear()
    model(completions, attention_mask=torch.ones_like(completions),
          labels=completions).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
