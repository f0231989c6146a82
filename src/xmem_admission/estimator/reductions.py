"""The probe's ``reduce:`` marks: CUDA reductions whose kernel stages partial results in global
memory, and the blocks that staging takes from the caching allocator on a given GPU.

PyTorch runs ``sum``, ``mean``, ``prod``, ``nansum``, ``amax``/``amin``, ``argmax``/``argmin``,
``var``/``std`` (and ``var_mean``/``std_mean``) and ``linalg_vector_norm`` on CUDA through one
kernel template, ``gpu_reduce_kernel`` (aten/src/ATen/native/cuda/Reduce.cuh, torch 2.11: the
header ships in the wheel, ``torch/include/ATen/native/cuda/Reduce.cuh``). When its launch
configuration splits the values of each output across several thread blocks
(``ReduceConfig::should_global_reduce()``, "more than one CTA per output"), it asks the caching
allocator for a staging buffer of ``config.global_memory_size()`` bytes and then for
``config.semaphore_size()`` bytes of semaphores (Reduce.cuh, ``gpu_reduce_kernel``:
``buffer = allocator.allocate(config.global_memory_size()); semaphores =
allocator.allocate(config.semaphore_size());``). Both are ``at::DataPtr`` locals of that
function: they are freed when it returns, right after the launch, semaphores first (locals are
destroyed in reverse order). The op's output exists before (structured kernels allocate it in
their meta function), so the stream reads: output, buffer, semaphores, free semaphores, free
buffer. The H200 snapshot of gpt-134m-bf16-b8-adamw (bench/data/H200/snapshots-1.tar) shows
exactly that around each RMSNorm weight gradient: 3,072 B (the [768] float output), 50,331,648 B,
24 B, then the two frees.

The launch configuration (``setReduceConfig``) depends on the GPU: its SM count
(``multiProcessorCount``), resident threads per SM (``maxThreadsPerMultiProcessor``) and warp
size. The trace is made once and simulated for every target GPU, so the probe records only what
the GPU does not decide (the mark below) and ``orchestrate`` sizes the blocks per GPU with
``staging_blocks``, as it does for cuDNN's workspaces (``conv_marks``).

A mark reads ``reduce:OP x=SHAPE s=STRIDES d=DIMS o=OFFSET b=IN_BYTES ob=OUT_BYTES acc=ARG_BYTES
vt=VT0 n=OUTPUTS [cv=1]``: the input as the kernel reads it (sizes, strides and storage offset in
elements, element size), the reduced dimensions (all of them for a full reduction), the output's
element size, the size of the kernel's accumulator type ``arg_t``, its unroll factor ``vt0``
(also ``input_vec_size``, which defaults to it for every op here) and the number of outputs.
``cv=1``: the kernel reads a converted copy of the input, not the input (a ``sum``, ``mean``,
``prod`` or norm into another dtype: ReduceOpsUtils.h ``make_reduction_from_out_ty`` reduces
``self.to(in_dtype)`` unless a half or bfloat16 input is reduced into float on CUDA, which one
kernel does): ``x``, ``s`` and ``b`` then describe that copy, allocated after the output and
held until the reduction returns (the iterator owns it).

The rules are torch 2.11's; the headers of 2.14 and 2.15 set the same configuration (2.15
writes ``ctas_per_output`` as a ``std::clamp`` of the same three figures). torch 2.2's header
differs in one place: it vectorizes along the input only where ``dim0 > 128`` and ``vt0 >= 4``
(here: ``dim0 >= 128``, any ``vt0``), which changes the blocks of a reduction along the fastest
dimension with exactly 128 values per output or of ``var``/``std`` there; which release between
the two changed it is not checked, so every trace is sized by 2.11's rule.

Not modelled: reductions that do not reach ``gpu_reduce_kernel`` (softmax, cross entropy,
``native_layer_norm_backward``'s weight and bias gradients: their own kernels); ``any``/``all``;
complex inputs.

Standard library only (the probe bundle; the probe turns tensors into the numbers used here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from xmem_admission.contract.gpu_devices import ARCHITECTURES
from xmem_admission.contract.gpus import GPU
from xmem_admission.estimator.trace import mark_fields

PREFIX = "reduce:"
_INT32_MAX = 2**31 - 1  # std::numeric_limits<int32_t>::max() (TensorIterator.cpp)

Dims = Tuple[int, ...]


@dataclass(frozen=True)
class ReductionMark:
    """One ``reduce:`` mark (see the module's docstring for the fields)."""

    op: str
    shape: Dims
    strides: Dims
    dims: Dims
    offset: int
    itemsize: int
    out_itemsize: int
    acc_bytes: int
    vt0: int = 4
    outputs: int = 1
    converted: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def copy_bytes(self) -> int:
        """The converted copy of the input the kernel reads, 0 when it reads the input."""
        return self.numel * self.itemsize if self.converted else 0

    def label(self) -> str:
        def text(values: Sequence[int]) -> str:
            return ",".join(str(int(v)) for v in values)

        return (f"{PREFIX}{self.op} x={text(self.shape)} s={text(self.strides)} "
                f"d={text(self.dims)} o={self.offset} b={self.itemsize} ob={self.out_itemsize} "
                f"acc={self.acc_bytes} vt={self.vt0} n={self.outputs}"
                + (" cv=1" if self.converted else ""))

    @classmethod
    def parse(cls, label: str) -> ReductionMark:
        """The mark of ``label``; ValueError when it is not a well-formed ``reduce:`` mark."""
        op, fields = mark_fields(label, PREFIX)

        def dims(name: str) -> Dims:
            return tuple(int(d) for d in fields.get(name, "").split(",") if d)

        try:
            mark = cls(op, dims("x"), dims("s"), dims("d"),
                       int(fields["o"]), int(fields["b"]), int(fields["ob"]),
                       int(fields["acc"]), int(fields.get("vt", "4")), int(fields.get("n", "1")),
                       fields.get("cv") == "1")
        except KeyError as missing:
            raise ValueError(f"reduce: mark without {missing}: {label!r}") from None
        if len(mark.shape) != len(mark.strides) or any(
                not 0 <= d < max(len(mark.shape), 1) for d in mark.dims):
            raise ValueError(f"reduce: mark with mismatched x, s and d: {label!r}")
        if min(mark.itemsize, mark.out_itemsize, mark.acc_bytes, mark.vt0, mark.outputs) < 1:
            raise ValueError(f"reduce: mark with a non-positive size: {label!r}")
        return mark


# -- which ops, and their kernel's types -----------------------------------------------------------

# dtype names as str(torch.dtype) without "torch."
_LOW_PRECISION = ("float16", "bfloat16")

# The reductions that reach gpu_reduce_kernel, by ATen overload, and how each names its reduced
# dims: (kind, index of the dim argument or None for "all dims", index of the dtype argument or
# None). Kinds pick the accumulator type below.
OPS: Dict[str, Tuple[str, Optional[int], Optional[int]]] = {
    "aten.sum.default": ("sum", None, 1),
    "aten.sum.dim_IntList": ("sum", 1, 3),
    "aten.nansum.default": ("sum", 1, 3),
    "aten.mean.default": ("sum", None, 1),
    "aten.mean.dim": ("sum", 1, 3),
    "aten.prod.default": ("sum", None, 1),
    "aten.prod.dim_int": ("sum", 1, 3),
    "aten.linalg_vector_norm.default": ("sum", 2, 4),
    "aten.amax.default": ("minmax", 1, None),
    "aten.amin.default": ("minmax", 1, None),
    "aten.argmax.default": ("arg", 1, None),
    "aten.argmin.default": ("arg", 1, None),
    "aten.var.correction": ("welford", 1, None),
    "aten.std.correction": ("welford", 1, None),
    "aten.var_mean.correction": ("welford", 1, None),
    "aten.std_mean.correction": ("welford", 1, None),
}

_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
             "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8,
             "complex128": 16}


