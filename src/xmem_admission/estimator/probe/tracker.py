"""Allocation capture at the dispatcher: every storage the job would put on the GPU, in order.

``AllocationTracker`` is a ``TorchDispatchMode``. It sees each ATen op after autograd, notes
every *new* storage an op returns, decides whether that storage would live on the GPU (the
virtual CUDA device, see ``virtual_cuda``) or on the host, and records GPU storages as ``alloc``
events of a ``trace.Trace``. It holds storages by weak reference only: when Python drops the
last reference, the weakref callback records the matching ``free`` at that exact point of the
program, which is when the CUDA caching allocator would get the block back.

In fake mode (shape-only execution under ``FakeTensorMode``) it also keeps *shadows*: real
values for small tensors that the script computes from Python data (optimizer step counters,
RegNet's width arithmetic, token ids, attention masks). Any op whose inputs all have shadows is
replayed for real on the shadows, so ``.item()``/``.tolist()`` on them answer truthfully and the
model the probe traces is the model the script builds. Values the probe cannot know (the loss)
raise ``DataDependentValue``; ``virtual_cuda`` turns that into a placeholder for logging or a
fallback to profile mode for decisions. An op whose output size depends on values it lacks
(``x[mask]``, ``nonzero``, ``unique``) is sized at its largest (``bounded``).

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import traceback
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from xmem_admission.estimator.conv_marks import ConvFlags, ConvMark, as_2d, routes_to_cudnn
from xmem_admission.estimator.probe import bounded
from xmem_admission.estimator.probe.kernels import OPS as KERNEL_TEMPORARIES
from xmem_admission.estimator.probe.outcomes import NeedsRealValues
from xmem_admission.estimator.reductions import OPS as REDUCTION_OPS
from xmem_admission.estimator.reductions import mark_for as reduction_mark
from xmem_admission.estimator.trace import (
    ALL_GATHER,
    ALLOC,
    LOSS,
    RECOMPUTED,
    Alloc,
    Category,
    NoteKind,
    Trace,
)

aten = torch.ops.aten
Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]

# Shadows: factory ops with no tensor input get a real value only when small (a step counter, a
# handful of widths, a batch's ``torch.ones(batch, seq)`` attention mask up to 64K tokens, which
# transformers 4.x inspects with ``torch.all(mask == 1)``), so building a 7B model never computes
# real weights (those start as ``empty``, which has no value). Ops on shadowed inputs are replayed
# for real up to DERIVED_NUMEL_LIMIT elements (token ids and masks of a batch fit).
SMALL_FACTORY_NUMEL = 1 << 16
DERIVED_NUMEL_LIMIT = 1 << 22

# Host data in fake mode (see AllocationTracker._host_data): factories that make an order or a
# range are real at any size (a sampler's randperm over every index of a dataset); other host
# factories up to HOST_FACTORY_NUMEL elements (64 MiB of fp32; a label vector of a dataset of
# millions fits); bulk beyond (a synthetic batch of 256 images of 224x224x3 is 38.5M elements)
# is shape-only.
_INDEX_FACTORIES = {aten.randperm, aten.arange}
HOST_FACTORY_NUMEL = 1 << 24

# A device flag for C++ code that makes GPU buffers and host bookkeeping from factories with the
# same (host) device: floating-point factories are GPU memory, integer ones are host data. DDP's
# reducer allocates its gradient buckets with the parameters' options and its bucket indices as
# kInt host tensors (reducer.cpp, ``initialize_buckets`` and ``sync_bucket_indices``).
FLOATING_ON_GPU = "floating-on-gpu"

# Outputs that live on the host whatever the inputs' device: a PackedSequence's batch_sizes
# (PackedSequence.py: "batch_sizes should always be on CPU"; _pack_padded_sequence makes it there).
_HOST_OUTPUTS = {aten._pack_padded_sequence.default: (1,)}

# Questions about a tensor's metadata that C++ asks a Python tensor (a fake tensor answers its
# device through the dispatcher: fake_tensor.py, _DISPATCH_META_HANDLERS). They make no value and
# no memory, and a training step asks tens of thousands of them (34,421 for one 7B step pair,
# 93,259 as rank 0 of 64 FSDP2 ranks: bench/coverage/distributed.py --speed), so they skip the bookkeeping.
_PRIM_DEVICE = torch.ops.prim.device.default
_METADATA_QUERIES = frozenset({_PRIM_DEVICE, aten.size.default, aten.stride.default,
                               aten.storage_offset.default})
# ``record_function``'s enter and exit (torch/autograd/profiler.py): a name on the profiler's
# timeline, no tensor. FSDP2 opens one around every all-gather, reduce-scatter and hook, 1,588
# per two steps as rank 0 of a 64-way 7B job. Neither the tracker nor the fake mode below it has
# anything to do with them (fake mode took 0.2-0.4 ms for each, as for a factory op), so they run
# with every mode off, as in a run without the probe.
try:
    _TIMELINE_MARKS = frozenset({torch.ops.profiler._record_function_enter_new.default,
                                 torch.ops.profiler._record_function_exit._RecordFunction})
except (AttributeError, RuntimeError):  # a torch without these overloads: traced as any op
    _TIMELINE_MARKS = frozenset()
_META = torch.device("meta")


def _fake_device(t: Any) -> Optional[torch.device]:
    """A fake tensor's answer to ``prim.device``, as fake mode gives it (fake_tensor.py,
    ``_device_handler``: "meta" inside a kernel, else the fake device); None for any other
    tensor, or a torch whose fake tensors keep these elsewhere (then fake mode answers)."""
    mode = getattr(t, "fake_mode", None)
    device = getattr(t, "fake_device", None)
    if mode is None or not isinstance(device, torch.device):
        return None
    return _META if getattr(mode, "in_kernel_invocation", False) else device

# Ops whose output is the input's value, kept for any size (the data the script brought in).
_LIFT_OPS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
# Uninitialised memory has no value worth shadowing (weights are created this way, then their
# init is neutralised in fake mode).
_NO_VALUE_PACKETS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
                     aten.new_empty_strided, aten.empty_permuted}

# Ops that run through cuBLAS on a GPU: the first one on a thread creates that thread's cuBLAS
# handle and its workspace (aten/src/ATen/cuda/CublasHandlePool.cpp, getCurrentCUDABlasHandle).
# Forward ops run on the main thread, backward ops on the autograd engine's device thread.
_BLAS_PACKETS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.addmv, aten.mv,
                 aten.dot, aten.vdot, aten._addmm_activation}

# Convolutions run through cuDNN on a GPU, which asks the caching allocator for a workspace
# around each call and frees it after (aten/src/ATen/native/cudnn/Conv_v8.cpp, ``try_plans``:
# ``c10::cuda::CUDACachingAllocator::get()->allocate(workspace_size)`` inside the call). The
# probe marks each one PyTorch sends to cuDNN (``conv_marks``) with its shapes, geometry, layout,
# dtype and torch.backends.cudnn's flags; ``orchestrate`` sizes the workspace for the target GPU.
_CONV_FORWARD = aten.convolution.default
# Reductions that may stage partial results in global memory on a GPU (``reductions``).
_REDUCTION_PACKETS = {getattr(aten, name.split(".")[1]) for name in REDUCTION_OPS
                      if hasattr(aten, name.split(".")[1])}
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


def conv_mark(func: Any, args: Args, out: Any, flags: Optional[ConvFlags] = None
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


# NaN/Inf checks and the answer they give on values fake mode does not know (see
# _propagate_shadows); HF Trainer, for one, filters its logged loss this way every step.
# Ops whose result is zero when either input is zero, whatever the other holds (integers and
# booleans: no NaN times zero), and boolean ORs, all true when either input is.
# addmm's out_dtype overloads (torch >= 2.8: ``addmm.dtype``, ``addmm.dtype_out``).
_ADDMM_OUT_DTYPE = {getattr(aten.addmm, name) for name in ("dtype", "dtype_out")
                    if name in aten.addmm.overloads()}
# Ops whose value is a constant of the input's shape (None: the fill is the second argument).
_CONSTANT_LIKE = {aten.ones_like: 1, aten.zeros_like: 0, aten.full_like: None}
_OR_PACKETS = {aten.bitwise_or, aten.logical_or}
_ABSORBING = {aten.bitwise_and, aten.logical_and, aten.mul} | _OR_PACKETS
_FINITE_CHECKS = {aten.isnan: False, aten.isinf: False, aten.isposinf: False,
                  aten.isneginf: False, aten.isfinite: True}

# Provisional categories by phase; refined when the block is freed (see ``_on_free``).
_PHASE_CATEGORY = {
    "forward": Category.ACTIVATION.value,
    # between the model's forward and backward: the loss, whose inputs autograd keeps
    "loss": Category.ACTIVATION.value,
    "backward": Category.TEMPORARY.value,
    "optimizer": Category.OPTIMIZER_STATE.value,
}


class DataDependentValue(Exception):
    """Internal: the script asked for a value fake execution does not know (the message says
    which value, and where it came from)."""


# torch's own Python files (a path under the folder of torch's package, not any path with a
# "torch" folder in it: a user's environment may be called that).
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def where_in_script() -> str:
    """The innermost frame outside torch and xmem: where the script is now."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = frame.filename
        if name.startswith(_TORCH_DIR) or "xmem_admission" in name or name.startswith("<"):
            continue
        return f"{name}:{frame.lineno} ({(frame.line or '').strip()[:80]})"
    return "unknown location"


