"""A virtual CUDA device: the script believes it runs on the target GPU, tensors stay on the CPU.

Fake CUDA tensors do not survive training without a GPU (under ``FakeTensorMode`` a backward
through ``device="cuda"`` tensors fails in ``hasPrimaryContext``, or aborts in ``AccumulateGrad``
on a CPU-only build, and ``module.to("cuda")`` cannot swap the parameters), so every tensor
really lives on the CPU (fake or real) and the GPU is virtual:

- ``torch.cuda`` answers as the target GPU (name, capability, capacity, memory counters fed by
  the tracker); streams, events, seeds and RNG state are inert.
- ``DeviceMode`` (a ``TorchFunctionMode``) rewrites ``device="cuda"``, ``.cuda()`` and
  ``.to("cuda")`` to the CPU while telling the tracker that the memory they create is GPU
  memory; a host-to-device move is a real copy, as on a GPU. Tensors on the virtual GPU report
  ``device == cuda:0`` and ``is_cuda`` to the script.
- What a CUDA run does differently is applied here: CUDA autocast's op lists (``autocast``),
  the fused dropout kernel (a bool mask, not a float one), the flash / memory-efficient
  attention kernels instead of the math path, the foreach optimizer path.
- Values the probe cannot know (``loss.item()`` in fake mode) come back as ``Placeholder``
  numbers that print as 0 but refuse to be compared: a decision taken on them raises
  ``NeedsRealValues`` so ``auto`` mode can fall back to real execution and say why.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from xmem_admission.estimator.probe.autocast import CudaAutocastState
from xmem_admission.estimator.probe.outcomes import NeedsRealValues
from xmem_admission.estimator.probe.tracker import (
    AllocationTracker,
    DataDependentValue,
    is_fake,
    where_in_script,
)
from xmem_admission.estimator.trace import Category

CUDA0 = torch.device("cuda", 0)

# What a torch-function handler gets: the function called, its positional and keyword arguments.
Func = Callable[..., Any]
Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]

__all__ = ["DeviceMode", "NeedsRealValues", "Placeholder"]


def _decide(what: str = "") -> NoReturn:
    raise NeedsRealValues(
        f"the script takes a decision at {where_in_script()} on "
        f"{what or 'a value computed by the model on the GPU'}"
    )


class Placeholder(float):
    """A value fake mode does not know (a loss): fine to print, sum or average; comparing it
    is a decision. It remembers which value it stands for, for the fallback's reason."""

    what: str

    def __new__(cls, what: str = "") -> Placeholder:
        self = float.__new__(cls, 0.0)
        self.what = what
        return self

    def _same(self, *_args: Any) -> Placeholder:
        return Placeholder(self.what)

    def _compare(self, *_args: Any) -> NoReturn:
        _decide(self.what)

    # an unknown value used as an integer (a token id decoded to text, a count): a decision
    # on its value, where a float would raise TypeError
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = __bool__ = __index__ = _compare
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _same
    __truediv__ = __rtruediv__ = __floordiv__ = __pow__ = __neg__ = __abs__ = _same
    __round__ = _same  # type: ignore[assignment]  # float.__round__ is overloaded
    __hash__ = float.__hash__

    def __format__(self, spec: str) -> str:
        return format(0.0, spec)


def _is_cuda_device(value: Any) -> Optional[bool]:
    """True for a CUDA device spec, False for another device spec, None if not a device."""
    if isinstance(value, torch.device):
        return bool(value.type == "cuda")
    if isinstance(value, str):
        kind = value.split(":")[0]
        if kind in ("cuda", "cpu", "meta", "mps", "xpu"):
            return kind == "cuda"
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return True  # an ordinal means a CUDA device (Tensor.to(0), Tensor.cuda(0))
    return None


