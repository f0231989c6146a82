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

The memory-efficient kernel's backward allocates more on CUDA than its ATen op's fake (meta)
kernel, which only makes the three gradients. ``_efficient_attention_backward``
(``aten/src/ATen/native/transformers/cuda/attention_backward.cu``) also copies a gradient of the
output that is not contiguous in (batch, query, head, dim) order, computes the rows' ``delta``
(on the host side of the launch for fp32 kernels: a full-size product, its sum and a transposed
copy), and asks the caching allocator for the cutlass kernel's workspace (``Params::
workspace_size()`` in ``mem_eff_attention/kernel_backward.h``). ``EfficientAttention`` replays
those allocations in the order and with the lifetimes the CUDA code gives them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
        if mask is not None:
            mask = _preprocess_mask(mask, q, k)
        # attention.cpp should_compute_logsumexp: a query, key or value needs grad, grad mode on
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            out: torch.Tensor = EfficientAttention.apply(q, k, v, mask, float(dropout_p),
                                                         bool(is_causal), scale, capability)
            return out
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, False, dropout_p,
                                                            is_causal, scale=scale)[0]
    return aten._scaled_dot_product_attention_math(q, k, v, mask, dropout_p, is_causal,
                                                   None, scale=scale, enable_gqa=gqa)[0]


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The mask as ``scaled_dot_product_attention`` hands it to the memory-efficient kernel
    (aten/src/ATen/native/transformers/attention.cpp, ``preprocess_mask``): unless every stride
    but the last is a multiple of 8 elements and the last is 1 (``aligned_tensor<8>``), a copy
    padded by ``8 - last % 8`` columns, sliced back (``pad_bias``); then expanded to
    (batch, heads, queries, keys)."""
    aligned = all(stride % 8 == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        last = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


# -- the memory-efficient kernel's backward ---------------------------------------------------

@dataclass(frozen=True)
class EfficientBackwardKernel:
    """The ``AttentionBackwardKernel`` template ``_efficient_attention_backward`` launches
    (``mem_eff_attention/kernel_backward.h``): the fields its memory depends on."""

    arch: int  # the kernel's ArchTag::kMinComputeCapability (50, 70, 75 or 80)
    half: bool  # fp16/bf16 (``kIsHalf``); fp32 otherwise
    block_i: int  # kBlockSizeI: queries per thread block
    block_j: int  # kBlockSizeJ: keys per thread block
    max_k: int  # kMaxK: the largest head dim the kernel takes

    @property
    def output_in_rf(self) -> bool:
        # "kOutputInRF = kIsHalf && kMaxK <= kBlockSizeI"
        return self.half and self.max_k <= self.block_i

    @property
    def split_keys(self) -> bool:
        # "kEnableSplitKeys = kMinSm >= 70"
        return self.arch >= 70

    @property
    def computes_delta(self) -> bool:
        # "kKernelComputesDelta = kIsHalf && (kOutputInRF || ArchTag::kMinComputeCapability != 70)"
        return self.half and (self.output_in_rf or self.arch != 70)

    @property
    def accumulates_grad_q(self) -> bool:
        # "kNeedsAccumGradQ = kEnableSplitKeys || !is_same<output_accum_t, output_t>"; the
        # accumulator is float, so a half kernel always stages dQ
        return self.split_keys or self.half

    @property
    def accumulates_grad_kv(self) -> bool:
        # "kNeedsAccumGradK = !kOutputInRF && !is_same<output_accum_t, output_t>" (and dV alike)
        return self.half and not self.output_in_rf


def efficient_backward_kernel(dtype: torch.dtype, capability: Tuple[int, int],
                              head_dim: int) -> EfficientBackwardKernel:
    """The first kernel of ``dispatch_cutlassB`` (``mem_eff_attention/kernels/cutlassB.h``) that
    takes this head dim (``Kernel::kMaxK < maxK`` is skipped): fp32 on sm80+ lists
    64x64 (K<=32, K<=64), 128x64 (K<=128) then 128x64 (any K); fp16/bf16 on sm80+ lists 64x64
    (K<=32, K<=64), 128x64 (K<=96, sm86 and sm89 only), 128x128 (K<=128) then 128x64 (any K);
    sm70 and sm75 list 64x64 for fp32 and 64x64, 128x64 (K<=128), 128x64 (any K) for fp16. Kernel
    names of the torch 2.2.2 and 2.14.1 CUDA 12/13 wheels (libtorch_cuda.so) carry these tiles.
    A kernel whose shared memory exceeds the GPU's opt-in limit is skipped on the device; the
    dQ staging below is about one fp32 copy of Q whichever tile runs, so that choice moves it
    by a block's rounding only."""
    cc = capability[0] * 10 + capability[1]
    arch = 80 if cc >= 80 else 75 if cc >= 75 else 70 if cc >= 70 else 50
    half = dtype in _HALF
    if not half:
        if arch < 80 or head_dim <= 64:
            return EfficientBackwardKernel(arch, False, 64, 64, 32 if head_dim <= 32 else
                                           64 if head_dim <= 64 else
                                           128 if head_dim <= 128 else 65536)
        return EfficientBackwardKernel(arch, False, 128, 64, 128 if head_dim <= 128 else 65536)
    if head_dim <= 64:
        return EfficientBackwardKernel(arch, True, 64, 64, 32 if head_dim <= 32 else 64)
    if arch == 80 and head_dim <= 96 and cc in (86, 89):
        return EfficientBackwardKernel(arch, True, 128, 64, 96)
    if head_dim <= 128:
        return EfficientBackwardKernel(arch, True, 128, 128 if arch == 80 else 64, 128)
    return EfficientBackwardKernel(arch, True, 128, 64, 65536)


