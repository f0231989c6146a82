"""A training loop whose layer dequantizes its NF4 weight itself, by calling bitsandbytes' native
library through ctypes, as fused LoRA kernels do: the buffers are made with torch, the library
only writes into them (on the current CUDA stream, handed over raw).

    python bnb_ctypes_dequant.py [--out 384] [--in 256] [--rank 8] [--tokens 96] [--steps 3]
                                 [--own-library] [--gemv]

``--own-library`` loads a native library of the module's own (the C library, standing for a
custom CUDA extension) beside bitsandbytes', as a module that also launches its own kernels would.
``--gemv`` also runs bitsandbytes' native 4-bit matrix-vector kernel through ctypes on one token.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util

import bitsandbytes.functional as bnbf
import torch


def native_dequantize(packed: torch.Tensor, state: bnbf.QuantState) -> torch.Tensor:
    """The weight in its compute dtype: the nested absmax first (8-bit blockwise to float32,
    plus the offset), then the 4-bit weight with it."""
    nested = state.state2
    device = packed.device
    absmax = torch.empty(state.absmax.numel(), dtype=torch.float32, device=device)
    weight = torch.empty(tuple(state.shape), dtype=state.dtype, device=device)
    stream = ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(device.index))
    bnbf.lib.cdequantize_blockwise_fp32(
        ctypes.c_void_p(nested.code.data_ptr()), ctypes.c_void_p(state.absmax.data_ptr()),
        ctypes.c_void_p(nested.absmax.data_ptr()), ctypes.c_void_p(absmax.data_ptr()),
        ctypes.c_int32(nested.blocksize), ctypes.c_int32(absmax.numel()), stream)
    absmax += state.offset
    bnbf.lib.cdequantize_blockwise_bf16_nf4(
        None, ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(absmax.data_ptr()),
        ctypes.c_void_p(weight.data_ptr()), ctypes.c_int32(state.blocksize),
        ctypes.c_int32(weight.numel()), stream)
    return weight


def native_gemv(x: torch.Tensor, packed: torch.Tensor, state: bnbf.QuantState) -> torch.Tensor:
    """One token through the 4-bit weight with bitsandbytes' inference kernel (its absmax
    dequantized first, as above)."""
    out_features, in_features = state.shape
    absmax = torch.empty(state.absmax.numel(), dtype=torch.float32, device=x.device)
    out = torch.empty((1, out_features), dtype=x.dtype, device=x.device)
    stream = ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(x.device.index))
    bnbf.lib.cgemm_4bit_inference_naive_bf16(
        ctypes.c_int32(1), ctypes.c_int32(out_features), ctypes.c_int32(in_features),
        ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(packed.data_ptr()),
        ctypes.c_void_p(absmax.data_ptr()), ctypes.c_void_p(state.code.data_ptr()),
        ctypes.c_void_p(out.data_ptr()), ctypes.c_int32(in_features),
        ctypes.c_int32((in_features + 1) // 2), ctypes.c_int32(out_features),
        ctypes.c_int32(state.blocksize), stream)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=int, default=384)
    parser.add_argument("--in", dest="inp", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--own-library", action="store_true")
    parser.add_argument("--gemv", action="store_true")
    args = parser.parse_args()
    if args.own_library:
        globals()["own_library"] = ctypes.CDLL(ctypes.util.find_library("c"))

    full = torch.randn(args.out, args.inp, dtype=torch.bfloat16, device="cuda")
    packed, state = bnbf.quantize_4bit(full, blocksize=64, compress_statistics=True,
                                       quant_type="nf4")
    del full
    adapter = torch.nn.Sequential(
        torch.nn.Linear(args.inp, args.rank, bias=False, device="cuda", dtype=torch.bfloat16),
        torch.nn.Linear(args.rank, args.out, bias=False, device="cuda", dtype=torch.bfloat16))
    optimizer = torch.optim.SGD(adapter.parameters(), lr=0.01)
    for _ in range(args.steps):
        x = torch.randn(args.tokens, args.inp, dtype=torch.bfloat16, device="cuda")
        weight = native_dequantize(packed, state)
        if args.gemv:
            native_gemv(x[:1], packed, state)
        y = x @ weight.t() + adapter(x)
        del weight
        y.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
