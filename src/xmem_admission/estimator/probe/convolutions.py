"""The ``cudnn:`` marks of convolutions: each one PyTorch would run through cuDNN on a GPU.

Convolutions run through cuDNN on a GPU, which asks the caching allocator for a workspace
around each call and frees it after (aten/src/ATen/native/cudnn/Conv_v8.cpp, ``try_plans``:
``c10::cuda::CUDACachingAllocator::get()->allocate(workspace_size)`` inside the call). The
tracker marks each one PyTorch sends to cuDNN (``conv_marks``) with its shapes, geometry,
layout, dtype and torch.backends.cudnn's flags; ``orchestrate`` sizes the workspace for the
target GPU.

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from xmem_admission.estimator.conv_marks import ConvFlags, ConvMark, as_2d, routes_to_cudnn

aten = torch.ops.aten
_CONV_FORWARD = aten.convolution.default
_CONV_BACKWARD = aten.convolution_backward.default


def _ints(values: Any) -> Tuple[int, ...]:
    return tuple(int(v) for v in values)


def _channels_last(t: torch.Tensor) -> bool:
    """``suggest_memory_format(t) == ChannelsLast`` (what ConvUtils.h
    ``cudnn_conv_suggest_memory_format`` asks of the input and of the weight)."""
    try:
        from torch._prims_common import suggest_memory_format
        return bool(suggest_memory_format(t) in (torch.channels_last, torch.channels_last_3d))
    except Exception:  # noqa: BLE001 - a torch without it: the layout's own test
        return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(
            memory_format=torch.channels_last)


def _conv_allows_tf32() -> bool:
    """TF32 for cuDNN convolutions: ``ctx.allowTF32CuDNN(Float32Op::CONV)``. From torch 2.9 the
    convolution's own ``torch.backends.cudnn.conv.fp32_precision`` decides ("tf32" or "ieee";
    "none" defers to ``torch.backends.cudnn.fp32_precision``, then ``torch.backends``); before,
    ``torch.backends.cudnn.allow_tf32`` (torch's default True)."""
    backends = torch.backends
    cudnn = backends.cudnn
    for holder in (getattr(cudnn, "conv", None), cudnn, backends):
        precision = getattr(holder, "fp32_precision", None) if holder is not None else None
        if precision in ("tf32", "ieee"):
            return bool(precision == "tf32")
    try:
        return bool(torch._C._get_cudnn_allow_tf32())
    except Exception:  # noqa: BLE001 - flags mixed across the old and new TF32 APIs
        return True


def conv_flags() -> ConvFlags:
    """``torch.backends.cudnn`` now, as Convolution.cpp reads it for each call."""
    kernel = getattr(torch._C, "_get_cudnn_depthwise_kernel", None)  # torch 2.14 and newer
    return ConvFlags(enabled=bool(torch._C._get_cudnn_enabled()),
                     benchmark=bool(torch._C._get_cudnn_benchmark()),
                     deterministic=bool(torch._C._get_cudnn_deterministic()
                                        or torch.are_deterministic_algorithms_enabled()),
                     allow_tf32=_conv_allows_tf32(),
                     depthwise_kernel=str(kernel()) if kernel is not None else "auto")


def conv_mark(func: Any, args: Tuple[Any, ...], out: Any, flags: Optional[ConvFlags] = None
              ) -> Optional[str]:
    """The ``cudnn:`` mark of a convolution op PyTorch would run through cuDNN on a GPU (None for
    any other op, and for a convolution it sends elsewhere: a depthwise one to its own kernels,
    any one with cuDNN disabled; ``conv_marks.routes_to_cudnn``).

    ``x`` is the input, ``w`` the weight, ``y`` the output (its gradient in backward). A
    backward names each gradient it computes (``output_mask``), data before filter, the order of
    ``cudnn_convolution_backward`` (ConvShared.cpp). The format: ``conv_marks``.
    """
    kinds: Tuple[str, ...]
    if func is _CONV_FORWARD:
        x, w, y, kinds = args[0], args[1], out, ("fwd",)
        geometry = args[3:9]
    elif func is _CONV_BACKWARD:
        x, w, y = args[1], args[2], args[0]
        geometry = args[4:10]
        mask = args[10]
        kinds = tuple(k for k, wanted in (("bwd_data", mask[0]), ("bwd_filter", mask[1]))
                      if wanted)
    else:
        return None
    if not kinds or not all(isinstance(t, torch.Tensor) for t in (x, w, y)):
        return None
    stride, padding, dilation, transposed, output_padding, groups = geometry
    flags = flags if flags is not None else conv_flags()
    dtype = str(x.dtype).replace("torch.", "")
    # cudnn_conv_suggest_memory_format: never for float64; channels-last when the input or the
    # weight is
    channels_last = dtype != "float64" and (_channels_last(x) or _channels_last(w))
    mark = as_2d(ConvMark(kinds, _ints(x.shape), _ints(w.shape), _ints(y.shape), int(groups),
                          x.element_size(), _ints(stride), _ints(padding), _ints(dilation),
                          channels_last, dtype, flags.benchmark, flags.deterministic,
                          flags.allow_tf32, bool(transposed)))
    assert mark.stride is not None and mark.padding is not None and mark.dilation is not None
    out_padding = (0, *_ints(output_padding)) if len(x.shape) == 3 else _ints(output_padding)
    if not routes_to_cudnn(mark.x, mark.w, mark.groups, mark.stride, mark.padding,
                           mark.dilation, mark.transposed, out_padding, dtype, channels_last,
                           flags):
        return None
    return mark.label()

