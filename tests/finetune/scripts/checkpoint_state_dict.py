"""A plain PyTorch job resuming from a safetensors state dict, as safetensors' docs load one:
``safetensors.torch.load_file`` (onto the host or straight onto the GPU), then
``model.load_state_dict``, the model moved to the GPU, SGD steps on random batches."""

import argparse

import torch
from safetensors.torch import load_file
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True, help="a .safetensors file")
parser.add_argument("--width", type=int, default=2048)
parser.add_argument("--depth", type=int, default=4)
parser.add_argument("--load-device", default="cpu")
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


model = MLP(args.width, args.depth)
model.load_state_dict(load_file(args.checkpoint, device=args.load_device))
model.cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(args.steps):
    x = torch.randn(8, args.width, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
