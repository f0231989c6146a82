"""Allocation capture at the dispatcher: every storage the job would put on the GPU, in order.

``AllocationTracker`` is a ``TorchDispatchMode``. It sees each ATen op after autograd, notes
every *new* storage an op returns, decides whether that storage would live on the GPU (the
virtual CUDA device, see ``virtual_cuda``) or on the host, and records GPU storages as ``alloc``
events of a ``trace.Trace``, with the marks of the CUDA libraries' own memory (cuBLAS handles,
cuDNN convolutions, reductions' staging). Its parts, each in its own module:

- ``placement``: what a fake tensor is, and which ops compute on real host data in fake mode;
- ``blocks``: the GPU blocks by storage, their ``alloc`` and ``free`` events (a weakref callback
  records each free at the point of the program where Python drops the storage), categories
  and tags;
- ``module_paths`` and ``autograd_nodes``: the module each block belongs to, and autograd's
  in-place gradient accumulation;
- ``shadows``: in fake mode, real values of small tensors the script computes from Python data
  (optimizer step counters, RegNet's width arithmetic, token ids, attention masks), replayed for
  real so ``.item()``/``.tolist()`` on them answer truthfully and the model the probe traces is
  the model the script builds;
- ``data_dependent``: values the probe cannot know (the loss) raise ``DataDependentValue``
  (``virtual_cuda`` turns that into a placeholder for logging or a fallback to profile mode for
  decisions); an op whose output size depends on values it lacks (``x[mask]``, ``nonzero``,
  ``unique``) is sized at its largest (``bounded``);
- ``convolutions``: the ``cudnn:`` marks.

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten

from xmem_admission.estimator.probe import data_dependent
from xmem_admission.estimator.probe.autograd_nodes import AutogradNodes
from xmem_admission.estimator.probe.blocks import Blocks, NullTrace, views_resize_storages
from xmem_admission.estimator.probe.convolutions import conv_mark
from xmem_admission.estimator.probe.data_dependent import DataDependentValue
from xmem_admission.estimator.probe.kernels import OPS as KERNEL_TEMPORARIES
from xmem_admission.estimator.probe.locations import where_in_script
from xmem_admission.estimator.probe.module_paths import ModuleTracker, child_path
from xmem_admission.estimator.probe.placement import (
    FLOATING_ON_GPU,
    HOST_FACTORY_NUMEL,
    HOST_OUTPUTS,
    fake_device,
    host_data,
    is_fake,
    local,
)
from xmem_admission.estimator.probe.shadows import MISSING, Shadows, mutated_args
from xmem_admission.estimator.reductions import OPS as REDUCTION_OPS
from xmem_admission.estimator.reductions import mark_for as reduction_mark
from xmem_admission.estimator.trace import Category, Trace

# The names the rest of the probe takes from here.
__all__ = ["FLOATING_ON_GPU", "HOST_FACTORY_NUMEL", "KERNEL_TEMPORARIES", "AllocationTracker",
           "DataDependentValue", "conv_mark", "is_fake", "where_in_script"]

aten = torch.ops.aten
Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]

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

# Ops that run through cuBLAS on a GPU: the first one on a thread creates that thread's cuBLAS
# handle and its workspace (aten/src/ATen/cuda/CublasHandlePool.cpp, getCurrentCUDABlasHandle).
# Forward ops run on the main thread, backward ops on the autograd engine's device thread.
_BLAS_PACKETS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.addmv, aten.mv,
                 aten.dot, aten.vdot, aten._addmm_activation}

# Reductions that may stage partial results in global memory on a GPU (``reductions``).
_REDUCTION_PACKETS = {getattr(aten, name.split(".")[1]) for name in REDUCTION_OPS
                      if hasattr(aten, name.split(".")[1])}
# addmm's out_dtype overloads (torch >= 2.8: ``addmm.dtype``, ``addmm.dtype_out``).
_ADDMM_OUT_DTYPE = {getattr(aten.addmm, name) for name in ("dtype", "dtype_out")
                    if name in aten.addmm.overloads()}


class AllocationTracker(TorchDispatchMode):  # type: ignore[misc]  # torch is read as Any
    """Records the GPU allocation stream of the ops that run under it."""

    def __init__(self, trace: Trace, fake: bool, fake_mode: Any = None) -> None:
        super().__init__()
        self.trace = trace
        self.fake = fake
        self.fake_mode = fake_mode
        # Whether a view op rewrites the size its fake storage reports (``views_resize_storages``).
        self._view_sizes = fake and views_resize_storages()
        self.phase = "setup"
        self.phase_seq = 0
        # Set by the virtual device around calls that create memory on a given side.
        self.device_flag: Optional[str] = None
        self.default_cuda = False
        # Told of every op after a backward pass, and whether it writes into a parameter (steps
        # made without torch.optim, see runner._StepHooks).
        self.on_parameter_update: Optional[Callable[[bool], None]] = None
        # > 0 while an op runs: torch's own code then sees real devices (see patches).
        self.dispatch_depth = 0
        self._blas_threads: Set[str] = set()
        # Attribution (trace v2): the module running, and the autograd node running.
        self.modules = ModuleTracker()
        self.nodes = AutogradNodes(self.modules)
        self.blocks = Blocks(trace, self.modules, self.nodes)
        # storage -> Block for GPU storages, None for host ones (the blocks', read at every op)
        self._storages = self.blocks.storages
        self.shadows = Shadows(fake, fake_mode)
        # fake tensor -> its real value (the shadows', written by ``generation`` too)
        self._shadows = self.shadows.values
        # The parts' answers, as the tracker's own (bound once: no call layer of their own).
        self.shadow = self.shadows.of
        self.tag = self.blocks.tag
        self.address = self.blocks.address

    # -- phases -----------------------------------------------------------------------------
    def enter_phase(self, phase: str) -> None:
        self.phase = self.blocks.phase = phase
        self.phase_seq += 1
        self.blocks.phase_seq = self.phase_seq

    # -- what the rest of the probe asks ----------------------------------------------------
    def is_cuda(self, tensor: torch.Tensor) -> bool:
        try:
            return self._storages.get(local(tensor).untyped_storage()) is not None
        except (RuntimeError, NotImplementedError):
            return False

    @property
    def live_bytes(self) -> int:
        return self.blocks.live_bytes

    @property
    def peak_live_bytes(self) -> int:
        return self.blocks.peak_live_bytes

    @peak_live_bytes.setter
    def peak_live_bytes(self, value: int) -> None:
        self.blocks.peak_live_bytes = value

    @property
    def forward_allocations(self) -> int:
        """GPU blocks made by forward passes since the last optimizer step (the probe's guard)."""
        return self.blocks.forward_allocations

    @forward_allocations.setter
    def forward_allocations(self, value: int) -> None:
        self.blocks.forward_allocations = value

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

    def storage_resized(self, st: Any) -> None:
        """``UntypedStorage.resize_`` outside the dispatcher (``Blocks.storage_resized``)."""
        self.blocks.storage_resized(st, self.device_flag)

    def describe(self, tensor: torch.Tensor) -> str:
        """Which value this is and where it came from, in words."""
        return self.shadows.describe(tensor, self.is_cuda)

    def adopt_parameter(self, data: torch.Tensor) -> torch.Tensor:
        """A fake stand-in, without a value, for host data that becomes a parameter (a weight's
        value is the model's: often uninitialised memory, never a decision of the script)."""
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            fake: torch.Tensor = self.fake_mode.from_tensor(data)
        return fake

    def finish(self) -> None:
        """Stop recording: later frees (interpreter shutdown) must not reach the trace."""
        self.trace = self.blocks.trace = NullTrace()

    # -- the dispatcher hook ----------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Args = (),
                           kwargs: Optional[Kwargs] = None) -> Any:
        kwargs = kwargs or {}
        if func in _TIMELINE_MARKS:
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func in _METADATA_QUERIES:
            if func is _PRIM_DEVICE and len(args) == 1:
                device = fake_device(args[0])
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
        if self.fake and host_data(func, args, inputs, kwargs, self.device_flag,
                                   self.default_cuda):
            # Host data (indices, labels, tokens, images, a collate's padding) is real in fake
            # mode too: a script's data pipeline costs what it costs the script, and every
            # value it decides on is known. Only model state and GPU memory are shape-only.
            with _disable_current_modes():
                return func(*args, **kwargs)
        if self.on_parameter_update is not None and self.phase in ("after_backward", "optimizer"):
            self.on_parameter_update(self._updates_parameter(func, args))
        self.blocks.source = func
        if self.phase == "backward":
            nodes = self.nodes
            nodes.note(self.blocks.next_id)
            if nodes.accumulates(func, args, kwargs, self._storages):
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
            host_outputs = HOST_OUTPUTS.get(func)
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

    @contextlib.contextmanager
    def _flag(self, side: str) -> Iterator[None]:
        previous, self.device_flag = self.device_flag, side
        try:
            yield
        finally:
            self.device_flag = previous

    def _updates_parameter(self, func: Any, args: Args) -> bool:
        """Does this op write into a parameter's GPU memory (``p.data.add_(...)``)?"""
        parameter = Category.PARAMETER.value
        for index in mutated_args(func):
            if index < len(args) and isinstance(args[index], torch.Tensor):
                try:
                    block = self._storages.get(args[index].untyped_storage())
                except (RuntimeError, NotImplementedError):
                    continue
                if block is not None and block.category == parameter:
                    return True
        return False

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
            packed = data_dependent.pack_padded(args, self.shadow)
            if packed is not MISSING:
                return packed
        shadows = self.shadows
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            real = shadows.run_real(func, args, kwargs, inputs, limit=None)
            if real is not MISSING:
                return shadows.from_real(real)
            out = data_dependent.sized_by_values(
                func, args, kwargs, inputs, self.shadow, lambda made: self._recorded(made, inputs),
                self.describe, self.trace)
            shadows.note_origins(func, inputs, out, self._output_on_cuda)
            return out
        shadows.propagate(func, args, kwargs, inputs, out)
        shadows.note_origins(func, inputs, out, self._output_on_cuda)
        return out

    # -- allocations ------------------------------------------------------------------------
    def _owner(self, index: int, inputs: List[torch.Tensor]) -> str:
        """In an optimizer step (outside any module): the module of the block the op's matching
        input lives in, for the optimizer's state and its foreach temporaries (``zeros_like(p)``'s
        parameter; element ``index`` of a foreach op's first list)."""
        if self.phase != "optimizer" or not inputs:
            return ""
        t = inputs[index] if index < len(inputs) else inputs[0]
        try:
            block = self._storages.get(local(t).untyped_storage())
        except (RuntimeError, NotImplementedError):
            return ""
        return block.module if block is not None else ""

    def _record_outputs(self, out: Any, inputs: List[torch.Tensor]) -> None:
        cuda = None  # decided lazily: most outputs of most ops are new storages
        storages = self._storages
        for index, t in enumerate(tree_flatten(out)[0]):
            if not isinstance(t, torch.Tensor):
                continue
            try:
                st = local(t).untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            known = st in storages
            if known:
                block = storages[st]
                if block is not None and st.nbytes() != max(block.nbytes, 0) and not (
                        self._view_sizes and st.nbytes() < block.nbytes):
                    self.blocks.resized(st, block, self.device_flag)
                continue
            if cuda is None:
                cuda = self._output_on_cuda(inputs) and not self._writes_host_data(inputs)
            if not (cuda or (not inputs and self.device_flag == FLOATING_ON_GPU
                             and t.dtype.is_floating_point)):
                storages[st] = None
                continue
            self.blocks.new(st, self.device_flag,
                            self._owner(index, inputs) if not self.modules.path else "")

    def _writes_host_data(self, inputs: List[torch.Tensor]) -> bool:
        """An op that writes into real host data in fake mode (``host.copy_(gpu_tensor)``: a
        host buffer a GPU tensor is copied into) returns that host tensor, as fake mode sees it."""
        func = self.blocks.source
        return (self.fake and bool(inputs) and not is_fake(local(inputs[0]))
                and hasattr(func, "_schema") and 0 in mutated_args(func))

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
                if storages.get(local(t).untyped_storage()) is not None:
                    return True
            except (RuntimeError, NotImplementedError):
                continue
        return False
