"""A ViT-style encoder block trained on the GPU: ``nn.MultiheadAttention`` (batch first, weights
not returned, as torchvision's EncoderBlock calls it) between layer norms, then an MLP."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--tokens", type=int, default=50)
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--heads", type=int, default=2)
args = parser.parse_args()


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(width)
        self.attention = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


model = torch.nn.Sequential(Block(args.width, args.heads), Block(args.width, args.heads)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(args.steps):
    x = torch.randn(args.batch, args.tokens, args.width, device="cuda")
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