class DeviceMode(TorchFunctionMode):  # type: ignore[misc]  # torch is read as Any
    """Torch-function hook: device rewriting, CUDA-only kernels, autocast, unknowable values."""

    def __init__(self, tracker: AllocationTracker, capability: Tuple[int, int], fake: bool):
        super().__init__()
        self.tracker = tracker
        self.capability = capability
        self.fake = fake
        self.autocast = CudaAutocastState()
        self._handlers: Dict[Func, Callable[[Func, Args, Kwargs], Any]] = {
            torch.Tensor.to: self._to,
            torch.Tensor.cuda: self._cuda,
            torch.Tensor.cpu: self._cpu,
            torch.Tensor.type: self._type,
            torch._C._nn._parse_to: self._parse_to,
            torch.Tensor.record_stream: lambda f, a, k: None,
            torch.Tensor.is_cuda.__get__: lambda f, a, k: self.tracker.is_cuda(a[0]),
            torch.Tensor.device.__get__: self._device,
            torch.Tensor.get_device: lambda f, a, k: 0 if self.tracker.is_cuda(a[0]) else -1,
            torch.Tensor.item: self._item,
            torch.Tensor.tolist: self._tolist,
            torch.Tensor.__bool__: self._truth,
            torch.Tensor.__float__: self._item,
            torch.Tensor.__int__: self._item,
            torch.Tensor.__index__: self._truth,
            torch.Tensor.__format__: self._format,
            torch.Tensor.numpy: self._numpy,
            torch.Tensor.data_ptr: self._data_ptr,
            F.dropout: self._dropout,
            F.scaled_dot_product_attention: self._sdpa,
            F.multi_head_attention_forward: self._multi_head_attention,
            torch.Tensor.backward: self._tensor_backward,
            torch.autograd.backward: self._autograd,
            torch.autograd.grad: self._autograd,
        }

    # -- entry ------------------------------------------------------------------------------
    def __torch_function__(self, func: Func, types: Any, args: Args = (),
                           kwargs: Optional[Kwargs] = None) -> Any:
        kwargs = kwargs or {}
        handler = self._handlers.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device) is not None:
            meta = str(device).startswith("meta")
            if meta and not self.fake:
                # With real values a meta tensor stays one, as on a GPU machine: code that
                # builds a model under torch.device("meta") reads that device back and skips
                # what it would do to real weights. transformers 5 skips a module's
                # initialisation at construction there, then replaces its non-persistent
                # buffers (rotary inv_freq) with empty ones and initialises them; on host
                # tensors the module was initialised at construction, marked so, and the new
                # buffers kept uninitialised memory (modeling_utils.py, init_weights and
                # _move_missing_keys_from_meta_to_device).
                return self._call(func, args, kwargs)
            kwargs = dict(kwargs, device="cpu")
            # "meta" in fake mode: shape-only memory, never host data (placement.host_data)
            side = "cuda" if _is_cuda_device(device) else ("meta" if meta else "host")
            with self.on(side):
                return self._call(func, args, kwargs)
        return self._call(func, args, kwargs)

    def _call(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        if self.autocast.enabled:
            return self.autocast.call(func, args, kwargs)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def on(self, side: str) -> Iterator[None]:
        previous = self.tracker.device_flag
        self.tracker.device_flag = side
        try:
            yield
        finally:
            self.tracker.device_flag = previous

    # -- moving between host and device -----------------------------------------------------
    def _to(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        src = args[0]
        rest = list(args[1:])
        target: Optional[bool] = None
        if rest and isinstance(rest[0], torch.Tensor):
            other = rest.pop(0)
            target = self.tracker.is_cuda(other)
            kwargs = dict(kwargs, dtype=other.dtype)
        for i, value in enumerate(rest):
            side = _is_cuda_device(value)
            if side is not None and not isinstance(value, torch.dtype):
                target = side
                rest[i] = "cpu"
                break
        if "device" in kwargs and kwargs["device"] is not None:
            target = _is_cuda_device(kwargs["device"])
            kwargs = dict(kwargs, device="cpu")
        return self._move(src, target, lambda kw: src.to(*rest, **kw), kwargs)

    def _parse_to(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        # ``Module.to`` parses its arguments here and moves each tensor with what comes back:
        # the device must come back as the virtual GPU when the script names it (positionally,
        # as ``device=``, or through a tensor on it), never rewritten to the host on the way in.
        device, dtype, non_blocking, memory_format = func(*args, **kwargs)
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.Tensor):
                if self.tracker.is_cuda(value):
                    device = CUDA0
                break
        return device, dtype, non_blocking, memory_format

    def _type(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        # The legacy tensor types (torchsummary: ``x.type(torch.cuda.FloatTensor)``): a type
        # object or its name says the dtype and the device at once.
        src = args[0]
        bound = _bind(("self", "dtype", "non_blocking"), (None, None, False), args, kwargs)
        wanted = bound["dtype"]
        if wanted is None:
            name = func(src)
            if self.tracker.is_cuda(src) and name.startswith("torch."):
                return "torch.cuda." + name[len("torch."):]
            return name
        legacy = _legacy_type(wanted)
        if legacy is None:
            return func(*args, **kwargs)
        dtype, cuda = legacy
        options = {"non_blocking": bool(bound["non_blocking"])}
        return self._move(src, cuda, lambda kw: src.to("cpu", dtype, **kw), options)

    def _cuda(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        kwargs = {k: v for k, v in kwargs.items() if k in ("non_blocking", "memory_format")}
        return self._move(args[0], True, lambda kw: args[0].to("cpu", **kw), kwargs)

    def _cpu(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        kwargs = {k: v for k, v in kwargs.items() if k == "memory_format"}
        return self._move(args[0], False, lambda kw: args[0].to("cpu", **kw), kwargs)

    def _move(self, src: Any, target: Optional[bool], call: Callable[[Kwargs], Any],
              kwargs: Kwargs) -> Any:
        src_cuda = self.tracker.is_cuda(src)
        if target is None or target == src_cuda:
            with self.on("cuda" if src_cuda else "host"):
                out = call(kwargs)
        else:
            with self.on("cuda" if target else "host"):
                out = call(dict(kwargs, copy=True))
        if isinstance(src, torch.nn.Parameter) and out is not src:
            self.tracker.tag(out, Category.PARAMETER)
        return out

    def _device(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        # torch's own code run for an op (the tracker's dispatch depth) sees the real device
        if self.tracker.dispatch_depth == 0 and self.tracker.is_cuda(args[0]):
            return CUDA0
        return func(*args, **kwargs)

    # -- autograd ---------------------------------------------------------------------------
    # A torch-function mode is switched off while its handler runs, so a backward pass started
    # from here would run without it: activation checkpointing would then recompute the forward
    # without the CUDA kernels and casts of the original forward (a different set of saved
    # tensors, which torch.utils.checkpoint rejects). The engine call runs with this mode pushed
    # again and autograd's own torch-function check answered "no" for that one call.
    def _tensor_backward(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        bound = _bind(("self", "gradient", "retain_graph", "create_graph", "inputs"),
                      (None, None, None, False, None), args, kwargs)
        return self._autograd(torch.autograd.backward, (bound["self"],), {
            "grad_tensors": bound["gradient"], "retain_graph": bound["retain_graph"],
            "create_graph": bound["create_graph"], "inputs": bound["inputs"]})

    def _autograd(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        import torch.autograd as autograd_module

        real = autograd_module.has_torch_function
        autograd_module.has_torch_function = _never
        try:
            with self:
                return func(*args, **kwargs)
        finally:
            autograd_module.has_torch_function = real

    # -- values -----------------------------------------------------------------------------
    def _item(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        try:
            return func(*args, **kwargs)
        except DataDependentValue as exc:
            if args[0].dtype == torch.bool:
                _decide(str(exc))
            return Placeholder(str(exc))

    def _truth(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        try:
            return func(*args, **kwargs)
        except DataDependentValue as exc:
            if self.tracker.phase == "optimizer":
                # Inside optimizer.step() a value decides how far to move a weight (Adafactor's
                # max(eps, rms(p)), clipping), not which tensors exist: shapes decide memory.
                # (A skipped step is the one exception, and GradScaler's is patched to step.)
                return False
            _decide(str(exc))

    def _tolist(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        real = self.tracker.shadow(args[0])
        if real is not None:
            with _disable_current_modes():
                return real.tolist()
        what = self.tracker.describe(args[0])
        if args[0].dtype == torch.bool:
            _decide(what)

        def nested(shape: List[int]) -> Any:
            if not shape:
                return Placeholder(what)
            return [nested(shape[1:]) for _ in range(shape[0])]

        return nested(list(args[0].shape))

    def _numpy(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        real = self.tracker.shadow(args[0])
        if real is None:
            _decide(self.tracker.describe(args[0]))
        with _disable_current_modes():
            return real.numpy()

    def _data_ptr(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        # A FakeTensor has no memory: torch answers 0 for all of them (and warns), so code that
        # tells tensors apart by address (shared-weight checks, RNNBase.flatten_parameters)
        # would see every tensor as one. Each storage gets its own address instead.
        tensor = args[0]
        if not is_fake(tensor):
            return func(*args, **kwargs)
        return self.tracker.address(tensor.untyped_storage()) + \
            tensor.storage_offset() * tensor.element_size()

    def _format(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        tensor, spec = args[0], args[1] if len(args) > 1 else ""
        if is_fake(tensor) and tensor.dim() == 0:
            return format(self._item(torch.Tensor.item, (tensor,), {}), spec)
        return func(*args, **kwargs)

    # -- CUDA kernels whose memory differs from the CPU path --------------------------------
    def _dropout(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        # CUDA's fused kernel keeps a bool mask (Dropout.cpp, is_fused_kernel_acceptable ->
        # native_dropout); the CPU path multiplies by a float noise tensor four times larger.
        params = _bind(("input", "p", "training", "inplace"), (None, 0.5, True, False), args,
                       kwargs)
        x = params["input"]
        if not params["training"] or params["p"] == 0 or not self.tracker.is_cuda(x):
            return func(*args, **kwargs)
        out = torch.ops.aten.native_dropout.default(x, float(params["p"]), True)[0]
        if params["inplace"]:
            return x.copy_(out)
        return out

    def _sdpa(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        if self.autocast.enabled:
            cast = self.autocast.cast_args(func, args, kwargs)
            if cast is not None:
                args, kwargs = cast
        params = _bind(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                        "enable_gqa"), (None, None, None, None, 0.0, False, None, False), args,
                       kwargs)
        q, k, v = params["query"], params["key"], params["value"]
        if not (self.fake and self.tracker.is_cuda(q)) or q.dim() != 4:
            return func(*args, **kwargs)
        from xmem_admission.estimator.probe.attention import cuda_sdpa

        return cuda_sdpa(q, k, v, params["attn_mask"], params["dropout_p"], params["is_causal"],
                         params["scale"], params["enable_gqa"], self.capability)

    def _multi_head_attention(self, func: Func, args: Args, kwargs: Kwargs) -> Any:
        # ``nn.MultiheadAttention`` in training calls ``F.multi_head_attention_forward``, a Python
        # function whose first act is ``if has_torch_function(tens_ops): return
        # handle_torch_function(...)``: the mode gets the whole call and runs it popped, so the
        # SDPA inside (need_weights=False) would take the CPU's kernel, its dropout the CPU's
        # mask. It runs again with this mode pushed, that first check answered "no" once.
        import torch.nn.functional as functional

        name = "has_torch_function"
        real = getattr(functional, name)

        def not_again(*_args: Any) -> bool:
            setattr(functional, name, real)
            return False

        setattr(functional, name, not_again)
        try:
            with self:
                return func(*args, **kwargs)
        finally:
            setattr(functional, name, real)


def _legacy_type(value: Any) -> Optional[Tuple[torch.dtype, bool]]:
    """(dtype, on the GPU) for a legacy tensor type or its name (``torch.cuda.HalfTensor``)."""
    if isinstance(value, str):
        parts = value.split(".")
        owner = torch.cuda if parts[:2] == ["torch", "cuda"] else torch
        value = getattr(owner, parts[-1], None) if parts[0] == "torch" else None
    dtype = getattr(value, "dtype", None)
    if not isinstance(value, type) or not isinstance(dtype, torch.dtype):
        return None
    return dtype, bool(getattr(value, "is_cuda", False))


def _never(*_args: Any) -> bool:
    return False


def _bind(names: Tuple[str, ...], defaults: Args, args: Args, kwargs: Kwargs) -> Dict[str, Any]:
    bound = dict(zip(names, defaults))
    bound.update(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in bound})
    return bound