def _accumulator(kind: str, in_dtype: str, out_dtype: str) -> Optional[Tuple[int, int]]:
    """(sizeof(arg_t), vt0) of the kernel an op of ``kind`` launches, None where it is not known
    here (complex, or an input PyTorch converts first)."""
    if in_dtype not in _ITEMSIZE or out_dtype not in _ITEMSIZE or "complex" in in_dtype:
        return None
    if kind == "sum":
        # ReduceSumProdKernel.cu ``reduce_dispatch`` / ReduceMomentKernel.cu
        # ``mean_kernel_cuda`` / ReduceNormKernel.cu: a half or bfloat16 output, or such an input
        # reduced into float ("type promotion that does cast and reduction in a single kernel"),
        # accumulates in float; any other type in itself (``OpFunctor<scalar_t>``, acc_t =
        # scalar_t). ``gpu_reduce_kernel<scalar_t, out_t>``: vt0 = input_vec_size = 4.
        # (an input of another dtype is reduced as a copy in the output's: ``_converts``)
        if out_dtype in _LOW_PRECISION or (in_dtype in _LOW_PRECISION and out_dtype == "float32"):
            return 4, 4
        return _ITEMSIZE[out_dtype], 4
    if kind == "minmax":
        # ReduceMaxValuesKernel.cu / ReduceMinValuesKernel.cu: ``gpu_reduce_kernel<scalar_t,
        # scalar_t>(iter, func_wrapper<acc_t>(...))`` with acc_t = scalar_t
        return _ITEMSIZE[in_dtype], 4
    if kind == "arg":
        # SharedReduceOps.h ``ArgReductionOps``: arg_t = detail::pair<acc_t, int64_t>, 16 bytes
        # for every acc_t up to 8 bytes
        return 16, 4
    if kind == "welford":
        # ReduceMomentKernel.cu ``std_var_kernel_impl``: ``gpu_reduce_kernel<scalar_t, scalar_t,
        # 2>`` (vt0 = 2, "reducing unrolling factor to 2 for welford kernel"), arg_t =
        # WelfordData<acc_type<scalar_t, true>, int32_t> (SharedReduceOps.h: mean, m2, n, nf):
        # float accumulators 4+4+4+4 bytes, double 8+8+4(+4 padding)+8
        if in_dtype == "float64":
            return 32, 2
        if in_dtype in _LOW_PRECISION or in_dtype == "float32":
            return 16, 2
        return None
    return None


