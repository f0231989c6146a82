"""``scaled_dot_product_attention`` as CUDA would run it on the target GPU.

On a CPU (fake or real) SDPA takes the math path or the CPU flash kernel; on a GPU the
dispatcher picks the flash kernel (fp16/bf16, no mask) or the memory-efficient kernel, which never
materialise the S x S score matrix. The probe calls those kernels' ATen ops directly: under fake
mode they return their real output shapes (logsumexp included), and autograd records their real
backward. The selection follows ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
(``select_sdp_backend``: priority flash, efficient, math; ``check_flash_attention_hardware_support``
needs sm80+; flash takes fp16/bf16 and head dims up to 256 and no attention mask;
``check_mem_efficient_hardware_support`` needs sm50+ and bf16 needs sm80+; memory-efficient
kernels need the head dim aligned to 16 bytes, ``check_head_dim_size_mem_efficient``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def choose_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                   dropout_p: float, capability: Tuple[int, int], gqa: bool) -> str:
    """Return "flash", "efficient" or "math" for these inputs on a GPU of ``capability``."""
    head_dim = q.shape[-1]
    same_dims = k.shape[-1] == head_dim and v.shape[-1] == head_dim
    if (capability >= (8, 0) and q.dtype in _HALF and mask is None and head_dim <= 256
            and same_dims and q.dtype == k.dtype == v.dtype):
        return "flash"
    align = 16 // q.element_size()
    if (capability >= (5, 0) and q.dtype in (torch.float32,) + _HALF
            and not (q.dtype == torch.bfloat16 and capability < (8, 0))
            and head_dim % align == 0 and same_dims and not gqa):
        return "efficient"
    return "math"


def cuda_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
              dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool,
              capability: Tuple[int, int]) -> torch.Tensor:
    gqa = bool(enable_gqa) and q.shape[1] != k.shape[1]
    backend = choose_backend(q, k, v, mask, dropout_p, capability, gqa)
    if backend == "flash":
        if gqa:
            # Flash handles grouped heads natively since 2.5 (sdp_utils.cpp,
            # check_grouped_query_attention); older kernels need expanded K/V.
            groups = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal,
                                                        False, scale=scale)[0]
    if backend == "efficient":
        if mask is not None and mask.dtype == torch.bool:
            # sdp_utils.cpp convert_boolean_attn_mask: where(mask, 0, -inf) in the query dtype
            mask = torch.zeros((), dtype=q.dtype).masked_fill(~mask, float("-inf"))
        need_lse = q.requires_grad or k.requires_grad or v.requires_grad
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, need_lse, dropout_p,
                                                            is_causal, scale=scale)[0]
    return aten._scaled_dot_product_attention_math(q, k, v, mask, dropout_p, is_causal,
                                                   None, scale=scale, enable_gqa=gqa)[0]