class _Block:
    __slots__ = ("ident", "nbytes", "category", "phase", "phase_seq", "event", "module")

    def __init__(self, ident: int, nbytes: int, category: str, phase: str, phase_seq: int,
                 event: int, module: str) -> None:
        self.ident = ident
        self.nbytes = nbytes
        self.category = category
        self.phase = phase
        self.phase_seq = phase_seq
        self.event = event
        self.module = module


# Attributes through which a wrapper holds the module it wraps: the level is left out of module
# paths (DDP's and DataParallel's ``module``, FSDP1's ``_fsdp_wrapped_module``,
# checkpoint_wrapper's ``_checkpoint_wrapped_module``, torch.compile's ``_orig_mod``).
# The classes that hold it (empty: any).
_WRAPPER_ATTRS: Dict[str, Tuple[str, ...]] = {
    "_fsdp_wrapped_module": (), "_checkpoint_wrapped_module": (), "_orig_mod": (),
    "module": ("DistributedDataParallel", "DataParallel")}
# An autograd node made outside the thread's sequence (AccumulateGrad's, UINT64_MAX in
# torch/csrc/autograd/function.h) belongs to no forward module.
_NO_SEQUENCE = 1 << 63


class _ModuleTracker:
    """The ``nn.Module`` running now, and which module made each autograd node.

    Module paths come from the probe's global forward hooks (``enter``/``exit``). Autograd
    numbers its nodes in creation order on each thread (``Node::sequence_nr``,
    torch/csrc/autograd/function.h, from ``at::sequence_number::get_and_increment``); at each
    module boundary the next number is noted, so a backward node's number names the forward
    module that was running when the node was made (``module_of_node``). Python has no
    binding that reads the counter, so it is read by making one node (a view of a leaf) with
    the dispatcher's and torch-function modes off: two module boundaries per module call, a
    few microseconds each.
    """

    def __init__(self) -> None:
        self.stack: List[Tuple[Any, str]] = []
        self.path = ""
        self.outside = ""  # the path outside any module: LOSS after a forward, else ""
        self._paths: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._starts: List[int] = []
        self._at: List[str] = []
        self._leaf: Optional[torch.Tensor] = None

    def _next_sequence_nr(self) -> int:
        if self._leaf is None:
            with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
                self._leaf = torch.zeros(1, requires_grad=True)
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), \
                torch.enable_grad():
            node = self._leaf.view(1).grad_fn
        return int(node._sequence_nr()) + 1 if node is not None else 0

    def _boundary(self) -> None:
        try:
            start = self._next_sequence_nr()
        except Exception:  # noqa: BLE001 - a torch without these guards: forward paths only
            return
        if self._starts and self._starts[-1] == start:
            self._at[-1] = self.path
        else:
            self._starts.append(start)
            self._at.append(self.path)

    def path_of(self, module: Any) -> str:
        path = self._paths.get(module)
        if path is None:
            path = self._name(module)
            try:
                self._paths[module] = path
            except TypeError:  # not weakly referenceable: named again next time
                pass
        return path

    def _name(self, module: Any) -> str:
        if not self.stack:
            return type(module).__name__
        parent, parent_path = self.stack[-1]
        return child_path(parent, parent_path, module, _child_name(parent, module),
                          len(self.stack) == 1)

    def enter(self, module: Any) -> None:
        if not self.stack:
            self.outside = ""
        path = self.path_of(module)
        self.stack.append((module, path))
        self.path = path
        self._boundary()

    def exit(self, module: Any) -> None:
        stack = self.stack
        for depth in range(len(stack) - 1, -1, -1):
            if stack[depth][0] is module:
                del stack[depth:]
                break
        else:
            return
        self.path = stack[-1][1] if stack else self.outside
        self._boundary()

    def leave_forward(self) -> None:
        """The model's forward is over: what runs outside modules now is the loss."""
        if not self.stack:
            self.outside = self.path = LOSS
            self._boundary()

    def reset(self) -> None:
        """A backward starts: any forward left open (one that raised) is over."""
        self.stack.clear()
        self.outside = self.path = ""
        self._boundary()

    def module_of_node(self, sequence_nr: int) -> str:
        if sequence_nr >= _NO_SEQUENCE:
            return ""
        at = bisect.bisect_right(self._starts, sequence_nr) - 1
        return self._at[at] if at >= 0 else ""


