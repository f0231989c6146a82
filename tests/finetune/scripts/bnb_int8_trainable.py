"""bitsandbytes' ``Linear8bitLt`` with trainable weights (``has_fp16_weights=True``), as its docs
show for 8-bit training: the weights stay float16 and every forward quantizes them and the
input (LLM.int8()'s ``int8_double_quant`` when the weight needs a gradient).

    python bnb_int8_trainable.py [--width 256] [--batch-size 32] [--steps 3]
"""

import argparse

import bitsandbytes as bnb
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

model = nn.Sequential(bnb.nn.Linear8bitLt(args.width, args.width, has_fp16_weights=True),
                      nn.ReLU(),
                      bnb.nn.Linear8bitLt(args.width, args.width // 4, has_fp16_weights=True))
model = model.cuda().half()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

for _step in range(args.steps):
    x = torch.randn(args.batch_size, args.width, device="cuda", dtype=torch.float16)
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
