"""bitsandbytes' ``Linear4bit`` used directly, as its docs show: a float16 model's weights loaded
into 4-bit layers, quantized when the model moves to the GPU (``.to(0)``), a trainable float
head trained on top of the frozen 4-bit layers.

    python bnb_linear4bit_loop.py [--width 1024] [--quant-type nf4|fp4] [--double-quant]
        [--batch-size 8] [--steps 3]
"""

import argparse

import bitsandbytes as bnb
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--quant-type", default="nf4")
parser.add_argument("--double-quant", action="store_true")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

width = args.width
fp16_model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)).half()
quantized = nn.Sequential(*(bnb.nn.Linear4bit(width, width, compute_dtype=torch.bfloat16,
                                              compress_statistics=args.double_quant,
                                              quant_type=args.quant_type) for _ in range(2)))
quantized.load_state_dict(fp16_model.state_dict())
quantized = quantized.to(0)  # quantization happens here
head = nn.Linear(width, 16).to(0)
optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)

for _step in range(args.steps):
    x = torch.randn(args.batch_size, width, device="cuda", dtype=torch.bfloat16)
    loss = head(quantized(x).float()).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