def child_path(parent: Any, parent_path: str, child: Any, attr: Optional[str],
               parent_is_root: bool) -> str:
    """The module path of ``child``, held by ``parent`` under ``attr`` (None: not held)."""
    if attr is None:
        return f"{parent_path}.{type(child).__name__}"
    owners = _WRAPPER_ATTRS.get(attr.split(".")[-1])
    if owners is not None and (not owners or type(parent).__name__ in owners):
        # a wrapper level: the wrapped module takes the wrapper's path (under a root wrapper,
        # its own class name, as a root has)
        return type(child).__name__ if parent_is_root else parent_path
    return f"{parent_path}.{attr}"


def _child_name(parent: Any, child: Any) -> Optional[str]:
    """The attribute path under which ``parent`` holds ``child`` (None: it does not)."""
    for name, sub in getattr(parent, "_modules", {}).items():
        if sub is child:
            return str(name)
    named = getattr(parent, "named_modules", None)
    if named is not None:
        try:
            for name, sub in named():
                if sub is child and name:
                    return str(name)
        except Exception:  # noqa: BLE001 - a module whose children cannot be listed
            return None
    return None


_VIEW_SIZES: List[bool] = []


def _views_resize_storages() -> bool:
    """Does this torch's fake mode report a view's extent as its storage's size?

    torch 2.3's does: after ``base[:, :64]`` of a fake (1, 128) int64 tensor, ``base``'s and the
    view's ``untyped_storage().nbytes()`` read 512, not 1,024; another view sets it again
    (measured here with 2.3.1; 2.2.2, 2.8.0 and 2.14.1 keep 1,024). A view never allocates nor
    resizes on a GPU, and the size such a view reports is never above the storage's, so there a
    storage only counts as resized when it grows past its block (``torch.Tensor.resize_`` grows
    storages and never shrinks them; shrinking takes ``UntypedStorage.resize_``, which FSDP uses,
    and FSDP is traced with real values on 2.3: ``distributed._refuse_fake_on_2_3``). Asked of
    torch itself, once, so a vendor's build of any release is judged by what it does."""
    if not _VIEW_SIZES:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with _disable_current_modes(), FakeTensorMode():
            base = torch.empty(4, dtype=torch.uint8)
            view = base[:2]
            _VIEW_SIZES.append(view.untyped_storage().nbytes() != 4)
    return _VIEW_SIZES[0]


