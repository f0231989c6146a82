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

cuDNN's attention comes first on Hopper and Blackwell: ``priority_order`` (sdp_utils.cpp) moves
cudnn_attention ahead of flash once ``check_prefer_cudnn_attention()`` holds: the variable
``TORCH_CUDNN_SDPA_DEPRIORITIZED`` unset, a runtime cuDNN newer than 9.15.0 (``cudnn_version >
91500``), compute capability 9.x or 10.x (for a wheel built against CUDA 12, minor 0 or 3 only).
``CudnnAttention`` replays what ``_cudnn_attention_forward`` / ``_cudnn_attention_backward``
(attention.cu, attention_backward.cu) and ``run_cudnn_SDP_fprop`` / ``run_cudnn_SDP_bprop``
(aten/src/ATen/native/cudnn/MHA.cpp) allocate: the dropout seed and offset (8 bytes each, kept
for the backward), the output in the query's layout and the fp32 logsumexp, the execution plan's
workspace (``mha_graph->get_workspace_size()``, taken from the caching allocator around
``execute`` and freed at once); in the backward the three gradients (``empty_like``), a copy of a
gradient whose innermost stride is not 1 (``permute_to_matching_layout``), and the workspace,
which holds cudnn-frontend's fp32 dQ accumulator (``SDPABackwardNode``,
``dQ_accum_size = b * h_q * s_q * d_qk * sizeof(float)``) and the engine's own part.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


# The cuDNN engine's own workspace beside cudnn-frontend's buffers: an H200 (cuDNN 9.19, torch
# 2.11.0+cu130, bench/data/H200 snapshots) took 256 bytes around every forward ``execute`` and
# b * h * s_q * 4 + 256 bytes beyond the frontend's dQ accumulator in every backward: one fp32
# per query row and head (the dO.O row sums, which the frontend leaves to the engine from cuDNN
# 8.9.5 on: ``softmax_sum`` is non-virtual only below 8905) and the same 256. Read off
# gpt-834m-bf16-b8-adamw-expandable (50,856,192 = 50,331,648 + 524,288 + 256); the rule gives the
# 25,559,296, 17,039,616, 51,118,336 and 68,157,696 bytes of gpt-134m-bf16-b8-adamw,
# gpt-411m-bf16-b4-sgd, gpt-134m-bf16-b16-adamw-ckpt and llama-gqa-1.1b-bf16-b4-s2048-adamw.
CUDNN_ENGINE_WORKSPACE = 256
# sdp_utils.cpp check_prefer_cudnn_attention: "cudnn_version > 91500" (cuDNN 9.15.1 fixes
# sequence lengths that are not multiples of 128)
_CUDNN_PREFERRED_AFTER = 91500
# torch releases whose libtorch_cuda.so reads TORCH_CUDNN_SDPA_DEPRIORITIZED (the 2.11.0, 2.14.1
# and 2.15.0 cu130 wheels do; 2.2.2 has no cuDNN-first order; releases between were not checked)
_CUDNN_FIRST_SINCE = (2, 11)


def cudnn_first(capability: Tuple[int, int]) -> bool:
    """Whether SDPA on a GPU of ``capability`` tries cuDNN's attention before flash with the
    torch and cuDNN of this process (the user's image): sdp_utils.cpp ``priority_order`` and
    ``check_prefer_cudnn_attention``."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower() in (
            "1", "true", "on", "yes", "y"):  # c10::utils::check_env's true values
        return False
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if release < _CUDNN_FIRST_SINCE:
        return False
    try:
        version = int(torch.backends.cudnn.version() or 0)
    except Exception:  # noqa: BLE001 - a cuDNN that does not load is no cuDNN
        return False
    major, minor = capability
    if version <= _CUDNN_PREFERRED_AFTER or major not in (9, 10):
        return False
    built_for = int((torch.version.cuda or "0").split(".")[0])
    # "#if CUDA_VERSION < 13000 ... (!minor || minor == 3)"
    return built_for >= 13 or minor in (0, 3)


def _cudnn_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                 dropout_p: float, capability: Tuple[int, int], gqa: bool) -> bool:
    """``can_use_cudnn_attention`` (sdp_utils.cpp) for dense inputs: fp16/bf16 on sm80-sm121,
    dropout in steps of 1/16, batch and heads up to 65,535, head dims multiples of 8 up to the
    cuDNN's limit, more than one key, contiguous last dims, not deterministic. Masked and
    grouped-query calls are left to the other kernels here: their cuDNN graphs hold more (a bias
    and the full-head dK/dV of ``CompositeSDPABackwardNode``) than this module models."""
    # torch.backends.cuda.cudnn_sdp_enabled exists since torch 2.3: a torch without it has no
    # cuDNN attention to choose
    enabled = getattr(torch.backends.cuda, "cudnn_sdp_enabled", None)
    if mask is not None or gqa or enabled is None or not enabled():
        return False
    if torch.are_deterministic_algorithms_enabled() and \
            not torch.is_deterministic_algorithms_warn_only_enabled():
        return False  # check_cudnn_deterministic
    if not ((8, 0) <= capability <= (12, 1)) or q.dtype not in _HALF or \
            not q.dtype == k.dtype == v.dtype:
        return False
    if dropout_p * 16.0 != math.floor(dropout_p * 16.0):
        return False  # check_cudnn_dropout
    version = int(torch.backends.cudnn.version() or 0)
    if dropout_p > 0.0 and 91100 < version < 91400:
        return False  # "cuDNN version does not support droppout in SDPA (9.11 - 9.13)"
    batch, heads, queries, d_qk = q.shape
    keys, d_v = k.shape[2], v.shape[-1]
    if batch > 65535 or heads > 65535 or keys == 1 or (dropout_p > 0.0 and queries == 1):
        return False
    if min(q.shape[2], keys) == 0 or any(t.stride(-1) != 1 and t.shape[-1] != 1
                                         for t in (q, k, v)):
        return False
    sm90_or_sm10x = capability == (9, 0) or capability[0] == 10
    limit = 128
    if sm90_or_sm10x and version > 92200:
        limit = 256  # check_cudnn_tensor_shapes with a frontend that takes d256
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if training and not (max(d_qk, d_v) <= 128 or (d_qk, d_v) in ((192, 128), (256, 256))):
            return False  # check_cudnn_d256_bprop_head_dim
    elif sm90_or_sm10x and version >= 91100 and (d_qk, d_v) == (192, 128):
        limit = 192
    return bool(d_qk <= limit and d_v <= limit and d_qk % 8 == 0 and d_v % 8 == 0)


def choose_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                   dropout_p: float, capability: Tuple[int, int], gqa: bool,
                   prefer_cudnn: bool = False) -> str:
    """Return "cudnn", "flash", "efficient" or "math" for these inputs on a GPU of
    ``capability``; ``prefer_cudnn`` is ``cudnn_first``'s answer."""
    if prefer_cudnn and _cudnn_takes(q, k, v, mask, dropout_p, capability, gqa):
        return "cudnn"
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
    backend = choose_backend(q, k, v, mask, dropout_p, capability, gqa, cudnn_first(capability))
    if backend == "cudnn":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            result: torch.Tensor = CudnnAttention.apply(q, k, v, float(dropout_p),
                                                        bool(is_causal), scale)
            return result
        return _cudnn_forward(q, k, v, float(dropout_p), bool(is_causal), scale, False)[0]
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


