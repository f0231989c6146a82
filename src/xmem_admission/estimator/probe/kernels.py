"""Temporaries CUDA kernels take from the caching allocator that their fake kernels do not make.

A fake (meta) kernel makes an op's outputs only; some CUDA implementations also allocate
scratch tensors for the duration of the call. Those that are large enough to move the peak, or
to fragment a segment, are replayed here, in the order and with the lifetimes of the CUDA code,
as fake tensors the tracker records (``AllocationTracker`` calls ``run`` for the ops in ``OPS``
when their inputs are on the GPU).

``embedding`` (aten/src/ATen/native/Embedding.cpp, ``embedding_symint``): indices of more than
one dimension are flattened, ``weight.index_select(0, indices.reshape(-1))``; a reshape that
cannot be a view (a slice such as ``tokens[:, :-1]``) copies them, and the copy is freed once
the output is made (65,536 bytes per step before GPT 834M's embedding on the H200).

``embedding_dense_backward`` (aten/src/ATen/native/cuda/Embedding.cu,
``embedding_dense_backward_cuda``, and EmbeddingBackwardKernel.cu,
``embedding_backward_cuda_kernel``): contiguous copies of the indices and of the output's
gradient when they are not contiguous; above 3,072 indices (or with ``scale_grad_by_freq``) the
radix sort's ``sorted_indices``, ``orig_indices`` and the ``arange`` it sorts (freed after the
sort), ``count`` with ``scale_grad_by_freq``; then the gradient itself (``at::zeros``), the
``segment_offsets`` and the 8-byte segment count, the keys ``cub::unique_by_key`` writes (one
index each, freed when it returns), ``partials_per_segment`` and its offsets
(``min(numel, num_weights)`` each), the 8-byte partial-segment count, ``partial_segment_offset``
and ``grad_weight_per_segment`` (``numel / NROWS_PER_THREAD + max_segments`` rows, the latter
``stride`` wide in the accumulation type: float for half, bfloat16 and float, double for
double); all freed in the reverse order when the kernel returns. An H200 (torch 2.11,
bench/data/H200 snapshots) allocated exactly these: for GPT 834M's 8 x 1024 tokens and 1,536
wide embedding, 65,536-byte index tensors, 72,088 bytes of partial-segment offsets and
55,363,584 bytes of per-segment sums. The temporary storage of cub's radix sort, unique and
scan (150,015 and 1,279 bytes there: sizes internal to cub) is not replayed: it sits in the
small pool.

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

aten = torch.ops.aten

# EmbeddingBackwardKernel.cu: "constexpr int NROWS_PER_THREAD = 10;"
NROWS_PER_THREAD = 10
# Embedding.cu: "if (num_indices <= 3072 && !scale_grad_by_freq)" takes the feature kernel,
# which allocates nothing beyond the gradient
FEATURE_KERNEL_MAX_INDICES = 3072

Record = Callable[[torch.Tensor], torch.Tensor]
Run = Callable[[], Any]


def embedding_dense_backward(run: Run, record: Record, args: Tuple[Any, ...],
                             kwargs: Dict[str, Any]) -> Any:
    """Run ``aten.embedding_dense_backward`` (``run``: its fake kernel, which makes the
    gradient) between the CUDA kernel's temporaries, each passed to ``record`` when made."""
    names = ("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    grad, indices = bound["grad_output"], bound["indices"]
    num_weights, scale = int(bound["num_weights"]), bool(bound["scale_grad_by_freq"])
    held: List[torch.Tensor] = []

    def make(shape: Tuple[int, ...], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        tensor = record(like.new_empty(shape, dtype=dtype))
        held.append(tensor)
        return tensor

    numel = indices.numel()
    index_type = indices.dtype
    if not indices.is_contiguous():  # "auto indices = indices_.contiguous();"
        make((numel,), indices, index_type)
    if not grad.is_contiguous():  # "grad_.contiguous().view({num_indices, grad_.size(-1)})"
        make(tuple(grad.shape), grad, grad.dtype)
    if numel <= FEATURE_KERNEL_MAX_INDICES and not scale:
        out = record(run())
    else:
        make((numel,), indices, index_type)  # sorted_indices
        make((numel,), indices, index_type)  # orig_indices
        sort_range = make((numel,), indices, index_type)  # at::arange(num_indices)
        held.pop()
        del sort_range  # the lambda's local: freed once the sort returns
        if scale:
            make((numel,), indices, index_type)  # count
        out = record(run())  # embedding_backward_cuda_kernel: at::zeros first
        stride = int(out.stride(0)) if out.dim() == 2 else int(grad.shape[-1])
        make((numel,), indices, index_type)  # segment_offsets
        make((), grad, torch.int64)  # num_of_segments_tensor
        # cuda::cub::unique_by_key (ATen/cuda/cub.cuh) takes a keys_out buffer of one key per
        # index from the caching allocator for the call (cub's keys output cannot be discarded):
        # the H200 snapshots hold it, 65,536 bytes for 8,192 indices between the segment count
        # and cub's temporary storage, freed before partials_per_segment is made
        keys_out = make((numel,), indices, index_type)
        held.pop()
        del keys_out
        max_segments = min(numel, num_weights)
        make((max_segments,), indices, index_type)  # partials_per_segment
        make((max_segments,), indices, index_type)  # partials_per_segment_offset
        make((), grad, torch.int64)  # num_of_partial_segments_tensor
        max_partial_segment = numel // NROWS_PER_THREAD + max_segments
        make((max_partial_segment,), indices, index_type)  # partial_segment_offset
        accumulate = torch.float64 if grad.dtype == torch.float64 else torch.float32
        make((max_partial_segment, stride), grad, accumulate)  # grad_weight_per_segment
    while held:  # C++ destroys locals in the reverse order of their construction
        held.pop()
    return out


def embedding(run: Run, record: Record, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Run ``aten.embedding`` (``run``: its fake kernel, which makes the output) after the copy
    ``indices.reshape(-1)`` makes when the indices cannot be viewed flat."""
    indices = args[1] if len(args) > 1 else kwargs["indices"]
    flat = None
    if indices.dim() != 1:
        try:
            indices.view(-1)
        except (RuntimeError, ValueError):  # "Cannot view a tensor with shape ... and strides"
            flat = record(indices.new_empty((indices.numel(),)))
    out = record(run())
    del flat
    return out


OPS: Dict[Any, Callable[[Run, Record, Tuple[Any, ...], Dict[str, Any]], Any]] = {
    aten.embedding.default: embedding,
    aten.embedding_dense_backward.default: embedding_dense_backward,
}
