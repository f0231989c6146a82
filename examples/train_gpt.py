"""Train a GPT/Llama-style decoder language model for a few steps on random tokens.

The model is written out in plain PyTorch so that every tensor it makes is visible: token
embeddings, then ``--layers`` pre-norm blocks (RMSNorm, causal self-attention with rotary
positions and grouped-query heads, SwiGLU MLP), a final RMSNorm and an untied LM head. Training
supports mixed precision, activation checkpointing and gradient accumulation, the knobs that move
GPU memory most. Nothing of xmem is imported: this is a user's script, run unmodified by
``xmem estimate -- python examples/train_gpt.py ...``. GPU when there is one, CPU otherwise.

Examples:
    # GPT-style 1.3B
    python examples/train_gpt.py --layers 24 --hidden 2048 --heads 16 --vocab 50257 \\
        --batch-size 8 --seq-len 1024 --optimizer adamw
    # Llama-2-7B shapes, bf16, one sequence of 4096 tokens
    python examples/train_gpt.py --layers 32 --hidden 4096 --heads 32 --intermediate 11008 \\
        --vocab 32000 --batch-size 1 --seq-len 4096 --amp bf16 --optimizer adamw
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def llama_intermediate(hidden: int, multiple_of: int = 256) -> int:
    """Llama's MLP width: 2/3 of 4*hidden (SwiGLU has three matrices, not two), rounded up.

    With this width a SwiGLU MLP has about as many parameters as a GPT MLP of width 4*hidden.
    """
    width = int(2 * 4 * hidden / 3)
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias), computed in float32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, base: float = 10000.0) -> Tuple[torch.Tensor, ...]:
    """cos and sin of the rotary angles, one row per position, ``[seq_len, head_dim]`` each."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` (``[batch, heads, seq, head_dim]``) by position."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal self-attention; ``kv_heads < heads`` shares each key/value head among a group."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_heads != self.heads:
            # Grouped-query attention: repeat each key/value head for its group of query heads.
            group = self.heads // self.kv_heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """The gated MLP of Llama: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-norm decoder layer: attention then MLP, each added back onto the residual."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, intermediate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model with untied input embeddings and LM head."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.grad_ckpt = args.grad_ckpt
        self.embed = nn.Embedding(args.vocab, args.hidden)
        self.blocks = nn.ModuleList(
            Block(args.hidden, args.heads, args.kv_heads, args.intermediate)
            for _ in range(args.layers)
        )
        self.norm = RMSNorm(args.hidden)
        self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)
        cos, sin = rotary_tables(args.hidden // args.heads, args.seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation: small normal weights, so the first loss is close to ln(vocab).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for block in self.blocks:
            if self.grad_ckpt and self.training:
                # Keep only each block's input; recompute its insides during backward.
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    parser.add_argument("--intermediate", type=int,
                        help="MLP width (default: Llama's rule, 8/3 * hidden rounded up to 256)")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--optimizer", type=str.lower, default="adamw", choices=sorted(OPTIMIZERS),
                        help="case-insensitive (default: adamw)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--amp", choices=sorted(AMP_DTYPES),
                        help="mixed precision with torch.autocast (fp16 adds a GradScaler)")
    parser.add_argument("--grad-ckpt", action="store_true",
                        help="activation checkpointing, one checkpoint per block")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", choices=("none", "ddp", "fsdp2"), default="none",
                        help="data parallelism under torchrun: DistributedDataParallel, or FSDP2 "
                        "(fully_shard on each block, then on the model)")
    args = parser.parse_args(argv)

    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.intermediate is None:
        args.intermediate = llama_intermediate(args.hidden)
    for flag in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "seq_len",
                 "batch_size", "grad_accum", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if (args.hidden // args.heads) % 2:
        parser.error("rotary positions need an even head size (--hidden / --heads)")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def distribute(model: nn.Module, parallel: str, device: str) -> nn.Module:
    """DDP or FSDP2 over the process group torchrun describes (NCCL on GPUs)."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    model: nn.Module = GPT(args).to(device)
    model.train()
    if args.parallel != "none":
        model = distribute(model, args.parallel, device)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), lr=args.lr)

    amp_dtype = AMP_DTYPES.get(args.amp)
    # fp16 gradients can underflow: scale the loss. A disabled scaler passes everything through.
    # torch.amp.GradScaler from 2.3; torch 2.2 has CUDA's own only
    scaler = (torch.amp.GradScaler(device, enabled=args.amp == "fp16")
              if hasattr(torch.amp, "GradScaler")
              else torch.cuda.amp.GradScaler(enabled=args.amp == "fp16"))

    # Random tokens stand in for a data loader: drawn on the host, then copied to the device.
    data = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for _ in range(args.grad_accum):
            tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=data)
            tokens = tokens.to(device)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            with torch.autocast(device_type=device, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(inputs)
                loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
                loss = loss / args.grad_accum
            scaler.scale(loss).backward()
            step_loss += loss.detach()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step}/{args.steps} loss {step_loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
