"""bitsandbytes (QLoRA's 4-bit and LLM.int8()'s 8-bit layers, its 8-bit and paged optimizers) under
the probe: what its CUDA kernels allocate on the GPU, traced without one.

Nothing here imports bitsandbytes: it is patched when the script imports it (an after-import
hook, ``distributed._AfterImport``), and the patches go with the probe's others (``Patches``).
The sources named below are bitsandbytes 0.50.2 (``bitsandbytes/...`` in its wheel).

Since 0.45 bitsandbytes runs its kernels as ``torch.library`` custom ops (``_ops.py``), each
with a fake implementation that makes its outputs, so shapes trace as they are. What does not:

- Quantized weights are ``nn.Parameter`` subclasses made with ``torch.Tensor._make_subclass``
  (``nn/modules.py``, ``Params4bit.__new__``, ``Int8Params.__new__``), which refuses a fake
  tensor ("the raw Tensor object is already associated to a python object of type
  FakeTensor"). In fake mode the weight is the fake tensor itself, given a class that is both
  the bitsandbytes class (its own ``to``/``cuda``/``_quantize`` run, ``isinstance`` holds, the
  class keeps its name for the libraries that test ``__class__.__name__``) and ``FakeTensor``;
  the probe's modules are told it is fake (their ``is_fake``). Quantization then runs
  bitsandbytes' own Python (``Params4bit._quantize``, ``functional.quantize_4bit``) on fake
  tensors, and what it allocates on the GPU is what the CUDA kernels' outputs are: the packed
  weight, ``(n + 1) // 2`` bytes for ``n`` weights (``backends/cuda/ops.py``,
  ``quantize_4bit``: ``out`` of ``(n + 1) // (quant_storage.itemsize * 2)`` elements), one
  float32 absmax per block of 64 (``-(n // -blocksize)`` blocks, ``Params4bit.__new__``'s
  default blocksize), the 16-entry code table (``functional.get_4bit_type``); with double
  quantization (``compress_statistics``, ``functional.quantize_4bit``) the absmax is quantized
  again: its mean (the offset, 4 bytes), one uint8 per block and one float32 per 256 blocks
  (``quantize_blockwise(..., blocksize=256)``), and a copy of the 256-entry dynamic map per
  weight (``QuantState(code=code.to(A.device, copy=True))``), after the transient
  full-precision copy of the weight on the GPU (``self.data.contiguous().to(device)``). 8-bit:
  the int8 weight and one float32 scale per row (``Int8Params._quantize``,
  ``int8_vectorwise_quant``), after a transient float16 copy.
- The CUDA kernels' own temporaries, which a fake implementation does not make, are replayed
  around it (the tracker's ``KERNEL_TEMPORARIES``, as ``kernels`` does for ATen's):
  ``gemm_4bit`` (``backends/cuda/ops.py``): above 1,536 rows, for a blocksize that does not
  divide the inner dimension, or where bitsandbytes' own per-GPU heuristic
  (``_gemm_4bit_use_custom_cuda``, asked with the target GPU's SM count and capability) prefers
  it, ``_dequant_linear_fallback`` dequantizes the weight to the compute dtype (an N x K block)
  and runs ``F.linear`` (cuBLAS), after the float32 absmax it dequantizes first for a nested
  state (two per-block float32 tensors); the fused kernel makes only its output.
  ``int8_scaled_mm`` (``backends/default/ops.py``, run on CUDA too) makes the int32 product
  (``int8_linear_matmul``), the float16 dequantized one (``int8_mm_dequant``) and its cast to
  the input's dtype. ``int8_double_quant`` (``backends/cuda/ops.py``) adds the column
  statistics' temporaries. Backward needs no more: ``MatMul4Bit.backward`` dequantizes through
  ops whose fake implementations are what the CUDA kernels make.
- LLM.int8()'s outlier decomposition (a ``threshold`` above 0, transformers' default
  ``llm_int8_threshold=6.0``) allocates by the number of activation columns over the
  threshold, a value of the data: fake mode asks for real values (``NeedsRealValues``; auto
  mode falls back to profile).
- Paged optimizer state (``PagedAdamW``, ``PagedAdamW8bit``, ``Trainer(optim="paged_...")``)
  is ``cudaMallocManaged`` memory bitsandbytes takes outside PyTorch's caching allocator
  (``functional.get_paged``: ``lib.cget_managed_ptr``) for every state tensor of a parameter of
  at least 1e5 elements (``Optimizer8bit.get_state_buffer``), never freed (the
  ``GlobalPageManager`` keeps it), and prefetched to the GPU before each update
  (``Optimizer8bit.prefetch_state``: ``cudaMemPrefetchAsync`` to the parameter's device). The
  driver evicts it to the host only when the GPU runs out of memory, which a job sized to fit
  never does: the state is resident GPU memory. It is traced as blocks made where the state is
  made, kept for the run (the simulator places them in its pool: at most one 2 MiB rounding
  per tensor over the driver's own page granularity). ``fill``, ``_mul`` and the prefetches
  run as their torch equivalents (no ctypes call reaches a driver).

Code outside bitsandbytes may call its native library itself through ctypes (fused LoRA kernels
dequantize NF4 weights so: ``lib.cdequantize_blockwise_fp32`` for the nested absmax, then
``lib.cdequantize_blockwise_bf16_nf4``, with the tensors' ``data_ptr()`` and the raw current
stream). Those entry points allocate nothing: each launches one kernel that writes into the
buffers its caller made with torch (csrc/pythonInterface.cpp, ``cdequantize_blockwise_*`` and
``cquantize_blockwise_*`` call ``dequantizeBlockwise`` / ``quantizeBlockwise`` in csrc/ops.cu,
which launch ``kDequantizeBlockwise`` / ``kQuantizeBlockwise`` on ``out`` and ``absmax`` and no
``cudaMalloc``; read at bitsandbytes 0.50.2.dev0). In fake mode they accept the call and do
nothing (the buffers are fake; their making is traced); the library's other GPU entry points
refuse when called (``GPUOnlyCall``: kernels not modelled here).
``torch._C._cuda_getCurrentRawStream``, which the probe otherwise refuses (a raw stream is how
custom CUDA extensions launch kernels), answers the default stream's handle to code that reaches
bitsandbytes' library and no other native code: a module whose globals hold bitsandbytes (a
module of it, its library or one of its entry points) and no ctypes library, foreign function
or compiled extension module of another (``_patch_native``). Any other caller is refused as
before, and bitsandbytes' own CUDA ops keep the refusing binding they took at import
(backends/cuda/ops.py, ``_get_raw_stream``). In profile mode these kernels cannot run on the
host: the raw stream stays refused, with that reason.

The 8-bit optimizers' blockwise state (``optim/optimizer.py``, ``Optimizer2State.init_state``:
uint8 ``state1``/``state2``, one float32 absmax each per block of 256, the two 256-entry maps
shared by all parameters) is made with plain torch calls and traced as it is; their update
kernel works in place (its fake implementation makes nothing).

Profile mode (real execution on the CPU) runs bitsandbytes' CPU and default kernels as they
are (their temporaries are the CPU code's, not CUDA's); only the paged buffers are replaced as
above (``cudaMallocManaged`` has no device to map there).

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Set, Tuple

import torch

from xmem_admission.estimator.probe.distributed import _AfterImport
from xmem_admission.estimator.probe.outcomes import GPUOnlyCall
from xmem_admission.estimator.probe.tracker import AllocationTracker
from xmem_admission.estimator.trace import Category, NoteKind

MODULE = "bitsandbytes"
_IMPORT = _AfterImport(MODULE)

# backends/cuda/ops.py, gemm_4bit: "if M > _gemm_4bit_custom_max_m: use_custom = False" (1536
# on CUDA); read from the module where it has it
GEMM_4BIT_CUSTOM_MAX_M = 1536
# backends/cuda/ops.py, _int8_linear_matmul_impl: "cuBLASLt does not support int8 matmul with
# inner dimensions that are not divisible by 4" (then an fp32 matmul)
INT8_MATMUL_ALIGN = 4

Handler = Callable[[Callable[[], Any], Callable[[torch.Tensor], torch.Tensor], Tuple[Any, ...],
                    Dict[str, Any]], Any]


class _Probe:
    """What the patches need of the probe run: its tracker, the virtual GPU, the mode."""

    def __init__(self, patches: Any, props: Any, tracker: AllocationTracker, fake: bool) -> None:
        self.patches = patches
        self.props = props
        self.tracker = tracker
        self.fake = fake
        self.fake_classes: Dict[type, type] = {}
        self.fake_types: Set[type] = set()


def install(patches: Any, props: Any, tracker: AllocationTracker, fake: bool) -> None:
    """Patch bitsandbytes when the script imports it (now, if it already has)."""
    probe = _Probe(patches, props, tracker, fake)
    if MODULE in sys.modules:
        _patch(probe)
    else:
        _IMPORT.arm(patches, lambda _module: _patch(probe))


def _patch(probe: _Probe) -> None:
    functional = sys.modules.get(f"{MODULE}.functional")
    if functional is not None:
        _patch_paged(probe, functional)
    modules = sys.modules.get(f"{MODULE}.nn.modules")
    quantized = tuple(getattr(modules, name) for name in ("Params4bit", "Int8Params")
                      if hasattr(modules, name))
    _patch_moves(probe, quantized)
    _patch_native(probe)
    if not probe.fake:
        return
    if quantized:
        _patch_make_subclass(probe, quantized)
        _patch_quantize(probe, quantized)
    _patch_kernels(probe)


def _patch_moves(probe: _Probe, quantized: Tuple[type, ...]) -> None:
    """``Params4bit.to`` and ``Int8Params.to`` move their data with ``super().to(...)``, which on
    a GPU is the tensor's own move. Under the probe that move is the virtual device's
    (``virtual_cuda.DeviceMode._move``), which makes it by calling ``src.to`` with the host
    device: on these classes that would run their ``to`` again (and quantize again, move the
    quantization state to the host, or refuse ``copy=``). The virtual device's own call, made
    while it says which side it allocates on (``tracker.device_flag``), gets the tensor's move."""
    tracker = probe.tracker
    for cls in quantized:
        real = cls.__dict__.get("to")
        if real is None:
            continue

        def to(self: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if tracker.device_flag is not None:
                return torch.Tensor.to(self, *args, **kwargs)
            return _real(self, *args, **kwargs)

        probe.patches.set(cls, "to", to)


# -- quantized weights as fake tensors ---------------------------------------------------------
def _patch_make_subclass(probe: _Probe, quantized: Tuple[type, ...]) -> None:
    """``torch.Tensor._make_subclass(cls, data)`` for a bitsandbytes weight class and fake (or
    host) data: the fake tensor, detached (same storage, as ``_make_subclass`` aliases it), of
    a class that is both ``cls`` and ``FakeTensor``."""
    from torch._subclasses.fake_tensor import FakeTensor

    real = torch.Tensor._make_subclass
    tracker = probe.tracker

    def make_subclass(cls: Any, data: Any, require_grad: bool = False, *args: Any,
                      **kwargs: Any) -> Any:
        if not (isinstance(cls, type) and issubclass(cls, quantized)
                and isinstance(data, torch.Tensor)):
            return real(cls, data, require_grad, *args, **kwargs)
        if not isinstance(data, FakeTensor):
            if data.device.type not in ("cpu", "meta") or tracker.is_cuda(data):
                return real(cls, data, require_grad, *args, **kwargs)
            # host data that becomes a weight: shape-only, as an nn.Parameter's is in fake mode
            # (torch_patches._patch_parameters)
            data = tracker.adopt_parameter(data)
        made = data.detach()
        made.requires_grad_(bool(require_grad))
        made.__class__ = _fake_class(probe, cls)
        return made

    probe.patches.set(torch.Tensor, "_make_subclass", staticmethod(make_subclass))


def _fake_class(probe: _Probe, cls: type) -> type:
    """``cls`` and ``FakeTensor`` in one class (``cls`` itself when it is one already), named as
    ``cls`` is: transformers, PEFT and accelerate test ``__class__.__name__``."""
    from torch._subclasses.fake_tensor import FakeTensor

    if issubclass(cls, FakeTensor):
        return cls
    made = probe.fake_classes.get(cls)
    if made is None:
        made = type(cls.__name__, (cls, FakeTensor),
                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        if not probe.fake_types:
            _teach_is_fake(probe)
        probe.fake_classes[cls] = made
        probe.fake_types.add(made)
    return made


def _teach_is_fake(probe: _Probe) -> None:
    """The probe's modules tell a fake tensor by its class's name (``tracker.is_fake``), and a
    bitsandbytes weight keeps its class's name: every probe module that took ``is_fake`` gets
    one that also knows these classes."""
    from xmem_admission.estimator.probe import tracker as tracker_module

    original = tracker_module.is_fake
    types = probe.fake_types

    def is_fake(t: Any) -> bool:
        return bool(original(t)) or type(t) in types

    for name, module in list(sys.modules.items()):
        if name.startswith("xmem_admission.estimator.probe") and \
                getattr(module, "is_fake", None) is original:
            probe.patches.set(module, "is_fake", is_fake)


def _patch_quantize(probe: _Probe, quantized: Tuple[type, ...]) -> None:
    """After ``_quantize`` (what moving a bitsandbytes weight to the GPU runs), the quantization
    state is the layer's parameter memory: tagged so, and said in a note."""
    tracker = probe.tracker
    for cls in quantized:
        real = cls.__dict__.get("_quantize")
        if real is None:
            continue

        def quantize(self: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            out = _real(self, *args, **kwargs)
            parts = _quant_state_tensors(self)
            for tensor in parts:
                tracker.tag(tensor, Category.PARAMETER)
            _note_weight(tracker, self)
            return out

        probe.patches.set(cls, "_quantize", quantize)


def _quant_state_tensors(weight: Any) -> List[torch.Tensor]:
    """The GPU tensors a quantized weight holds besides its data: a 4-bit weight's
    ``QuantState`` (functional.py: absmax, code, offset, and the nested state's absmax and
    code), an 8-bit weight's row scales (``Int8Params.SCB``)."""
    found: List[torch.Tensor] = []
    state = getattr(weight, "quant_state", None)
    while state is not None:
        for name in ("absmax", "code", "offset"):
            value = getattr(state, name, None)
            if isinstance(value, torch.Tensor):
                found.append(value)
        state = getattr(state, "state2", None)
    scales = getattr(weight, "SCB", None)
    if isinstance(scales, torch.Tensor):
        found.append(scales)
    return found


def _note_weight(tracker: AllocationTracker, weight: Any) -> None:
    state = getattr(weight, "quant_state", None)
    if state is not None:
        kind = (f"{getattr(state, 'quant_type', '?')} 4-bit"
                + (" with double quantization" if getattr(state, "nested", False) else ""))
        what = "the packed weight and its quantization state (functional.quantize_4bit)"
    else:
        kind = "int8"
        what = "the int8 weight and its row scales (Int8Params._quantize)"
    tracker.trace.note(NoteKind.MODELLED,
                       f"bitsandbytes {kind} weights: {what} traced from bitsandbytes' fake "
                       f"kernels as its CUDA kernels allocate them",
                       key=f"bitsandbytes weights {kind}")


# -- the CUDA kernels' temporaries -------------------------------------------------------------
def _patch_kernels(probe: _Probe) -> None:
    """Add bitsandbytes' ops to the tracker's table of CUDA kernels with temporaries."""
    from xmem_admission.estimator.probe import tracker as tracker_module

    ops = getattr(torch.ops, MODULE, None)
    handlers: Dict[Any, Handler] = {}
    for name, handler in (("gemm_4bit", _gemm_4bit(probe)),
                          ("int8_scaled_mm", _int8_scaled_mm(probe)),
                          ("int8_vectorwise_quant", _int8_vectorwise_quant(probe)),
                          ("int8_double_quant", _int8_double_quant(probe))):
        packet = _packet(ops, name)
        if packet is not None:
            handlers[packet.default] = handler
    if handlers:
        table = dict(getattr(tracker_module, "KERNEL_TEMPORARIES"))  # noqa: B009 - re-exported
        table.update(handlers)
        probe.patches.set(tracker_module, "KERNEL_TEMPORARIES", table)


def _packet(ops: Any, name: str) -> Any:
    try:
        return getattr(ops, name)
    except (AttributeError, RuntimeError):  # an older bitsandbytes without this op
        return None


def _bind(names: Tuple[str, ...], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    bound: Dict[str, Any] = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    return bound


class _Scratch:
    """Temporaries a kernel holds while it runs, freed in the reverse order of their making
    (C++ locals; Python's are dropped when the function returns)."""

    def __init__(self, record: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.record = record
        self.held: List[torch.Tensor] = []

    def make(self, shape: Any, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        tensor = self.record(like.new_empty(tuple(int(n) for n in shape), dtype=dtype))
        self.held.append(tensor)
        return tensor

    def drop(self, count: int = 1) -> None:
        for _ in range(count):
            self.held.pop()

    def release(self) -> None:
        while self.held:
            self.held.pop()


def _mark_cublas(tracker: AllocationTracker) -> None:
    """An ``F.linear`` run inside a bitsandbytes kernel goes through cuBLAS: the thread's first
    BLAS op creates its handle and workspace, as the tracker marks for ATen's."""
    thread = "autograd" if tracker.phase == "backward" else "main"
    threads = tracker._blas_threads
    if thread not in threads:
        threads.add(thread)
        tracker.trace.mark(f"cublas:{thread}")


def _uses_fused_gemm(probe: _Probe, cuda_ops: Any, dtype: torch.dtype, m: int, n: int, k: int,
                     blocksize: int) -> bool:
    """Does bitsandbytes' ``gemm_4bit`` (backends/cuda/ops.py) run its fused kernel on the target
    GPU, or dequantize and call ``F.linear``? Its own heuristic decides, asked with the virtual
    GPU's SM count and capability (its cached ``_gpu_dispatch_props`` is bypassed: the GPU is the
    probe's)."""
    if cuda_ops is None:
        return False  # not knowable: the fallback, which allocates more
    max_m = int(getattr(cuda_ops, "_gemm_4bit_custom_max_m", GEMM_4BIT_CUSTOM_MAX_M))
    if m > max_m or k % blocksize != 0:
        return False
    choose = getattr(cuda_ops, "_gemm_4bit_use_custom_fn", None)
    if choose is None:
        return False
    choose = getattr(choose, "__wrapped__", choose)  # functools.cache's function
    props = probe.props
    answer = (int(props.multi_processor_count), int(props.major), int(props.minor))
    previous = cuda_ops.__dict__.get("_gpu_dispatch_props")
    cuda_ops._gpu_dispatch_props = lambda _index: answer
    try:
        return bool(choose(0, dtype, m, n, k))
    finally:
        cuda_ops._gpu_dispatch_props = previous


def _gemm_4bit(probe: _Probe) -> Handler:
    names = ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit",
             "absmax_code", "absmax_offset")
    tracker = probe.tracker

    def handler(run: Callable[[], Any], record: Callable[[torch.Tensor], torch.Tensor],
                args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = _bind(names, args, kwargs)
        a, shape_b = bound["A"], [int(n) for n in bound["shapeB"]]
        k = int(a.shape[-1])
        m = int(a.numel()) // max(k, 1)
        n = shape_b[0]
        scratch = _Scratch(record)
        cuda_ops = sys.modules.get(f"{MODULE}.backends.cuda.ops")
        fused = _uses_fused_gemm(probe, cuda_ops, a.dtype, m, n, k, int(bound["blocksize"]))
        path = ("the fused kernel (its output only)" if fused
                else "dequantization of the weight for F.linear")
        tracker.trace.note(
            NoteKind.MODELLED,
            f"bitsandbytes gemm_4bit: {path}, as bitsandbytes' heuristic picks on the traced GPU "
            f"({probe.props.name}) for the calls' tokens and weight shapes "
            f"(backends/cuda/ops.py, gemm_4bit)", key=f"bitsandbytes gemm_4bit fused={fused}")
        if fused:
            # _gemm_4bit_kernel_impl: "A = A.contiguous()", then out
            if not a.is_contiguous():
                scratch.make(a.shape, a, a.dtype)
            out = record(run())
        else:
            # _dequant_linear_fallback
            nested = bound.get("absmax_8bit")
            if nested is not None:
                # "absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)" and
                # "absmax = absmax_dq + absmax_offset"
                scratch.make(nested.shape, a, torch.float32)
                scratch.make(nested.shape, a, torch.float32)
            # "B_dq = torch.empty(shapeB, dtype=A.dtype, device=A.device)"
            scratch.make(shape_b, a, a.dtype)
            _mark_cublas(tracker)
            out = record(run())  # "torch.nn.functional.linear(A, B_dq, bias)"
        scratch.release()
        return out

    return handler


def _int8_scaled_mm(probe: _Probe) -> Handler:
    names = ("A", "B", "row_stats", "col_stats", "bias", "dtype")

    def handler(run: Callable[[], Any], record: Callable[[torch.Tensor], torch.Tensor],
                args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = _bind(names, args, kwargs)
        a, b = bound["A"], bound["B"]
        dtype = bound.get("dtype") or torch.float16
        shape = (*a.shape[:-1], b.shape[0])
        scratch = _Scratch(record)
        # backends/default/ops.py, int8_scaled_mm: "out_i32 = int8_linear_matmul(A, B)"
        # (backends/cuda/ops.py: "torch.empty(..., dtype=torch.int32)")
        scratch.make(shape, a, torch.int32)
        if int(a.shape[-1]) % INT8_MATMUL_ALIGN != 0:
            # _int8_linear_matmul_impl: "torch.matmul(B.float(), A.float().t()).to(torch.int32)"
            scratch.make(a.shape, a, torch.float32)
            scratch.make(b.shape, a, torch.float32)
            scratch.make(shape, a, torch.float32)
            scratch.make(shape, a, torch.int32)
            scratch.drop(4)
        # int8_mm_dequant (backends/cuda/ops.py): "out = torch.empty_like(A, dtype=torch.float16)",
        # returned as "out.to(dtype or torch.float16)": a copy for another dtype
        if dtype == torch.float16:
            out = record(run())
        else:
            scratch.make(shape, a, torch.float16)
            out = record(run())
            scratch.drop()
        scratch.release()
        return out

    return handler


def _refuse_outliers(kernel: str, threshold: float) -> None:
    from xmem_admission.estimator.probe.virtual_cuda import NeedsRealValues

    raise NeedsRealValues(
        f"bitsandbytes' {kernel} with an outlier threshold of {threshold} (LLM.int8()'s "
        f"mixed-precision decomposition, transformers' llm_int8_threshold) allocates by the "
        f"number of activation columns over the threshold, a value of the data "
        f"(backends/cuda/ops.py, int8_vectorwise_quant: torch.argwhere(outliers.any(dim=0)))")


def _int8_vectorwise_quant(probe: _Probe) -> Handler:
    def handler(run: Callable[[], Any], record: Callable[[torch.Tensor], torch.Tensor],
                args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        threshold = float(_bind(("A", "threshold"), args, kwargs).get("threshold", 0.0))
        if threshold > 0.0:
            _refuse_outliers("int8_vectorwise_quant", threshold)
        # backends/cuda/ops.py: row_stats and out_row, what the fake implementation makes
        return record(run())

    return handler


def _int8_double_quant(probe: _Probe) -> Handler:
    def handler(run: Callable[[], Any], record: Callable[[torch.Tensor], torch.Tensor],
                args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = _bind(("A", "threshold"), args, kwargs)
        a, threshold = bound["A"], float(bound.get("threshold", 0.0))
        if threshold > 0.0:
            _refuse_outliers("int8_double_quant", threshold)
        # backends/cuda/ops.py, int8_double_quant with threshold 0 (its fake implementation
        # asks for a dynamic size of outlier columns, which this kernel does not make):
        # int8_vectorwise_quant's row quantization, then _get_col_absmax and the column one
        cols = int(a.shape[-1])
        rows = int(a.numel()) // max(cols, 1)
        scratch = _Scratch(record)
        quant_row = record(a.new_empty(tuple(a.shape), dtype=torch.int8))
        row_stats = record(a.new_empty((rows,), dtype=torch.float32))
        scratch.make(a.shape, a, a.dtype)  # "absA = A.abs().view(-1, A.shape[-1])"
        scratch.make((cols,), a, a.dtype)  # "absA.amax(dim=0)"
        col_stats = record(a.new_empty((cols,), dtype=torch.float32))  # ".float()"
        scratch.drop(2)
        # "torch.round(A.mul(127.0) / col_stats.unsqueeze(0)).to(torch.int8)": the product in
        # A's dtype, the quotient and its rounding promoted to float32 by col_stats
        scratch.make(a.shape, a, a.dtype)
        scratch.make(a.shape, a, torch.float32)
        scratch.drop(2)
        scratch.make(a.shape, a, torch.float32)
        quant_col = record(a.new_empty(tuple(a.shape), dtype=torch.int8))
        scratch.release()
        return quant_row, quant_col, row_stats, col_stats, None

    return handler


# -- paged optimizer state ---------------------------------------------------------------------
def _patch_paged(probe: _Probe, functional: Any) -> None:
    """Paged state as resident GPU memory (see the module's docstring): ``get_paged`` makes a
    tensor on the (virtual) GPU, marked paged as bitsandbytes marks its own; ``fill``, ``_mul``
    and the prefetches are their torch equivalents or nothing."""
    tracker = probe.tracker

    def get_paged(*shape: Any, dtype: torch.dtype = torch.float32, device: Any = None) -> Any:
        # functional.get_paged: "num_bytes = dtype.itemsize * prod(shape)" of managed memory
        out = torch.empty(tuple(int(n) for n in shape), dtype=dtype, device="cuda")
        out.is_paged = True
        out.page_deviceid = getattr(device, "index", None) or 0
        tracker.tag(out, Category.OPTIMIZER_STATE)
        tracker.trace.note(
            NoteKind.MODELLED,
            "bitsandbytes paged optimizer state (cudaMallocManaged, outside PyTorch's caching "
            "allocator) counted as resident GPU memory: bitsandbytes prefetches it to the GPU "
            "before every update and never frees it (functional.get_paged, "
            "Optimizer8bit.prefetch_state)", key="bitsandbytes paged state")
        return out

    def fill(a: Any, value: Any, device: Any = None, prefetch: bool = True) -> None:
        with torch.no_grad():
            a.fill_(value)

    def mul(a: Any, b: Any, device: Any = None) -> None:
        with torch.no_grad():
            a.mul_(b)

    probe.patches.set(functional, "get_paged", get_paged)
    probe.patches.set(functional, "fill", fill)
    probe.patches.set(functional, "_mul", mul)
    probe.patches.set(functional, "prefetch_tensor", lambda *a, **k: None)


# -- the native library called through ctypes --------------------------------------------------
# csrc/pythonInterface.cpp: the GPU entry points of blockwise (de)quantization, one per input or
# output dtype and 4-bit type (the ``_cpu_`` ones are host code, left as they are)
_NATIVE_BLOCKWISE = tuple(
    f"c{kind}_blockwise_{dtype}{quant}" for kind in ("quantize", "dequantize")
    for dtype in ("fp16", "bf16", "fp32") for quant in ("", "_fp4", "_nf4"))
# CUDA's default (legacy) stream has a null cudaStream_t, and the virtual GPU's current stream is
# its default stream (streams are inert on it): c10/cuda/CUDAStream.cpp, the default stream's
# stream() is nullptr, which _cuda_getCurrentRawStream returns as 0
DEFAULT_STREAM_HANDLE = 0
_RAW_STREAM = "_cuda_getCurrentRawStream"
_EXTENSIONS = (".so", ".pyd", ".dylib")


def _patch_native(probe: _Probe) -> None:
    """In fake mode, bitsandbytes' native library accepts its (de)quantization calls and refuses
    its other GPU entry points when called, and the raw current stream is answered to code that
    reaches that library and no other native code (the module's docstring); in profile mode,
    the raw stream's refusal says why for that code."""
    import ctypes

    cextension = sys.modules.get(f"{MODULE}.cextension")
    lib = getattr(cextension, "lib", None)
    if lib is None:
        return
    ours: Set[int] = set()  # the entry points made here: none launches a kernel
    if probe.fake:
        for name in _NATIVE_BLOCKWISE:
            entry = _accept_native(name, getattr(lib, name, None))
            ours.add(id(entry))
            probe.patches.set(lib, name, entry)
        refusing = _refusing_library(type(lib), ours)
        probe.patches.set(lib, "__class__", refusing)
    own = getattr(lib, "_lib", None)
    refuse = getattr(torch._C, _RAW_STREAM, None)
    # where the standard library's extension modules are: beside ctypes' own (lib-dynload;
    # none where the interpreter has them built in)
    builtin = str(getattr(sys.modules.get("_ctypes"), "__file__", None) or "")
    stdlib = os.path.dirname(builtin) + os.sep if builtin else None

    def native_elsewhere(value: Any) -> bool:
        """A native library, function or compiled extension module that is not bitsandbytes':
        what it launches with a stream is not known."""
        if isinstance(value, ctypes.CDLL):
            return value is not own
        if isinstance(value, ctypes._CFuncPtr):  # type: ignore[attr-defined]
            return True  # a native function that would run: not one made here
        if isinstance(value, type(sys)):
            path = str(getattr(value, "__file__", None) or "")
            # the standard library's extension modules (math, _ctypes) and torch's own bindings
            # (the probe answers or refuses those) launch nothing
            return path.endswith(_EXTENSIONS) and not (stdlib and path.startswith(stdlib)) and \
                value.__name__.split(".")[0] not in (MODULE, "torch")
        return False

    def in_reach(scope: Dict[str, Any]) -> bool:
        found = False
        for value in list(scope.values()):
            if native_elsewhere(value):
                return False
            if value is lib or id(value) in ours or (
                    isinstance(value, type(sys)) and (value.__name__ == MODULE or
                                                     value.__name__.startswith(MODULE + "."))):
                found = True
        return found

    def raw_stream(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        if not in_reach(caller.f_globals):
            if refuse is None:
                raise GPUOnlyCall(f"torch._C.{_RAW_STREAM}", "a raw cudaStream_t")
            return refuse(*args, **kwargs)
        module = str(caller.f_globals.get("__name__", "the script"))
        if not probe.fake:
            raise GPUOnlyCall(
                f"torch._C.{_RAW_STREAM}",
                f"a raw cudaStream_t for bitsandbytes' native CUDA kernels, called through "
                f"ctypes by {module}: profile mode runs the job on the host, where they cannot "
                f"run; fake mode traces them")
        probe.tracker.trace.note(
            NoteKind.MODELLED,
            f"{module} asks for the raw CUDA stream to call bitsandbytes' native library "
            f"itself: answered with the default stream's handle; its (de)quantization entry "
            f"points write into buffers made with torch (traced) and allocate nothing "
            f"(csrc/ops.cu, dequantizeBlockwise / quantizeBlockwise)",
            key=f"bitsandbytes raw stream {module}")
        return DEFAULT_STREAM_HANDLE

    probe.patches.set(torch._C, _RAW_STREAM, raw_stream)


def _with_signature(entry: Callable[..., Any], name: str, real: Any) -> Callable[..., Any]:
    """``entry`` named ``name``, with the ctypes signature the real one was given (``argtypes``,
    set by backends/cuda/ops.py's ``_setup_ctypes``: callers test it to choose how to pass
    pointers)."""
    entry.__name__ = name
    for attribute in ("argtypes", "restype"):
        value = getattr(real, attribute, None)
        if value is not None:
            setattr(entry, attribute, value)
    return entry


def _accept_native(name: str, real: Any) -> Callable[..., None]:
    """A stand-in for bitsandbytes' native ``name`` that accepts the call and writes nothing."""

    def accept(*_args: Any) -> None:
        return None

    return _with_signature(accept, name, real)


def _refusing_library(library: type, ours: Set[int]) -> type:
    """``library`` (bitsandbytes' ``BNBNativeLibrary``), whose entry points other than the ones
    set on the instance refuse when called: kernels the probe does not model. Refused on call,
    not on lookup: modules bind entry points at import that a training run may never call. Host
    code (the ``_cpu_`` entry points) is the library's own."""

    made: Dict[str, Any] = {}  # one per name, as the library's own lookup is cached

    def refusing_entry(self: Any, name: str) -> Any:
        real = library.__getattr__(self, name)  # type: ignore[attr-defined]
        if name.startswith("__") or "_cpu_" in name:
            return real
        if name in made:
            return made[name]

        def refuse(*_args: Any, **_kwargs: Any) -> Any:
            raise GPUOnlyCall(
                f"bitsandbytes' native {name}",
                "a CUDA kernel of bitsandbytes' library called through ctypes, whose GPU memory "
                "the probe does not model; only its blockwise (de)quantization is")

        entry = made[name] = _with_signature(refuse, name, real)
        ours.add(id(entry))
        return entry

    return type(library.__name__, (library,), {"__getattr__": refusing_entry,
                                              "__module__": library.__module__,
                                              "__qualname__": library.__qualname__})
