"""A step that generates text with the model before training on it (as online RL trainers do):
``model.generate`` samples up to 8 new tokens, stopping early at the end token."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                    eos_token_id=0, pad_token_id=0)
model = GPT2LMHeadModel(config).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
prompts = torch.randint(1, 256, (4, 16), device="cuda")
for _step in range(3):
    with torch.no_grad():
        completions = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                     do_sample=True, max_new_tokens=8)
    print("generated", tuple(completions.shape))
    model(completions, attention_mask=torch.ones_like(completions),
          labels=completions).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
