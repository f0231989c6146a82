"""nanoGPT's train.py loop in miniature: a GPT with tied embeddings, bf16 autocast through a
``nullcontext``-or-autocast ``ctx``, fused AdamW with decayed and undecayed groups, gradient
accumulation (``loss / gradient_accumulation_steps``), ``torch.compile``, gradient clipping,
batches sliced from a token array with ``torch.from_numpy`` and ``pin_memory().to(device,
non_blocking=True)``."""

import argparse
import inspect
import math
from contextlib import nullcontext

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--compile", type=int, default=1)
    parser.add_argument("--max-iters", type=int, default=6)
    return parser.parse_args(argv)


class CausalSelfAttention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.c_attn = nn.Linear(a.n_embd, 3 * a.n_embd)
        self.c_proj = nn.Linear(a.n_embd, a.n_embd)
        self.n_head, self.n_embd = a.n_head, a.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(a.n_embd), nn.LayerNorm(a.n_embd)
        self.attn = CausalSelfAttention(a)
        self.mlp = nn.Sequential(nn.Linear(a.n_embd, 4 * a.n_embd), nn.GELU(),
                                 nn.Linear(4 * a.n_embd, a.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(a.vocab_size, a.n_embd), wpe=nn.Embedding(a.block_size, a.n_embd),
            h=nn.ModuleList([Block(a) for _ in range(a.n_layer)]), ln_f=nn.LayerNorm(a.n_embd)))
        self.lm_head = nn.Linear(a.n_embd, a.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * a.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        groups = [{"params": [p for p in params.values() if p.dim() >= 2],
                   "weight_decay": weight_decay},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas,
                                 **({"fused": True} if use_fused else {}))


def build_model(args):
    return GPT(args)


def build_optimizer(args, model, device_type="cuda"):
    return model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device_type)


def main():
    args = parse()
    device = "cuda"
    device_type = "cuda" if "cuda" in device else "cpu"
    dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() \
        else "float16"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type,
                                                                        dtype=ptdtype)
    torch.backends.cuda.matmul.allow_tf32 = True
    data = np.random.default_rng(0).integers(0, args.vocab_size, 100_000).astype(np.uint16)

    def get_batch():
        ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64))
                         for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64))
                         for i in ix])
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))

    model = build_model(args)
    model.to(device)
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))  # as nanoGPT writes it
    optimizer = build_optimizer(args, model, device_type)
    if args.compile:
        model = torch.compile(model)
    X, Y = get_batch()
    for it in range(args.max_iters):
        for _micro_step in range(args.gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / args.gradient_accumulation_steps
            X, Y = get_batch()
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        print(f"iter {it}: loss {loss.item() * args.gradient_accumulation_steps:.4f}")


if __name__ == "__main__":
    main()