def efficient_backward_workspace(kernel: EfficientBackwardKernel, batch: int, heads: int,
                                 queries: int, keys: int, head_dim: int, head_dim_value: int,
                                 deterministic: bool = False) -> int:
    """Bytes of the kernel's workspace, ``Params::workspace_size()`` (kernel_backward.h):
    per (batch, head), dK and dV staging when they are not kept in registers and the dQ staging
    (``GradQTempStorage``: a lock, a counter, two pads, then a float per element of a
    kBlockSizeI x kBlockSizeJ tile, for each query block and head-dim column block), aligned to
    four floats. The number of key splits follows the heuristic of attention_backward.cu."""
    splits = 1
    if kernel.split_keys and not deterministic:
        splits = math.ceil(keys / kernel.block_j)
        # "parallelism_without_split_key >= 256 && p.num_keys <= 2 * Kernel::kBlockSizeJ"
        if batch * heads >= 256 and keys <= 2 * kernel.block_j:
            splits = 1
        if kernel.accumulates_grad_kv:
            # "std::min(int32_t(p.num_splits_key), 200 / ((int32_t)(p.num_batches * p.num_heads)))"
            splits = min(splits, 200 // (batch * heads))
        splits = max(splits, 1)  # "if (!Kernel::kEnableSplitKeys || p.num_splits_key < 1)"
    elements = 0
    if kernel.accumulates_grad_kv:
        # workspace_elements_gk/gv: num_splits_key * kBlockSizeJ * align_up(head_dim, kBlockSizeI)
        elements += splits * kernel.block_j * _align_up(head_dim, kernel.block_i)
        elements += splits * kernel.block_j * _align_up(head_dim_value, kernel.block_i)
    if kernel.accumulates_grad_q:
        # workspace_elements_gq: num_blocks * num_cols * sizeof(GradQTempStorage) / sizeof(float)
        tile = 4 + kernel.block_i * kernel.block_j
        elements += (math.ceil(queries / kernel.block_i) * math.ceil(head_dim / kernel.block_j)
                     * tile)
    return batch * heads * _align_up(elements, 4) * 4


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class EfficientAttention(torch.autograd.Function):  # type: ignore[misc]  # torch is read as Any
    """``_scaled_dot_product_efficient_attention`` with the backward CUDA runs.

    Forward is the ATen op (its output and logsumexp, saved as the native node saves them).
    Backward is ``_scaled_dot_product_efficient_attention_backward_cuda`` ->
    ``_efficient_attention_backward`` (attention_backward.cu), allocation by allocation:
    ``grad_out_.contiguous()`` on the (B, M, H, K) view of the output's gradient, the three
    gradients (the ATen backward op), ``delta`` (``at::empty({B, nH, M})`` float when the kernel
    computes it, else ``(grad_out.to(kFloat) * out.to(kFloat)).sum(-1).transpose(-2, -1)
    .contiguous()``, its temporaries freed at the end of that statement), the workspace
    (``at::empty({size_bytes}, kByte)``); then ``delta`` goes with the launch lambda, the
    workspace and the contiguous gradient with the function.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
                scale: Optional[float], capability: Tuple[int, int]) -> torch.Tensor:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, bias, out, lse, seed, offset)
        ctx.options = (dropout_p, is_causal, scale, capability)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors
        dropout_p, is_causal, scale, capability = ctx.options
        wants = [bool(w) for w in ctx.needs_input_grad[:4]]
        contiguous_grad = grad.transpose(1, 2).contiguous()
        grad_q, grad_k, grad_v, grad_bias = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, bias, out, lse, seed, offset, dropout_p, wants, is_causal, scale=scale)
        batch, heads, queries, head_dim = q.shape
        kernel = efficient_backward_kernel(q.dtype, capability, max(head_dim, v.shape[-1]))
        if kernel.computes_delta:
            delta = q.new_empty((batch, heads, queries), dtype=torch.float32)
        else:
            product = contiguous_grad.float() * out.transpose(1, 2).float()
            summed = product.sum(-1)
            delta = summed.transpose(-2, -1).contiguous()
            del summed, product
        size = efficient_backward_workspace(kernel, batch, heads, queries, k.shape[2], head_dim,
                                            v.shape[-1],
                                            torch.are_deterministic_algorithms_enabled())
        workspace = q.new_empty((size,), dtype=torch.uint8) if size else None
        del delta, workspace, contiguous_grad
        return (grad_q if wants[0] else None, grad_k if wants[1] else None,
                grad_v if wants[2] else None, grad_bias if wants[3] else None,
                None, None, None, None)