class AllocationTracker(TorchDispatchMode):  # type: ignore[misc]  # torch is read as Any
    """Records the GPU allocation stream of the ops that run under it."""

    def __init__(self, trace: Trace, fake: bool, fake_mode: Any = None) -> None:
        super().__init__()
        self.trace = trace
        self.fake = fake
        self.fake_mode = fake_mode
        # Whether a view op rewrites the size its fake storage reports (``_views_resize_storages``).
        self._view_sizes = fake and _views_resize_storages()
        # storage -> _Block for GPU storages; host storages map to None. Weak keys only.
        self._storages = WeakIdKeyDictionary()
        self._shadows = WeakIdKeyDictionary()
        # fake tensor without a value -> where it came from (for the fallback's reason)
        self._origins = WeakIdKeyDictionary()
        # fake storage -> the address its data_ptr() reports (see ``address``)
        self._addresses = WeakIdKeyDictionary()
        self._next_address = 1 << 32
        self._next_id = 1
        self.phase = "setup"
        self.phase_seq = 0
        # Set by the virtual device around calls that create memory on a given side.
        self.device_flag: Optional[str] = None
        self.default_cuda = False
        self.live_bytes = 0
        self.peak_live_bytes = 0
        # GPU blocks made by forward passes since the last optimizer step (the probe's guard).
        self.forward_allocations = 0
        # Told of every op after a backward pass, and whether it writes into a parameter (steps
        # made without torch.optim, see runner._StepHooks).
        self.on_parameter_update: Optional[Callable[[bool], None]] = None
        self._mutated_cache: Dict[Any, Tuple[int, ...]] = {}
        self._refs: Dict[int, Any] = {}
        # > 0 while an op runs: torch's own code then sees real devices (see patches).
        self.dispatch_depth = 0
        self._blas_threads: Set[str] = set()
        # The autograd node whose ops run now, and the first block id made under it.
        self._node_key: Optional[Tuple[int, int]] = None
        self._node_first_block = 0
        # Attribution (trace v2): the module running, the module of the autograd node running,
        # and the op whose outputs are being recorded.
        self.modules = _ModuleTracker()
        self._node_module = ""
        self._source = ""
        self._source_names: Dict[Any, str] = {}

    # -- phases -----------------------------------------------------------------------------
    def enter_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_seq += 1

    # -- what the rest of the probe asks ----------------------------------------------------
    def is_cuda(self, tensor: torch.Tensor) -> bool:
        try:
            return self._storages.get(_local(tensor).untyped_storage()) is not None
        except (RuntimeError, NotImplementedError):
            return False

    def tag(self, tensor: Optional[torch.Tensor], category: Category,
            module: Optional[str] = None) -> None:
        """Give the GPU block behind ``tensor`` an explicit category (parameter, gradient...)
        and, when given, the module it belongs to."""
        if tensor is None:
            return
        try:
            block = self._storages.get(_local(tensor).untyped_storage())
        except (RuntimeError, NotImplementedError):
            return
        if block is None or block.event < 0:
            return
        if module is not None and block.module != module:
            block.module = module
            event = self.trace.events[block.event]
            if event.op == ALLOC:
                self.trace.events[block.event] = event._replace(module=module)
        if block.category == category.value:
            return
        block.category = category.value
        self._recategorize(block, category.value)

    def tag_parameters(self, root: Any) -> None:
        """Tag a root module's parameters and buffers, each with the module that holds it."""
        todo = [(root, self.modules.path_of(root), root is not None and not self.modules.stack)]
        seen: Set[int] = set()
        while todo:
            module, path, is_root = todo.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            for tensor in (list(module.parameters(recurse=False))
                           + list(module.buffers(recurse=False))):
                self.tag(tensor, Category.PARAMETER, path)
            for attr, child in module._modules.items():
                if child is not None:
                    todo.append((child, child_path(module, path, child, attr, is_root), False))

    def address(self, storage: Any) -> int:
        """A stable, distinct stand-in address for a fake storage (512-byte aligned, as the
        caching allocator's blocks are: CUDACachingAllocator.cpp, kMinBlockSize = 512)."""
        base = self._addresses.get(storage)
        if base is None:
            base = self._next_address
            self._next_address += (storage.nbytes() // 512 + 1) * 512
            self._addresses[storage] = base
        return int(base)

    def shadow(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The real value behind ``tensor`` when it is known (always, outside fake mode).

        A wrapper subclass over fake tensors (FSDP2's and DTensor's sharded values) has none of
        its own: its op runs as ops on its inner tensors, which carry their values themselves.
        Taking the wrapper for its own value would run every op on it a second time."""
        if not self.fake:
            return tensor
        if is_fake(tensor):
            return self._shadows.get(tensor)
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            if any(is_fake(getattr(tensor, name)) for name in names):
                return None
        return tensor

    # -- the dispatcher hook ----------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Args = (),
                           kwargs: Optional[Kwargs] = None) -> Any:
        kwargs = kwargs or {}
        if func in _TIMELINE_MARKS:
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func in _METADATA_QUERIES:
            if func is _PRIM_DEVICE and len(args) == 1:
                device = _fake_device(args[0])
                if device is not None:
                    return device
            self.dispatch_depth += 1  # torch's own question: answered as inside any other op
            try:
                return func(*args, **kwargs)
            finally:
                self.dispatch_depth -= 1
        if self.fake and func is aten._local_scalar_dense.default:
            real = self.shadow(args[0])
            if real is None:
                raise DataDependentValue(self.describe(args[0]))
            with _disable_current_modes():  # the fake mode below must not see the real tensor
                return real.item()
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if self.fake and self._host_data(func, args, inputs, kwargs):
            # Host data (indices, labels, tokens, images, a collate's padding) is real in fake
            # mode too: a script's data pipeline costs what it costs the script, and every
            # value it decides on is known. Only model state and GPU memory are shape-only.
            with _disable_current_modes():
                return func(*args, **kwargs)
        if self.on_parameter_update is not None and self.phase in ("after_backward", "optimizer"):
            self.on_parameter_update(self._updates_parameter(func, args))
        self._source = func
        if self.phase == "backward":
            self._note_autograd_node()
            if self._engine_accumulates(func, args, kwargs):
                # autograd's own gradient accumulation: in place in a run without this mode
                func = aten.add_.Tensor
        self.dispatch_depth += 1
        try:
            if self.fake and func in KERNEL_TEMPORARIES and self.is_cuda(args[0]):
                # a CUDA kernel's own scratch tensors, made around its fake kernel (``kernels``)
                out = KERNEL_TEMPORARIES[func](
                    lambda: self._run_fake(func, args, kwargs, inputs),
                    lambda made: self._recorded(made, inputs), args, kwargs)
            elif self.fake:
                out = self._run_fake(func, args, kwargs, inputs)
            else:
                out = func(*args, **kwargs)
            host_outputs = _HOST_OUTPUTS.get(func)
            if host_outputs is not None:  # e.g. a PackedSequence's batch_sizes
                with self._flag("host"):
                    self._record_outputs([out[i] for i in host_outputs], inputs)
            self._record_outputs(out, inputs)
            if func.overloadpacket in _BLAS_PACKETS:
                thread = "autograd" if self.phase == "backward" else "main"
                if thread not in self._blas_threads:
                    self._blas_threads.add(thread)
                    self.trace.mark(f"cublas:{thread}")
            mark = conv_mark(func, args, out)
            if mark is not None:
                self.trace.mark(mark)
            if (func.overloadpacket in _REDUCTION_PACKETS and self.is_cuda(args[0])
                    and not is_traceable_wrapper_subclass(args[0])):
                # a reduction that may stage partials in global memory (``reductions``); a
                # wrapper's (DTensor's) runs as ops on its local tensors, marked themselves
                reduction = reduction_mark(str(func), args, kwargs, out)
                if reduction is not None:
                    self.trace.mark(reduction.label())
        finally:
            self.dispatch_depth -= 1
        return out

    def _host_data(self, func: Any, args: Args, inputs: List[torch.Tensor],
                   kwargs: Kwargs) -> bool:
        """Does this op compute on the host from real values only (see ``__torch_dispatch__``)?

        Ops on real host tensors are; so are host factories (no tensor input) that make an
        order or a range (``randperm``, ``arange``: a sampler's shuffle of any dataset) or at
        most HOST_FACTORY_NUMEL elements. A larger random or constant block (a synthetic batch
        of millions of rows) stays shape-only: its values are bulk data, not decisions.
        """
        if self.device_flag in ("cuda", "meta"):
            return False
        if self.device_flag == FLOATING_ON_GPU and not inputs:
            dtype = kwargs.get("dtype")
            return dtype is not None and not dtype.is_floating_point
        if inputs:
            for t in inputs:
                if is_fake(_local(t)):
                    return False
            return True
        device = kwargs.get("device")
        if device is not None and getattr(device, "type", device) == "meta":
            return False  # shape-only memory (torch.device("meta") as the default device)
        if self.device_flag != "host" and self.default_cuda:
            return False
        if func.overloadpacket in _INDEX_FACTORIES:
            return True
        try:
            with _disable_current_modes():
                shape = func(*args, **dict(kwargs, device=torch.device("meta")))
        except Exception:  # not a factory that takes a device: decide by running it
            return True
        return not isinstance(shape, torch.Tensor) or shape.numel() <= HOST_FACTORY_NUMEL

    def adopt_parameter(self, data: torch.Tensor) -> torch.Tensor:
        """A fake stand-in, without a value, for host data that becomes a parameter (a weight's
        value is the model's: often uninitialised memory, never a decision of the script)."""
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            fake: torch.Tensor = self.fake_mode.from_tensor(data)
        return fake

    @contextlib.contextmanager
    def _flag(self, side: str) -> Iterator[None]:
        previous, self.device_flag = self.device_flag, side
        try:
            yield
        finally:
            self.device_flag = previous

    def _pack_padded(self, args: Args) -> Any:
        """``_pack_padded_sequence`` in fake mode: the packed size comes from the lengths (real,
        on the host), never from the data: run it for real on a one-wide stand-in of the data
        for ``batch_sizes``, and make the packed data shape-only."""
        data, lengths, batch_first = args[0], self.shadow(args[1]), bool(args[2])
        if lengths is None:
            return _MISSING
        with _disable_current_modes():
            stand_in = torch.zeros(tuple(data.shape[:2]) + (1,) * (data.dim() - 2))
            _, batch_sizes = aten._pack_padded_sequence.default(stand_in, lengths, batch_first)
            total = int(batch_sizes.sum())
        packed = data.new_empty((total,) + tuple(data.shape[2:]))
        return packed, batch_sizes

    def _updates_parameter(self, func: Any, args: Args) -> bool:
        """Does this op write into a parameter's GPU memory (``p.data.add_(...)``)?"""
        parameter = Category.PARAMETER.value
        for index in self._mutated_args(func):
            if index < len(args) and isinstance(args[index], torch.Tensor):
                try:
                    block = self._storages.get(args[index].untyped_storage())
                except (RuntimeError, NotImplementedError):
                    continue
                if block is not None and block.category == parameter:
                    return True
        return False

    def _note_autograd_node(self) -> None:
        """Track which autograd node runs, and the first block id allocated under it."""
        node = _current_autograd_node()
        if node is None:
            self._node_key = None
            self._node_module = ""
            return
        sequence_nr = getattr(node, "_sequence_nr", None)
        number = sequence_nr() if sequence_nr is not None else _NO_SEQUENCE
        key = (id(node), number)
        if key != self._node_key:  # the first op under this node: the node starts here
            self._node_key = key
            self._node_first_block = self._next_id
            self._node_module = self.modules.module_of_node(number)

    def _engine_accumulates(self, func: Any, args: Args, kwargs: Kwargs) -> bool:
        """Is this ``add`` autograd summing two gradients of one input (a residual, a tied weight)?

        The engine's ``InputBuffer::accumulate`` (torch/csrc/autograd/input_buffer.cpp) computes
        ``old + new`` and, when its buffer holds the last reference to a dense ``old``, does it
        in place (``old.add_(new)``, ``can_accumulate_inplace``, PyTorch >= 2.1). It never does
        while a dispatch mode is active (``at::isTensorSubclassLike`` answers true then), so
        under this tracker, in fake and profile mode alike, every residual junction and tied
        weight would record a gradient-sized block that the job's GPU run does not allocate.
        The engine's add comes with no alpha, outside grad mode, under the node that produced
        ``new``, while ``old`` was made before that node started (a formula's own ``a + b``
        adds temporaries of its node, and stays out of place).
        """
        if func is not aten.add.Tensor or kwargs or len(args) != 2 or torch.is_grad_enabled():
            return False
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old is new:
            return False
        if self._node_key is None:
            return False
        # A view keeps its base's storage referenced (storage use_count > 1): out of place, as
        # for a tied weight whose first gradient comes through ``t()``.
        if (old.shape != new.shape or old.dtype != new.dtype or old.storage_offset() != 0
                or not _dense(old) or old._is_view()):
            return False
        try:
            old_storage, new_storage = old.untyped_storage(), new.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return False
        block = self._storages.get(old_storage)
        return (block is not None and block.ident < self._node_first_block
                and old_storage.nbytes() == old.numel() * old.element_size()
                and new_storage is not old_storage)

    def _run_fake(self, func: Any, args: Args, kwargs: Kwargs, inputs: List[torch.Tensor]) -> Any:
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
        )

        if func in _ADDMM_OUT_DTYPE:
            # addmm with an out_dtype (an fp32 accumulator of bf16 products: TRL's fused LM head)
            # is mm-shaped; torch 2.11's fake kernel for it runs addmm's decomposition, which
            # takes out_dtype for beta (decompositions.py, addmm: "beta * self" with a dtype)
            out = kwargs.get("out")
            if out is not None:
                return out
            rows, cols = args[1].shape[0], args[2].shape[1]
            return args[1].new_empty((rows, cols), dtype=args[3])
        if func is aten._pack_padded_sequence.default:
            # Its size always comes from the lengths: asked first, not after the fake kernel
            # fails (2.2's meta kernel raises a RuntimeError, "'lengths' argument should be a
            # 1D CPU int64 tensor", instead of a data-dependent-output exception).
            packed = self._pack_padded(args)
            if packed is not _MISSING:
                return packed
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            real = self._run_real(func, args, kwargs, inputs, limit=None)
            if real is not _MISSING:
                return self._fake_from_real(real)
            return self._sized_by_values(func, args, kwargs, inputs)
        self._propagate_shadows(func, args, kwargs, inputs, out)
        self._note_origins(func, inputs, out)
        return out

    def _sized_by_values(self, func: Any, args: Args, kwargs: Kwargs,
                         inputs: List[torch.Tensor]) -> Any:
        """An op whose output size depends on values, not all of them known: sized from the
        known ones and bounded for the rest (``bounded``), the bound said in the trace; one
        without a bound needs real values."""
        sized = bounded.run(func, args, kwargs, self.shadow,
                            lambda made: self._recorded(made, inputs))
        if sized is None:
            missing = [t for t in inputs if self.shadow(t) is None]
            raise NeedsRealValues(
                f"the size of {_op_name(func)}'s output at {where_in_script()} depends on "
                f"{self.describe(missing[0]) if missing else 'its inputs'}, and has no bound "
                f"without it")
        if sized.bound:
            self.trace.note(
                NoteKind.BOUNDED, f"{_op_name(func)} at {where_in_script()}: {sized.bound}",
                key=f"{_op_name(func)} {where_in_script()}",
                extra_bytes=sized.bound_bytes)
        self._note_origins(func, inputs, sized.out)
        return sized.out

    # -- where values without a shadow come from ------------------------------------------
    def _note_origins(self, func: Any, inputs: List[torch.Tensor], out: Any) -> None:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and is_fake(t)
                and t not in self._shadows]
        if not outs:
            return
        if self._output_on_cuda(inputs):
            origin = f"computed on the GPU by {_op_name(func)} (a value of the model)"
        else:
            inherited = [self._origins[t] for t in inputs if t in self._origins]
            origin = inherited[0] if inherited else (
                f"made on the host by {_op_name(func)} at {where_in_script()}"
                + (f" (a host block over {HOST_FACTORY_NUMEL:,} elements is shape-only)"
                   if not inputs else ""))
        for t in outs:
            self._origins[t] = origin

    def describe(self, tensor: torch.Tensor) -> str:
        """Which value this is and where it came from, in words."""
        shape = "x".join(str(d) for d in tensor.shape) or "scalar"
        dtype = str(tensor.dtype).replace("torch.", "")
        origin = self._origins.get(tensor) if is_fake(tensor) else None
        if origin is None:
            origin = ("of the model's state (a parameter or a value computed from one)"
                      if self.is_cuda(tensor) else "whose value fake mode does not know")
        return f"the value of a {shape} {dtype} tensor {origin}"

    # -- shadows ----------------------------------------------------------------------------
    def _propagate_shadows(self, func: Any, args: Args, kwargs: Kwargs,
                           inputs: List[torch.Tensor], out: Any) -> None:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        limit: Optional[int]
        if func in _LIFT_OPS:
            limit = None
        elif func.overloadpacket in _NO_VALUE_PACKETS:
            return
        elif not inputs:
            limit = SMALL_FACTORY_NUMEL
        else:
            limit = DERIVED_NUMEL_LIMIT
        if any(t.numel() > limit for t in outs) if limit is not None else False:
            self._forget_mutated(func, args)
            return
        real = self._run_real(func, args, kwargs, inputs, limit)
        if (real is _MISSING and func.overloadpacket in _CONSTANT_LIKE and len(outs) == 1
                and outs[0].numel() <= SMALL_FACTORY_NUMEL):
            # its value is its fill, whatever the input's (a mask made with ones_like); made
            # like a value fake mode lacks, it is a factory of that shape, real only when small
            # as factories are (an optimizer's zeros_like of each parameter is model state: a
            # 0.85B model's Adam moments would be gigabytes of host memory)
            fill = _CONSTANT_LIKE[func.overloadpacket]
            with _disable_current_modes():
                real = torch.full(tuple(outs[0].shape), args[1] if fill is None else fill,
                                  dtype=outs[0].dtype)
        if real is _MISSING and func.overloadpacket in _ABSORBING and len(outs) == 1:
            real = self._absorbed(inputs, outs[0], func.overloadpacket in _OR_PACKETS)
        if real is _MISSING and func.overloadpacket in _FINITE_CHECKS and len(outs) == 1:
            # Values fake mode does not know are taken to be finite (as the patched GradScaler
            # does): a NaN/Inf check on them answers "no" instead of stopping the trace.
            with _disable_current_modes():
                real = torch.full(tuple(outs[0].shape), _FINITE_CHECKS[func.overloadpacket],
                                  dtype=torch.bool)
        if real is _MISSING:
            self._forget_mutated(func, args)
            return
        real_outs = [t for t in tree_flatten(real)[0] if isinstance(t, torch.Tensor)]
        if len(real_outs) != len(outs):
            return
        for fake_t, real_t in zip(outs, real_outs):
            if is_fake(fake_t):
                self._shadows[fake_t] = real_t

    def _absorbed(self, inputs: List[torch.Tensor], out: torch.Tensor, either: bool) -> Any:
        """An AND (or an integer product) of two tensors, one known to be all zero, is zero
        whatever the other holds; an OR of booleans, one known all true, is all true (a
        generation loop's ``is_done | at_max_length`` and ``unfinished & ~is_done`` once every
        sequence reached its maximum length end the loop on a known value)."""
        if len(inputs) != 2 or out.dtype.is_floating_point or out.dtype.is_complex:
            return _MISSING
        if either and out.dtype != torch.bool:
            return _MISSING
        for t in inputs:
            known = self.shadow(t)
            if known is None:
                continue
            with _disable_current_modes():
                if either and bool(known.all()):
                    return torch.ones(tuple(out.shape), dtype=out.dtype)
                if not either and not bool(known.any()):
                    return torch.zeros(tuple(out.shape), dtype=out.dtype)
        return _MISSING

    def _run_real(self, func: Any, args: Args, kwargs: Kwargs, inputs: List[torch.Tensor],
                  limit: Optional[int]) -> Any:
        reals = []
        for t in inputs:
            r = self.shadow(t)
            if r is None:
                return _MISSING
            reals.append(r)
        if not inputs and limit is None:
            return _MISSING

        def to_real(a: Any) -> Any:
            return self.shadow(a) if isinstance(a, torch.Tensor) else a

        try:
            with _disable_current_modes():
                return func(*tree_map(to_real, args), **tree_map(to_real, kwargs))
        except Exception:  # a shadow went stale; the fake result stands without a value
            return _MISSING

    def _fake_from_real(self, real: Any) -> Any:
        def convert(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            fake = self.fake_mode.from_tensor(t)
            self._shadows[fake] = t
            return fake

        with _disable_current_modes():
            return tree_map(convert, real)

    def _forget_mutated(self, func: Any, args: Args) -> None:
        for index in self._mutated_args(func):
            if index < len(args) and isinstance(args[index], torch.Tensor):
                self._shadows.pop(args[index], None)

    def _mutated_args(self, func: Any) -> Tuple[int, ...]:
        cached = self._mutated_cache.get(func)
        if cached is None:
            cached = tuple(
                i for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
            self._mutated_cache[func] = cached
        return cached

    # -- allocations ------------------------------------------------------------------------
    def _owner(self, index: int, inputs: List[torch.Tensor]) -> str:
        """In an optimizer step (outside any module): the module of the block the op's matching
        input lives in, for the optimizer's state and its foreach temporaries (``zeros_like(p)``'s parameter; element
        ``index`` of a foreach op's first list)."""
        if self.phase != "optimizer" or not inputs:
            return ""
        t = inputs[index] if index < len(inputs) else inputs[0]
        try:
            block = self._storages.get(_local(t).untyped_storage())
        except (RuntimeError, NotImplementedError):
            return ""
        return block.module if block is not None else ""

    def _record_outputs(self, out: Any, inputs: List[torch.Tensor]) -> None:
        cuda = None  # decided lazily: most outputs of most ops are new storages
        for index, t in enumerate(tree_flatten(out)[0]):
            if not isinstance(t, torch.Tensor):
                continue
            try:
                st = _local(t).untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            known = st in self._storages
            if known:
                block = self._storages[st]
                if block is not None and st.nbytes() != max(block.nbytes, 0) and not (
                        self._view_sizes and st.nbytes() < block.nbytes):
                    self._resized(st, block)
                continue
            if cuda is None:
                cuda = self._output_on_cuda(inputs) and not self._writes_host_data(inputs)
            if not (cuda or (not inputs and self.device_flag == FLOATING_ON_GPU
                             and t.dtype.is_floating_point)):
                self._storages[st] = None
                continue
            self._new_block(st, self._owner(index, inputs) if not self.modules.path else "")

    def _writes_host_data(self, inputs: List[torch.Tensor]) -> bool:
        """An op that writes into real host data in fake mode (``host.copy_(gpu_tensor)``: a
        host buffer a GPU tensor is copied into) returns that host tensor, as fake mode sees it."""
        func = self._source
        return (self.fake and bool(inputs) and not is_fake(_local(inputs[0]))
                and hasattr(func, "_schema") and 0 in self._mutated_args(func))

    def _recorded(self, made: torch.Tensor, inputs: List[torch.Tensor]) -> torch.Tensor:
        """``made`` (a kernel's scratch tensor or output), recorded as an op's output now."""
        self._record_outputs(made, inputs)
        return made

    def _output_on_cuda(self, inputs: List[torch.Tensor]) -> bool:
        flag = self.device_flag
        if flag is not None and flag != FLOATING_ON_GPU:
            return flag == "cuda"
        if not inputs:
            return self.default_cuda
        storages = self._storages
        for t in inputs:
            try:
                if storages.get(_local(t).untyped_storage()) is not None:
                    return True
            except (RuntimeError, NotImplementedError):
                continue
        return False

    def _new_block(self, st: Any, inherited: str = "") -> None:
        nbytes = st.nbytes()
        if nbytes == 0:
            # A zero-byte request never reaches cudaMalloc nor a block: the caching allocator
            # returns a null pointer for size 0 (CUDACachingAllocator.cpp, NativeCachingAllocator
            # ::malloc: `if (size == 0) return nullptr`-style early exit in allocate()). It is
            # still a tensor of the GPU (a freed ZeRO-3 parameter's empty data): a block that
            # holds nothing and has no event (``event`` -1), as a storage resized to 0 keeps.
            self._storages[st] = _Block(0, -1, "", self.phase, self.phase_seq, -1, "")
            return
        ident = self._next_id
        self._next_id += 1
        phase = self.phase
        category = _PHASE_CATEGORY.get(phase)
        if phase == "forward":
            self.forward_allocations += 1
        if category is None:
            category = Category.INPUT.value if self.device_flag == "cuda" else Category.OTHER.value
        if phase == "backward":
            module = (self.modules.path + RECOMPUTED if self.modules.stack
                      else self._node_module)
        else:
            module = self.modules.path or inherited
        func = self._source
        source = self._source_names.get(func) if func is not None else ""
        if source is None:
            source = self._source_names[func] = _source_name(func)
        block = _Block(ident, nbytes, category, phase, self.phase_seq, len(self.trace.events),
                       module)
        self.trace.events.append(Alloc(ALLOC, ident, nbytes, 0, category, phase, module,
                                       source))
        self._storages[st] = block
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
        # The weakref object must outlive the storage for its callback to run: keep it here.
        self._refs[ident] = weakref.ref(st, _FreeCallback(self, block))

    def _recategorize(self, block: _Block, category: str) -> None:
        """Rewrite the category of the allocation event that made ``block``."""
        event = self.trace.events[block.event]
        assert event.op == ALLOC, f"event {block.event} is {event.op}, not the block's allocation"
        self.trace.events[block.event] = event._replace(category=category)

    def _resized(self, st: Any, block: _Block) -> None:
        # resize_ on a CUDA storage allocates a new block and frees the old one.
        self._on_free(block)
        if st.nbytes() > 0:
            self._new_block(st)

    def storage_resized(self, st: Any) -> None:
        """``UntypedStorage.resize_`` outside the dispatcher (FSDP's ``free_storage`` of an
        unsharded parameter, resize to 0, and its regrowth before the next all-gather): the
        block is freed, and a regrown storage is a new block."""
        try:
            block = self._storages.get(st)
        except (RuntimeError, NotImplementedError):
            return
        if block is not None and st.nbytes() != max(block.nbytes, 0):
            previous, self._source = self._source, ALL_GATHER
            try:
                self._resized(st, block)
            finally:
                self._source = previous

    def _on_free(self, block: _Block) -> None:
        if block.nbytes < 0:
            return
        if block.phase == self.phase and block.phase_seq == self.phase_seq and block.category in (
            Category.ACTIVATION.value, Category.OPTIMIZER_STATE.value
        ):
            # Freed within the same forward (or optimizer step) that made it: a temporary.
            self._recategorize(block, Category.TEMPORARY.value)
        self.trace.free(block.ident)
        self.live_bytes -= block.nbytes
        block.nbytes = -1

    def finish(self) -> None:
        """Stop recording: later frees (interpreter shutdown) must not reach the trace."""
        self.trace = _NullTrace()


class _FreeCallback:
    """Weakref callback that records the free; holds the tracker weakly too."""

    __slots__ = ("tracker", "block")

    def __init__(self, tracker: AllocationTracker, block: _Block) -> None:
        self.tracker = weakref.ref(tracker)
        self.block = block

    def __call__(self, _ref: Any) -> None:
        tracker = self.tracker()
        if tracker is not None:
            tracker._refs.pop(self.block.ident, None)
            tracker._on_free(self.block)


class _NullTrace(Trace):
    def free(self, id: int) -> None:  # noqa: A002
        pass


_MISSING = object()
# The autograd node being evaluated on this thread: None outside backward (and always, on a
# torch without the binding). Looked up once: the tracker asks at every op of a backward.
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


def _source_name(func: Any) -> str:
    """An op's name for the trace: ``aten.mm``, ``c10d.allgather_``; a string as it is."""
    if isinstance(func, str):
        return func
    packet = getattr(func, "__name__", str(func)).split(".")[0]
    return f"{getattr(func, 'namespace', 'aten')}.{packet}"


def _op_name(func: Any) -> str:
    """``aten.nll_loss_forward`` for an OpOverload (its packet's name)."""
    return f"aten.{getattr(func, '__name__', str(func)).split('.')[0]}"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds the memory: a DTensor's local shard (FSDP2's sharded parameters and
    gradients are DTensors, wrapper subclasses without storage of their own)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense, as ``can_accumulate_inplace`` requires: the dims sorted by
    stride (those of size < 2 last, as they constrain nothing) must pack the elements with no
    gap or overlap; the rule of c10's ``_compute_non_overlapping_and_dense``
    (``c10/core/Contiguity.h``; ``TensorImpl::compute_non_overlapping_and_dense`` before).
    A transposed gradient (a rotary embedding's q/k) is dense, so it accumulates in place."""
    sizes: List[int] = [int(n) for n in t.shape]
    strides: List[int] = [int(n) for n in t.stride()]
    if len(sizes) == 1:
        return sizes[0] < 2 or strides[0] == 1
    order = sorted(range(len(sizes)), key=lambda d: (sizes[d] < 2, strides[d] if sizes[d] >= 2
                                                     else 0))
    expected = 1
    for d in order:
        if sizes[d] < 2:
            return True
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


def is_fake(t: Any) -> bool:
    """A FakeTensor (checked by name: the class lives in a private torch module)."""
    return type(t).__name__ == "FakeTensor"