# -- cuDNN's attention ------------------------------------------------------------------------

def cudnn_backward_workspace(batch: int, heads: int, queries: int, head_dim: int) -> int:
    """Bytes of the workspace ``run_cudnn_SDP_bprop`` takes for one backward: cudnn-frontend's
    fp32 dQ accumulator (``SDPABackwardNode``: ``b * h_q * s_q * d_qk * sizeof(float)``, made
    whenever the dP workspace optimisation is off, as it always is from cuDNN 9.0 without dBias
    or a deterministic algorithm) and the engine's part (``CUDNN_ENGINE_WORKSPACE``)."""
    rows = batch * heads * queries
    return rows * head_dim * 4 + rows * 4 + CUDNN_ENGINE_WORKSPACE


def _cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                   is_causal: bool, scale: Optional[float],
                   logsumexp: bool) -> Tuple[torch.Tensor, ...]:
    """``_cudnn_attention_forward`` (attention.cu): the dropout seed and offset (one int64
    each, on the device), then ``run_cudnn_SDP_fprop`` (MHA.cpp): the output
    (``alloc_with_matching_layout``: the query's dimension order) and the fp32 logsumexp, then
    the plan's workspace around ``execute``. The ATen op's fake kernel makes the output, the
    logsumexp and the seed and offset (in that order; CUDA makes the two 8-byte tensors first,
    a difference of order inside the small pool only)."""
    outputs = aten._scaled_dot_product_cudnn_attention(q, k, v, None, logsumexp, dropout_p,
                                                       is_causal, False, scale=scale)
    workspace = q.new_empty((CUDNN_ENGINE_WORKSPACE,), dtype=torch.uint8)
    del workspace
    return outputs[0], outputs[1], outputs[6], outputs[7]


class CudnnAttention(torch.autograd.Function):  # type: ignore[misc]  # torch is read as Any
    """``_scaled_dot_product_cudnn_attention`` with what CUDA allocates forward and backward.

    Backward is ``_scaled_dot_product_cudnn_attention_backward_cuda`` ->
    ``_cudnn_attention_backward`` (attention_backward.cu): ``empty_like`` of the query, key and
    value, then ``run_cudnn_SDP_bprop`` (MHA.cpp): a copy of the output's gradient in the
    output's layout when its innermost stride is not 1 (cuDNN 9.5.1 and later;
    ``permute_to_matching_layout``), the workspace (``cudnn_backward_workspace``), freed when
    ``execute`` returns, then that copy with the function."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                is_causal: bool, scale: Optional[float]) -> torch.Tensor:
        out, lse, seed, offset = _cudnn_forward(q, k, v, dropout_p, is_causal, scale, True)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, _lse, _seed, _offset = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        matched = None
        if grad.stride(-1) != 1:
            # permute_to_matching_layout: the gradient copied into the output's dimension order
            order = sorted(range(4), key=lambda dim: out.stride(dim), reverse=True)
            matched = grad.permute(order).contiguous()
        batch, heads, queries, head_dim = q.shape
        workspace = q.new_empty((cudnn_backward_workspace(batch, heads, queries, head_dim),),
                                dtype=torch.uint8)
        del workspace, matched
        wants = ctx.needs_input_grad
        return (grad_q if wants[0] else None, grad_k if wants[1] else None,
                grad_v if wants[2] else None, None, None, None)
