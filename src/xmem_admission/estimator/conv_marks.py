"""The probe's ``cudnn:`` marks: which convolutions PyTorch runs through cuDNN, and the text that
carries each one from the trace to ``orchestrate``.

A mark reads ``cudnn:CALLS x=N,C,H,W w=K,C/g,R,S y=N,K,P,Q g=G b=BYTES`` followed, in traces
of newer probes, by ``s=`` stride, ``p=`` padding, ``d=`` dilation, ``cl=`` channels-last
(1/0), ``dt=`` dtype, the ``torch.backends.cudnn`` flags at trace time ``bm=`` benchmark,
``det=`` deterministic, ``tf32=`` allow_tf32 (1/0), and ``tr=1`` for a transposed
convolution. CALLS is ``fwd`` or the gradients a backward computes, data before filter
(``bwd_data+bwd_filter``), the order of ``cudnn_convolution_backward`` (ConvShared.cpp).
Traces kept from before carry only the first six fields: ``ConvMark.parse`` reads both, the
newer fields None when absent. A 1-D convolution is marked as PyTorch hands it to cuDNN, viewed
as 2-D with a height of 1 (Convolution.cpp ``view1d_as_2d`` / ``view4d`` run before the
backend is chosen).

``routes_to_cudnn`` is PyTorch's choice of backend for a CUDA convolution
(aten/src/ATen/native/Convolution.cpp ``_select_conv_backend``, the torch 2.14 source): depthwise
convolutions go to cuDNN only where ``use_cudnn_depthwise`` says so, else to PyTorch's own
depthwise kernels (``CudaDepthwise2d``/``3d``), which take no cuDNN workspace.

Standard library only (the probe bundle; the probe turns tensors into the numbers used here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

from xmem_admission.estimator.trace import mark_fields

PREFIX = "cudnn:"
_INT_MAX = 2**31 - 1  # std::numeric_limits<int>::max(): 32-bit index math (CanUse32BitIndexMath.h)

Dims = Tuple[int, ...]


@dataclass(frozen=True)
class ConvFlags:
    """``torch.backends.cudnn`` at the time of the call (Convolution.cpp reads them per call
    from the global context, forward and backward alike: ``params.deterministic =
    ctx.deterministicCuDNN() || ctx.deterministicAlgorithms()``)."""

    enabled: bool = True
    benchmark: bool = False
    deterministic: bool = False
    allow_tf32: bool = True
    depthwise_kernel: str = "auto"  # torch.backends.cudnn.depthwise_kernel (2.14): auto/native/cudnn


@dataclass(frozen=True)
class ConvMark:
    """One ``cudnn:`` mark; the geometry, layout, dtype and flags are None in older traces."""

    calls: Tuple[str, ...]
    x: Dims
    w: Dims
    y: Dims
    groups: int
    itemsize: int
    stride: Optional[Dims] = None
    padding: Optional[Dims] = None
    dilation: Optional[Dims] = None
    channels_last: Optional[bool] = None
    dtype: Optional[str] = None
    benchmark: Optional[bool] = None
    deterministic: Optional[bool] = None
    allow_tf32: Optional[bool] = None
    transposed: bool = False

    def label(self) -> str:
        def dims(values: Sequence[int]) -> str:
            return ",".join(str(int(v)) for v in values)

        def flag(value: Optional[bool]) -> str:
            return "1" if value else "0"

        text = (f"{PREFIX}{'+'.join(self.calls)} x={dims(self.x)} w={dims(self.w)} "
                f"y={dims(self.y)} g={self.groups} b={self.itemsize}")
        if self.stride is not None:
            text += (f" s={dims(self.stride)} p={dims(self.padding or ())}"
                     f" d={dims(self.dilation or ())} cl={flag(self.channels_last)}"
                     f" dt={self.dtype} bm={flag(self.benchmark)} det={flag(self.deterministic)}"
                     f" tf32={flag(self.allow_tf32)}")
        if self.transposed:
            text += " tr=1"
        return text

    @classmethod
    def parse(cls, label: str) -> ConvMark:
        """The mark of ``label``; ValueError when it is not a ``cudnn:`` mark with shapes."""
        kind, fields = mark_fields(label, PREFIX)

        def dims(name: str) -> Optional[Dims]:
            text = fields.get(name)
            return None if text is None else tuple(int(d) for d in text.split(",") if d)

        def flag(name: str) -> Optional[bool]:
            text = fields.get(name)
            return None if text is None else text == "1"

        x, w, y = dims("x"), dims("w"), dims("y")
        if x is None or w is None or y is None:
            raise ValueError(f"cudnn: mark without x, w and y: {label!r}")
        return cls(tuple(kind.split("+")), x, w, y, int(fields.get("g", "1")),
                   int(fields.get("b", "4")), dims("s"), dims("p"), dims("d"), flag("cl"),
                   fields.get("dt"), flag("bm"), flag("det"), flag("tf32"),
                   fields.get("tr") == "1")


def as_2d(mark: ConvMark) -> ConvMark:
    """A 1-D convolution (3-D tensors) as PyTorch hands it to cuDNN: height 1 inserted, stride 1,
    padding 0, dilation 1 for it (Convolution.cpp ``view1d_as_2d`` and ``view4d``)."""
    if len(mark.x) != 3:
        return mark

    def grow(values: Optional[Dims], first: int) -> Optional[Dims]:
        return None if values is None else (first, *values)

    return replace(mark, x=(mark.x[0], mark.x[1], 1, mark.x[2]),
                   w=(mark.w[0], mark.w[1], 1, mark.w[2]), y=(mark.y[0], mark.y[1], 1, mark.y[2]),
                   stride=grow(mark.stride, 1), padding=grow(mark.padding, 0),
                   dilation=grow(mark.dilation, 1))


def _numel(dims: Sequence[int]) -> int:
    total = 1
    for d in dims:
        total *= int(d)
    return total


def routes_to_cudnn(x: Sequence[int], w: Sequence[int], groups: int, stride: Sequence[int],
                    padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                    output_padding: Sequence[int], dtype: str, channels_last: bool,
                    flags: ConvFlags, cudnn_version: Optional[int] = None) -> bool:
    """Whether PyTorch runs this CUDA convolution through cuDNN (Convolution.cpp
    ``_select_conv_backend``), the input ``x`` and weight ``w`` as the backend sees them (a 1-D
    convolution already viewed as 2-D, ``as_2d``), ``channels_last`` as
    ``cudnn_conv_suggest_memory_format`` decides it, ``cudnn_version`` torch's runtime cuDNN
    (None: a cuDNN 9.3 or newer, outside 9.10.1-9.14, as in every torch of the range from 2.9).

    Assumed of the GPU: compute capability 7.0 or newer for cuDNN's depthwise kernels
    (``supportsDepthwiseConvolutionWithCuDNN``, CUDAHooks.cpp: ``prop->major >= 7``, every
    catalogue GPU), and 8.0 or newer for bfloat16 (``supportsBFloat16ConvolutionWithCuDNNv8``):
    a bfloat16 convolution on a V100 or T4 does not run on cuDNN, which the mark's dtype lets a
    consumer apply per GPU.
    """
    # "don't send empty inputs through backends": Empty, no kernel at all
    if not x or x[0] == 0 or (len(x) > 1 and x[1] == 0):
        return False
    geometry = _Geometry(tuple(x), tuple(w), groups, tuple(stride), tuple(padding),
                         tuple(dilation), transposed, tuple(output_padding))
    if _is_depthwise(geometry):
        return _use_cudnn_depthwise(geometry, dtype, channels_last, flags, cudnn_version)
    return _use_cudnn(geometry, flags, cudnn_version)


@dataclass(frozen=True)
class _Geometry:
    x: Dims
    w: Dims
    groups: int
    stride: Dims
    padding: Dims
    dilation: Dims
    transposed: bool
    output_padding: Dims


def _is_depthwise(g: _Geometry) -> bool:
    # ConvParams::is_depthwise: not transposed, 4-D or 5-D input, one group per input channel,
    # more than one group, output channels a multiple of the input channels
    return (not g.transposed and len(g.x) in (4, 5) and g.x[1] == g.groups and g.groups > 1
            and g.w[0] % g.x[1] == 0)


def _output_padding_big(stride: Sequence[int], output_padding: Sequence[int]) -> bool:
    # ConvParams::is_output_padding_big: output_padding[i] >= stride[i] for some i
    return any(op >= s for op, s in zip(output_padding, stride))


def _needs_64bit_indexing(g: _Geometry) -> bool:
    # ConvParams::needs_64bit_indexing_no_split: one sample of the input or of the output has
    # more than INT_MAX elements (the batch cannot be split to fit 32-bit indexing); the output
    # size as conv_input_size (transposed) / conv_output_size compute it (ConvUtils.h)
    if _numel(g.x) == 0:
        return False
    if _numel(g.x) // g.x[0] > _INT_MAX:
        return True
    shape = zip(g.x[2:], g.w[2:], g.stride, g.padding, g.dilation)
    if g.transposed:
        spatial = [(size - 1) * s - 2 * p + d * (k - 1) + op + 1
                   for (size, k, s, p, d), op in zip(shape, g.output_padding)]
        channels = g.w[1] * g.groups
    else:
        spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in shape]
        channels = g.w[0]
    return channels * _numel(spatial) > _INT_MAX


def _use_cudnn(g: _Geometry, flags: ConvFlags, cudnn_version: Optional[int]) -> bool:
    # ConvParams::use_cudnn
    if not flags.enabled:  # "!cudnn_enabled"
        return False
    # "if (needs_64bit_indexing_no_split(input, weight)) { if (!(cudnn_version >= 90300 && ...
    # cudnnv8_enabled_check_debug())) return false; }"
    if _needs_64bit_indexing(g) and cudnn_version is not None and cudnn_version < 90300:
        return False
    # dilated NCHW convolutions: "supportsDilatedConvolutionWithCuDNN() &&
    # !is_output_padding_big()", the first true on every cuDNN build; so, for all: the output
    # padding
    return not _output_padding_big(g.stride, g.output_padding)


def _use_cudnn_depthwise(g: _Geometry, dtype: str, channels_last: bool, flags: ConvFlags,
                         cudnn_version: Optional[int]) -> bool:
    # ConvParams::use_cudnn_depthwise
    if not flags.enabled:
        return False
    if _numel(g.x) > _INT_MAX or _numel(g.w) > _INT_MAX:  # "!(canUse32BitIndexMath(input) && ...)"
        if cudnn_version is None:
            return True
        # "remove this once cuDNN fixes 64-bit depthwise support, first broken in 9.11x"
        if channels_last and 91000 < cudnn_version < 91500:
            return False
        return cudnn_version >= 90300
    if channels_last:  # "always use cudnn_depthwise for channels_last format"
        return True
    kernel_cond = (_use_cudnn(g, flags, cudnn_version)
                   and dtype == "float16"  # "only for FP16"
                   and len(g.x) == 4  # "5-D contiguous depthwise is not supported yet"
                   and all(d == 1 for d in g.dilation)  # "no dilation supported"
                   and (g.stride[0] == g.stride[1] or g.x[2] == 1)  # "square or 1d"
                   and g.x[1] >= 32)  # "min 32 channels supported"
    if not kernel_cond:
        return False
    if flags.depthwise_kernel == "native":  # CuDNNDepthwiseKernel::NATIVE
        return False
    if flags.depthwise_kernel == "cudnn":
        return True
    return _depthwise_workload_suits_cudnn(g.x, g.w, g.stride[1])


def _depthwise_workload_suits_cudnn(x: Sequence[int], w: Sequence[int], stride: int) -> bool:
    # check_cudnn_depthwise_workload_with_filter (Convolution.cpp, "simplified version for cudnn
    # 8.2 and above"): which FP16 NCHW depthwise shapes cuDNN's kernels run faster
    batch, channels, height, width = x[0], x[1], x[2], x[3]
    if height == 1 and stride == 1:  # 1-D
        return True
    if w[2] != w[3]:  # square filters only
        return False
    kernel = w[3]
    if kernel not in (1, 3, 5) or width < 7:
        return False
    if stride == 1:
        return True
    if stride != 2:
        return False
    if batch == 1:
        return (kernel == 1 and width <= 28) or kernel in (3, 5)
    if kernel == 1:
        return batch <= 16 and channels >= 128 and width <= 7
    return channels >= 512 or (channels >= 256 and width >= 28)