def _converts(kind: str, in_dtype: str, out_dtype: str) -> bool:
    """Does ``make_reduction_from_out_ty`` reduce ``self.to(out_dtype)`` instead of ``self``?
    (ReduceOpsUtils.h: ``gpu_lowp_to_f32`` keeps a half or bfloat16 input for a float output.)"""
    return (kind == "sum" and in_dtype != out_dtype
            and not (in_dtype in _LOW_PRECISION and out_dtype == "float32"))


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """``is_non_overlapping_and_dense``: the dims, sorted by stride, step exactly over the ones
    inside them (size-1 dims aside)."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(shape, strides) if n != 1),
                               key=lambda pair: pair[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def mark_for(op: str, args: Sequence[Any], kwargs: Dict[str, Any], out: Any
             ) -> Optional[ReductionMark]:
    """The ``reduce:`` mark of an ATen reduction (``op`` its overload, as ``str(func)`` writes
    it: ``aten.sum.dim_IntList``) that runs through ``gpu_reduce_kernel`` on a GPU, or None.
    ``args``/``kwargs`` are the op's arguments and ``out`` its result; tensors are read through
    ``shape``, ``stride()``, ``storage_offset()`` and ``dtype`` only."""
    spec = OPS.get(op)
    if spec is None or not args:
        return None
    kind, dim_index, dtype_index = spec
    x = args[0]
    if not hasattr(x, "stride") or not hasattr(x, "shape"):
        return None
    first = out[0] if isinstance(out, (tuple, list)) else out
    if not hasattr(first, "dtype"):
        return None
    shape = tuple(int(s) for s in x.shape)
    numel = math.prod(shape)
    if numel == 0:
        return None  # "if (iter.numel() == 0) result.zero_()": no kernel
    dim_arg: Any = None
    if dim_index is not None:
        dim_arg = args[dim_index] if len(args) > dim_index else kwargs.get("dim")
    if isinstance(dim_arg, int):
        dim_arg = [dim_arg]
    ndim = len(shape)
    if not dim_arg:  # None or []: every dimension (ReduceOpsUtils.h ``make_dim_mask``)
        dims: Dims = tuple(range(ndim))
    else:
        dims = tuple(sorted({int(d) % max(ndim, 1) for d in dim_arg}))
    in_dtype = _dtype_name(x.dtype)
    out_dtype = _dtype_name(first.dtype)
    if kind == "arg":
        out_dtype = in_dtype  # the int64 index is not the reduced type
    if dtype_index is not None:
        requested = args[dtype_index] if len(args) > dtype_index else kwargs.get("dtype")
        if requested is not None and kind == "sum":
            out_dtype = _dtype_name(requested)
    types = _accumulator(kind, in_dtype, out_dtype)
    if types is None:
        return None
    acc, vt0 = types
    strides = tuple(int(s) for s in x.stride())
    offset = int(x.storage_offset())
    converted = _converts(kind, in_dtype, out_dtype)
    itemsize = _ITEMSIZE[out_dtype if converted else in_dtype]
    if converted:
        # ``Tensor::to`` keeps a dense input's strides (memory_format=preserve), else
        # contiguous; the copy is a block of its own
        offset = 0
        if not _dense(shape, strides):
            strides = tuple(_contiguous(shape))
    if kind == "arg" and dim_index is not None and dim_arg is None:
        # argmax without a dim reduces ``self.reshape({-1})`` (TensorCompare.cpp): a flat view
        shape, strides, dims = (numel,), (1,), (0,)
    outputs = len(out) if isinstance(out, (tuple, list)) else 1
    return ReductionMark(op.split(".")[1], shape, strides, dims, offset, itemsize,
                         _ITEMSIZE[_dtype_name(first.dtype)], acc, vt0, outputs, converted)


def _contiguous(shape: Sequence[int]) -> List[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(shape[d + 1]), 1)
    return strides


# -- TensorIterator, as reduce_op builds it ---------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """A reduction's TensorIterator after ``reorder_dimensions`` and ``coalesce_dimensions``:
    the shape, reduced dims first, and the byte strides of the output and of the input."""

    shape: Dims
    out_strides: Dims
    in_strides: Dims
    in_itemsize: int
    out_itemsize: int
    in_offset_bytes: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_reduce_dims(self) -> int:  # TensorIteratorBase::num_reduce_dims
        return sum(1 for s in self.out_strides if s == 0)

    @property
    def num_output_elements(self) -> int:  # TensorIteratorBase::num_output_elements
        total = 1
        for size, stride in zip(self.shape, self.out_strides):
            if stride != 0 or size == 0:
                total *= size
        return total

    def can_use_32bit_indexing(self) -> bool:  # TensorIteratorBase::can_use_32bit_indexing
        if self.numel > _INT32_MAX:
            return False
        for strides in (self.out_strides, self.in_strides):
            if 1 + sum((n - 1) * s for n, s in zip(self.shape, strides)) > _INT32_MAX:
                return False
        return True


def geometry(mark: ReductionMark) -> Geometry:
    """The iterator ``TensorIterator::reduce_op(viewed_result, self)`` builds (TensorIterator.cpp):
    the output viewed with size 1 in the reduced dims (``review_reduce_result``), contiguous as
    the meta function allocates it, so its byte strides are 0 there (``compute_strides``: a size
    1 against a larger shape broadcasts); dims sorted by stride with the reduced ones first
    (``reorder_dimensions``), then adjacent dims merged where every operand steps through them
    as one (``coalesce_dimensions``)."""
    shape = list(mark.shape)
    ndim = len(shape)
    out_sizes = [1 if d in mark.dims else n for d, n in enumerate(shape)]
    out_elems = [0] * ndim
    running = 1
    for d in reversed(range(ndim)):
        out_elems[d] = running
        running *= out_sizes[d]
    out = [0 if (out_sizes[d] == 1 and shape[d] != 1) else out_elems[d] * mark.out_itemsize
           for d in range(ndim)]
    inp = [mark.strides[d] * mark.itemsize for d in range(ndim)]
    operands = [out, inp]

    def should_swap(dim0: int, dim1: int) -> int:
        for index, strides in enumerate(operands):
            s0, s1 = strides[dim0], strides[dim1]
            if index == 0 and (s0 == 0) != (s1 == 0):  # "move reduced dimensions to the front"
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[dim0] > shape[dim1]:
                return 1
        return 0

    perm = list(reversed(range(ndim)))
    if ndim > 1:  # insertion sort with ambiguous comparisons, as reorder_dimensions does
        for i in range(1, ndim):
            dim1 = i
            for dim0 in range(i - 1, -1, -1):
                comparison = should_swap(perm[dim0], perm[dim1])
                if comparison > 0:
                    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                    dim1 = dim0
                elif comparison < 0:
                    break
    shape = [shape[p] for p in perm]
    operands = [[strides[p] for p in perm] for strides in operands]
    if ndim > 1:
        prev = 0
        for dim in range(1, ndim):
            if shape[prev] == 1 or shape[dim] == 1 or all(
                    shape[prev] * s[prev] == s[dim] for s in operands):
                if shape[prev] == 1:
                    for s in operands:
                        s[prev] = s[dim]
                shape[prev] *= shape[dim]
            else:
                prev += 1
                if prev != dim:
                    for s in operands:
                        s[prev] = s[dim]
                    shape[prev] = shape[dim]
        shape = shape[:prev + 1]
        operands = [s[:prev + 1] for s in operands]
    return Geometry(tuple(shape), tuple(operands[0]), tuple(operands[1]), mark.itemsize,
                    mark.out_itemsize, mark.offset * mark.itemsize)


# -- ReduceConfig, as setReduceConfig sets it --------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """What ``setReduceConfig`` reads of the GPU (``at::cuda::getCurrentDeviceProperties()``)."""

    multi_processor_count: int
    max_threads_per_multi_processor: int
    warp_size: int = 32


@dataclass(frozen=True)
class ReduceConfig:
    """The parts of Reduce.cuh's ``ReduceConfig`` that size its global memory."""

    element_size_bytes: int
    num_outputs: int
    num_inputs: int
    block_width: int
    block_height: int
    output_vec_size: int
    step_output: int
    ctas_per_output: int
    input_mult: Tuple[int, int, int]

    def should_global_reduce(self) -> bool:
        return self.input_mult[2] != 0

    def should_block_x_reduce(self) -> bool:
        return self.input_mult[0] != 0

    def grid_x(self) -> int:  # grid().x
        return _div_up(self.num_outputs // self.output_vec_size, self.step_output)

    def global_memory_size(self) -> int:
        if not self.should_global_reduce():
            return 0
        size = self.element_size_bytes * self.num_outputs * self.ctas_per_output
        if not self.should_block_x_reduce():
            size *= self.block_width * self.output_vec_size
        return size

    def semaphore_size(self) -> int:
        if not self.should_global_reduce():
            return 0
        return 4 * self.grid_x()  # sizeof(int) * grid().x


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def _last_pow2(n: int) -> int:
    # Reduce.cuh last_pow2 on an int: the highest power of two <= n, at least 1
    n &= 0xFFFFFFFF
    for shift in (1, 2, 4, 8, 16):
        n |= n >> shift
    return max(1, n - (n >> 1))


def _output_vec_size(g: Geometry) -> int:
    # Reduce.cuh get_output_vec_size: 4, halved until it divides the input's base address (in
    # elements), the size of the first output dim and every other input stride (in elements).
    # The caching allocator's blocks are 512-byte aligned (kMinBlockSize), so the address is the
    # storage offset's.
    vec = 4

    def update(n: int) -> None:
        nonlocal vec
        while n % vec != 0:
            vec //= 2

    update(g.in_offset_bytes // g.in_itemsize)
    index = g.num_reduce_dims
    update(g.shape[index])
    for j, stride in enumerate(g.in_strides):
        if j != index:
            update(stride // g.in_itemsize)
    return vec


def reduce_config(g: Geometry, acc_bytes: int, vt0: int, device: Device,
                  max_num_threads: int = 512) -> ReduceConfig:
    """Reduce.cuh ``setReduceConfig<arg_t, scalar_t, vt0, input_vec_size=vt0>`` for the iterator
    ``g`` on ``device`` (``max_num_threads``: ``mnt_wrapper<scalar_t>::MAX_NUM_THREADS``, 512 but
    for complex double)."""
    num_outputs = g.num_output_elements
    inputs_per_output = g.numel // num_outputs
    if g.ndim > 0:
        on_fastest = (g.num_reduce_dims == g.ndim
                      or g.in_strides[0] < g.in_strides[g.num_reduce_dims])
        if on_fastest:
            dim0, dim1 = inputs_per_output, num_outputs
            fastest_stride = g.in_strides[0]
        else:
            dim0, dim1 = num_outputs, inputs_per_output
            fastest_stride = g.in_strides[g.num_reduce_dims]
    else:
        on_fastest, fastest_stride, dim0, dim1 = True, g.in_itemsize, 1, 1
    output_vec_size = 1
    if fastest_stride == g.in_itemsize:
        if on_fastest and dim0 >= 128 and g.num_reduce_dims == 1:
            dim0 //= vt0  # "vectorize along input" (input_vec_size = vt0)
        elif not on_fastest:
            output_vec_size = _output_vec_size(g)  # "vectorize along output"
            dim0 //= output_vec_size
    # set_block_dimension
    threads = max_num_threads // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < threads else threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < threads else threads
    block_width = min(dim0_pow2, device.warp_size)
    block_height = min(dim1_pow2, threads // block_width)
    block_width = min(dim0_pow2, threads // block_height)
    num_threads = block_width * block_height
    step_input, step_output = 1, 1
    input_mult = [0, 0, 0]
    if g.ndim == 0 or on_fastest:
        input_mult[0], step_input = step_input, step_input * block_width
    else:
        step_output *= block_width  # output_mult[0]
    min_values_per_thread, max_values_per_thread = 16, 256  # CUDA (not ROCm) figures

    def values_per_thread() -> int:
        return _div_up(inputs_per_output, step_input)

    if values_per_thread() >= min(block_height * 16, max_values_per_thread):
        input_mult[1], step_input = step_input, step_input * block_height  # across warps
    else:
        step_output *= block_height
    blocks_per_sm = device.max_threads_per_multi_processor // num_threads
    target_grid_size = device.multi_processor_count * blocks_per_sm
    grid = _div_up(num_outputs // output_vec_size, step_output)
    ctas_per_output = 1
    if (input_mult[1] != 0 and values_per_thread() >= max_values_per_thread
            and grid <= target_grid_size):
        ctas1 = _div_up(target_grid_size, grid)
        ctas2 = _div_up(values_per_thread(), min_values_per_thread)
        ctas3 = _div_up(values_per_thread(), max_values_per_thread)
        ctas_per_output = max(min(ctas1, ctas2), ctas3)
        if ctas_per_output > 1:
            input_mult[2], step_input = step_input, step_input * ctas_per_output
    return ReduceConfig(acc_bytes, num_outputs, inputs_per_output, block_width, block_height,
                        output_vec_size, step_output, ctas_per_output,
                        (input_mult[0], input_mult[1], input_mult[2]))


def _split(g: Geometry) -> Tuple[Geometry, Geometry]:
    # TensorIteratorBase::get_dim_to_split and split: the dim of largest byte extent (the last
    # one scanned from the end wins ties), halved; the first half runs first (SplitUntil32Bit
    # pushes it last onto its stack). A reduction's narrow does not coalesce again.
    best, dim = -1, -1
    for d in reversed(range(g.ndim)):
        if g.shape[d] == 0:
            continue
        for strides in (g.out_strides, g.in_strides):
            extent = (g.shape[d] - 1) * abs(strides[d])
            if extent > best:
                best, dim = extent, d
    first = g.shape[dim] // 2
    second = g.shape[dim] - first

    def with_size(size: int, start: int) -> Geometry:
        shape = g.shape[:dim] + (size,) + g.shape[dim + 1:]
        return replace(g, shape=shape, in_offset_bytes=g.in_offset_bytes
                       + start * g.in_strides[dim])

    return with_size(first, 0), with_size(second, first)


def _kernels(g: Geometry) -> List[Geometry]:
    """The iterators ``gpu_reduce_kernel`` launches on: ``iter.with_32bit_indexing()``."""
    if g.can_use_32bit_indexing() or g.ndim == 0:
        return [g]
    first, second = _split(g)
    return _kernels(first) + _kernels(second)


@dataclass(frozen=True)
class Staging:
    """The blocks one launch of a reduction takes: the staging buffer, then the semaphores."""

    buffer: int
    semaphores: int


def accumulation_buffer(mark: ReductionMark) -> int:
    """Reduce.cuh ``AccumulationBuffer``: an iterator too large for 32-bit indexing whose output
    cannot accumulate in itself (half into half, bfloat16 into bfloat16: ``can_accumulate_in_output``
    is false) gets a buffer of ``sizeof(arg_t)`` per output element, for all its launches
    (unless ``arg_t`` is no larger than the output's type: then the output is the buffer)."""
    g = geometry(mark)
    if g.can_use_32bit_indexing() or not (mark.itemsize == mark.out_itemsize == 2
                                          and mark.acc_bytes > mark.out_itemsize):
        return 0
    size = mark.out_itemsize
    for n, stride in zip(g.shape, g.out_strides):
        size = max(size, n * stride)
    return (size // mark.out_itemsize) * mark.acc_bytes


def staging_blocks(mark: ReductionMark, device: Device) -> List[Staging]:
    """The staging buffer and semaphores of each launch of ``mark``'s reduction on ``device``,
    only the launches that reduce across thread blocks."""
    g = geometry(mark)
    out: List[Staging] = []
    for sub in _kernels(g):
        config = reduce_config(sub, mark.acc_bytes, mark.vt0, device)
        if config.should_global_reduce():
            out.append(Staging(config.global_memory_size(), config.semaphore_size()))
    return out


def device_of(gpu: GPU) -> Optional[Device]:
    """What ``setReduceConfig`` reads of a catalogue GPU: its SM count (the catalogue's
    ``multi_processor_count``, from torch's device reprs) and its architecture's resident threads
    per SM and warp size (``gpu_devices.ARCHITECTURES``, the CUDA Programming Guide's table);
    None for an architecture the table lacks."""
    limits = ARCHITECTURES.get(gpu.compute_capability)
    if limits is None:
        return None
    return Device(gpu.multi_processor_count, limits.max_threads_per_sm, limits.warp_size)
