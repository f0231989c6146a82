"""The monkeypatches that make torch answer as the virtual GPU, applied and undone as one unit.

Everything here is undone on exit (``Patches.restore``), so the probe can run inside a process
that goes on afterwards (tests, the estimation pod's ``sitecustomize``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from xmem_admission.estimator.probe.inert import Inert
from xmem_admission.estimator.probe.outcomes import Refused
from xmem_admission.estimator.probe.tracker import AllocationTracker, where_in_script
from xmem_admission.estimator.probe.virtual_cuda import DeviceMode
from xmem_admission.estimator.trace import NoteKind


class VirtualDeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns for the virtual GPU."""

    def __init__(self, name: str, total_memory: int, capability: Tuple[int, int],
                 multi_processor_count: int) -> None:
        self.name = name
        self.total_memory = total_memory
        self.major, self.minor = capability
        self.multi_processor_count = multi_processor_count
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.gcnArchName = ""
        self.uuid = "GPU-00000000-0000-0000-0000-000000000000"
        self.L2_cache_size = 0
        self.warp_size = 32

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // 2**20}MB, "
                f"multi_processor_count={self.multi_processor_count})")


class Patches:
    """Set attributes and remember the old values; ``restore`` puts them back in reverse."""

    def __init__(self) -> None:
        self._saved: List[Tuple[Any, str, Any, bool]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self.keep(obj, name)
        setattr(obj, name, value)

    def keep(self, obj: Any, name: str) -> None:
        """Remember ``obj.name`` as it is now (or that it is absent), changing nothing. A class
        keeps what its own ``__dict__`` holds: ``getattr`` would unwrap a staticmethod or bind a
        classmethod, and putting that back changes the class (a second probe run in the same
        process then found DTensor's ``__new__`` a plain function, not the staticmethod it
        patches)."""
        if isinstance(obj, type):
            existed = name in vars(obj)
            old = vars(obj).get(name)
        else:
            existed, old = hasattr(obj, name), getattr(obj, name, None)
        self._saved.append((obj, name, old, existed))

    def restore(self) -> None:
        while self._saved:
            obj, name, old, existed = self._saved.pop()
            if existed:
                setattr(obj, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)


def apply(patches: Patches, props: VirtualDeviceProperties, tracker: AllocationTracker,
          mode: DeviceMode, fake: bool) -> None:
    """Install every patch of the virtual device into ``patches``."""
    # torch._dynamo checks torch.cuda's Stream and Event classes when it is first imported
    # (2.2-2.3, _dynamo/device_interface.py: "DeviceInterface member Event should be inherit
    # from _EventBase"), and checkpointing, autocast and the optimizers import it lazily: it is
    # imported while the classes are still torch's (from 2.4 the probe imports it anyway,
    # through torch.distributed.pipelining).
    import torch._dynamo  # noqa: F401
    _patch_cuda_api(patches, props, tracker)
    _patch_autocast(patches, mode)
    _patch_training_helpers(patches, fake, tracker)
    _patch_serialization(patches, tracker, fake)
    _patch_checkpoint_metadata(patches, tracker)
    if fake:
        _patch_fake_tensor_device(patches, tracker)
        _patch_fake_tolist(patches)
        _patch_init(patches)
        _patch_parameters(patches, tracker)
        _patch_parameter_check(patches)
    from xmem_admission.estimator.probe import bitsandbytes
    bitsandbytes.install(patches, props, tracker, fake)
    from xmem_admission.estimator.probe import checkpoints
    checkpoints.install(patches, tracker, fake)
    from xmem_admission.estimator.probe import triton_kernels
    triton_kernels.install(patches, tracker, fake)
    from xmem_admission.estimator.probe import generation
    generation.install(patches, tracker, fake)


def _patch_cuda_api(p: Patches, props: VirtualDeviceProperties,
                    tracker: AllocationTracker) -> None:
    cuda = torch.cuda
    capability = (props.major, props.minor)

    def rng_state(*_a: Any, **_k: Any) -> torch.Tensor:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return torch.zeros(16, dtype=torch.uint8)

    def peak(*_a: Any, **_k: Any) -> int:
        return tracker.peak_live_bytes

    def reset_peak(*_a: Any, **_k: Any) -> None:
        tracker.peak_live_bytes = tracker.live_bytes

    answers = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "_lazy_init": lambda: None,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "ipc_collect": lambda *a, **k: None,
        "get_device_name": lambda *a, **k: props.name,
        "get_device_capability": lambda *a, **k: capability,
        "get_device_properties": lambda *a, **k: props,
        "is_bf16_supported": lambda *a, **k: capability >= (8, 0),
        "empty_cache": lambda: tracker.trace.empty_cache(),
        "manual_seed": lambda *a, **k: None,
        "manual_seed_all": lambda *a, **k: None,
        "seed": lambda *a, **k: None,
        "seed_all": lambda *a, **k: None,
        "get_rng_state": rng_state,
        "set_rng_state": lambda *a, **k: None,
        "get_rng_state_all": lambda: [rng_state()],
        "set_rng_state_all": lambda *a, **k: None,
        "memory_allocated": lambda *a, **k: tracker.live_bytes,
        "max_memory_allocated": peak,
        "memory_reserved": lambda *a, **k: tracker.live_bytes,
        "max_memory_reserved": peak,
        "reset_peak_memory_stats": reset_peak,
        "reset_max_memory_allocated": reset_peak,
        "mem_get_info": lambda *a, **k: (props.total_memory - tracker.live_bytes,
                                         props.total_memory),
        "device": Inert,  # `with torch.cuda.device(i):` selects nothing on the virtual GPU
        "device_of": Inert,
        "Stream": Inert,
        "Event": Inert,
        "ExternalStream": Inert,
        "current_stream": lambda *a, **k: Inert(),
        "default_stream": lambda *a, **k: Inert(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "set_per_process_memory_fraction": lambda *a, **k: None,
    }
    from xmem_admission.estimator.probe import cuda_surface

    answers.update(cuda_surface.public_answers(tracker, props))
    answers.update({name: value for name, value in cuda_surface.public_gpu_only().items()
                    if hasattr(cuda, name)})
    cuda_surface.install(p, answers, tracker, props)
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        for name, value in {
            "is_available": lambda *a, **k: True,
            "device_count": lambda *a, **k: 1,
            "current_accelerator": lambda *a, **k: torch.device("cuda"),
            "current_device_index": lambda *a, **k: 0,
            "current_device_idx": lambda *a, **k: 0,
            "set_device_index": lambda *a, **k: None,
            "set_device_idx": lambda *a, **k: None,
            "current_stream": lambda *a, **k: Inert(),
            "set_stream": lambda *a, **k: None,
            "synchronize": lambda *a, **k: None,
            "empty_cache": lambda *a, **k: tracker.trace.empty_cache(),
            "memory_allocated": lambda *a, **k: tracker.live_bytes,
            "max_memory_allocated": peak,
            "memory_reserved": lambda *a, **k: tracker.live_bytes,
            "max_memory_reserved": peak,
            "reset_peak_memory_stats": reset_peak,
        }.items():
            if hasattr(accelerator, name):
                p.set(accelerator, name, value)
    # Streams are inert on the virtual GPU, so is recording a tensor's use on one; FSDP1 calls it
    # with every mode off (fsdp/_common_utils.py ``_no_dispatch_record_stream``), where the C++
    # method refuses the virtual stream ("unknown parameter type", torch 2.2).
    p.set(torch.Tensor, "record_stream", lambda self, *a, **k: None)
    p.set(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    p.set(torch.Tensor, "is_pinned", lambda self, *a, **k: False)

    original_set_default_device = torch.set_default_device

    def set_default_device(device: Any) -> None:
        kind = str(device).split(":")[0] if device is not None else "cpu"
        tracker.default_cuda = kind == "cuda"
        original_set_default_device(None if kind == "cuda" else device)

    p.set(torch, "set_default_device", set_default_device)
    # torch's own record of the default device is put back as it was when the probe ends (the
    # script's set_default_device("cuda") leaves it at None, where 2.3 and 2.4's
    # get_default_device fails: "'NoneType' object has no attribute 'device'").
    import threading

    context = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    if isinstance(context, threading.local):  # 2.3+
        p.keep(context, "device_context")
    elif hasattr(torch, "_GLOBAL_DEVICE_CONTEXT"):  # 2.2: a module global
        p.keep(torch, "_GLOBAL_DEVICE_CONTEXT")
    real_get_default = getattr(torch, "get_default_device", None)  # 2.3+
    if real_get_default is not None:
        def get_default_device() -> Any:
            if tracker.default_cuda:
                return torch.device("cuda", 0)
            try:
                return real_get_default()
            except AttributeError:  # 2.3-2.4 after set_default_device(None): the host
                return torch.device("cpu")

        p.set(torch, "get_default_device", get_default_device)


def _patch_autocast(p: Patches, mode: DeviceMode) -> None:
    """``torch.autocast("cuda")`` drives the emulated CUDA policy; CPU autocast stays real."""
    state = mode.autocast

    # torch is read as Any by the type checker, so is the class this one stands for.
    class autocast(torch.amp.autocast):  # type: ignore[misc]  # noqa: N801 - same name as it
        def __init__(self, device_type: str = "cuda", dtype: Optional[torch.dtype] = None,
                     enabled: bool = True, cache_enabled: Optional[bool] = None) -> None:
            self._virtual = str(device_type) == "cuda"
            if not self._virtual:
                super().__init__(device_type, dtype=dtype, enabled=enabled,
                                 cache_enabled=cache_enabled)
                return
            self._args = (dtype, enabled, cache_enabled)

        def __enter__(self) -> Any:
            if not self._virtual:
                return super().__enter__()
            dtype, enabled, cache_enabled = self._args
            self._prev = (state.enabled, state.dtype, state.cache_enabled)
            state.enabled = bool(enabled)
            if dtype is not None:
                state.dtype = dtype
            if cache_enabled is not None:
                state.cache_enabled = cache_enabled
            state.depth += 1
            return self

        def __exit__(self, *exc: Any) -> Any:
            if not self._virtual:
                return super().__exit__(*exc)
            state.depth -= 1
            state.enabled, state.dtype, state.cache_enabled = self._prev
            if state.depth == 0:
                state.clear_cache()  # the cast cache lives for the outermost region
            return False

        def __call__(self, func: Any) -> Any:
            if not self._virtual:
                return super().__call__(func)

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return func(*args, **kwargs)

            return wrapped

    def cuda_amp_autocast(enabled: bool = True, dtype: torch.dtype = torch.float16,
                          cache_enabled: bool = True) -> autocast:
        return autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    real_is_enabled = torch.is_autocast_enabled
    # torch.get_autocast_dtype(device_type) and is_autocast_enabled(device_type) arrived in 2.4
    # (torch/csrc/autograd/init.cpp); 2.2 and 2.3 have per-device functions for the CPU.
    real_get_dtype: Any = getattr(torch, "get_autocast_dtype", None)
    per_device = real_get_dtype is not None

    def is_autocast_enabled(device_type: Optional[str] = None) -> bool:
        if device_type is None or device_type == "cuda":
            return state.enabled
        if per_device:
            return bool(real_is_enabled(device_type))
        return device_type == "cpu" and bool(torch.is_autocast_cpu_enabled())

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        if device_type == "cuda":
            return state.dtype
        if per_device:
            return real_get_dtype(device_type)
        return torch.get_autocast_cpu_dtype()

    p.set(torch, "autocast", autocast)
    p.set(torch.amp, "autocast", autocast)
    p.set(torch.amp.autocast_mode, "autocast", autocast)
    p.set(torch.cuda.amp, "autocast", cuda_amp_autocast)
    p.set(torch, "is_autocast_enabled", is_autocast_enabled)
    p.set(torch, "get_autocast_dtype", get_autocast_dtype)
    p.set(torch, "get_autocast_gpu_dtype", lambda: state.dtype)


def _patch_checkpoint_metadata(p: Patches, tracker: AllocationTracker) -> None:
    """Non-reentrant activation checkpointing compares each saved tensor's shape, dtype and
    device with its recomputation (torch/utils/checkpoint.py, ``_default_meta_extractor``,
    2.2 to 2.15). The forward saves from inside an op (where the device mode is off, so a real
    tensor says ``cpu``), the recomputation reads outside one (``cuda:0``): the device is the
    virtual device's answer in both."""
    from torch.utils import checkpoint

    checks = getattr(checkpoint, "_allowed_determinism_checks_to_fns", None)
    default = getattr(checkpoint, "_DEFAULT_DETERMINISM_MODE", None)
    if not isinstance(checks, dict) or default not in checks:
        return
    cuda0 = torch.device("cuda", 0)

    def metadata(x: Any) -> Any:
        device = cuda0 if tracker.is_cuda(x) else x.device
        return {"shape": x.shape, "dtype": x.dtype, "device": device}

    p.set(checkpoint, "_allowed_determinism_checks_to_fns", {**checks, default: metadata})


def _patch_training_helpers(p: Patches, fake: bool, tracker: AllocationTracker) -> None:
    import torch.optim.optimizer as optimizer_module
    import torch.utils.data as data

    # CUDA runs take the foreach optimizer path by default (optimizer.py,
    # _default_to_fused_or_foreach: foreach when every param is on a foreach-supported device);
    # the probe's tensors live on the CPU, so the CPU joins the list while tracing.
    # Likewise for the fused path (``fused=True``), which torch 2.2-2.3 check against
    # _get_fused_kernels_supported_devices in Adam's and AdamW's constructors (CUDA only there;
    # the CPU joined in 2.4). Both are bound by name in several optim modules: replaced in each.
    from torch.utils import _foreach_utils

    from xmem_admission.estimator.probe.cuda_surface import rebind

    by_id = {}
    for name in ("_get_foreach_kernels_supported_devices", "_get_fused_kernels_supported_devices"):
        real = getattr(_foreach_utils, name, None)
        if real is not None:
            by_id[id(real)] = (real, _with_cpu(real))
    rebind(p, by_id)
    if fake:
        # Parameters built under fake mode are FakeTensors; let them take that path too.
        from torch._subclasses.fake_tensor import FakeTensor

        supported = getattr(optimizer_module, "_foreach_supported_types", None)
        if isinstance(supported, list):
            p.set(optimizer_module, "_foreach_supported_types", supported + [FakeTensor])

    # A skipped step needs inf/NaN gradients, which fake values never have: step every time.
    try:
        from torch.amp import grad_scaler  # torch >= 2.3
    except ImportError:  # torch 2.2: CUDA's GradScaler is the only one
        from torch.cuda.amp import grad_scaler

    def maybe_opt_step(self: Any, optimizer: Any, optimizer_state: Any, *args: Any,
                       **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

    if fake:
        p.set(grad_scaler.GradScaler, "_maybe_opt_step", maybe_opt_step)
    else:
        _patch_amp_kernels(p)
    _patch_fused_adam(p)

    # Loader workers would have to pickle fake tensors and pinned buffers are host memory:
    # load in-process, unpinned (GPU memory is the same either way).
    real_init = data.DataLoader.__init__

    def loader_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["num_workers"] = 0
        kwargs["pin_memory"] = False
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
        real_init(self, *args, **kwargs)

    p.set(data.DataLoader, "__init__", loader_init)
    # cuDNN packs an RNN's weights into one buffer of the same total size (RNN.cpp,
    # _cudnn_rnn_flatten_weight copies them and re-points the parameters): nothing to trace, and
    # the call needs a real CUDA device.
    p.set(torch.nn.RNNBase, "flatten_parameters", lambda self: None)

    # torch.compile runs the model eagerly under the probe, as a decorator too, and the trace
    # says so: what Inductor allocates is at most what eager code does (its fusion and buffer
    # reuse only remove intermediates; the min-cut partitioner of AOTAutograd saves for backward
    # at most what eager autograd saves: torch/_functorch/partitioners.py,
    # min_cut_rematerialization_partition), so the eager trace is an upper bound. CUDA graphs
    # are not: they keep every captured block in a private pool between steps.
    # A module is noted when it is compiled (scripts compile the model they train); a function
    # when it first runs: libraries decorate helpers with torch.compile at import (DeepSpeed,
    # bitsandbytes' CPU kernels) that a CUDA run may never call.
    def say(name: str, where: str) -> None:
        tracker.trace.note(NoteKind.COMPILED_EAGERLY,
                           f"torch.compile({name}) at {where}: traced as eager code "
                           f"(what Inductor allocates is at most what eager code does)",
                           key=f"{name} {where}")

    def eager(fn: Any, where: str) -> Any:
        if isinstance(fn, torch.nn.Module) or not callable(fn):
            say(type(fn).__name__ if isinstance(fn, torch.nn.Module) else "a function", where)
            return fn
        name = getattr(fn, "__qualname__", "a function")

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            say(name, where)
            return fn(*args, **kwargs)

        return run

    def compile(model: Any = None, **options: Any) -> Any:
        refused = _cuda_graphs(options)
        where = where_in_script()
        if refused:
            raise Refused(f"torch.compile({refused}) at {where} captures CUDA "
                          f"graphs, whose private memory pool the probe does not model")
        if model is None:
            return lambda fn: eager(fn, where)
        return eager(model, where)

    p.set(torch, "compile", compile)
    p.set(torch.nn.Module, "_apply", _module_apply)


# torch.compile's modes and options that capture CUDA graphs (torch/_inductor/
# __init__.py, list_mode_options: "reduce-overhead" and "max-autotune" set
# "triton.cudagraphs": True; "max-autotune-no-cudagraphs" does not), and the backend of that name.
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _cuda_graphs(options: Dict[str, Any]) -> str:
    """The torch.compile argument that captures CUDA graphs, as written, or ''."""
    mode = options.get("mode")
    if mode in _CUDA_GRAPH_MODES:
        return f"mode={mode!r}"
    if options.get("backend") == "cudagraphs":
        return "backend='cudagraphs'"
    extra = options.get("options") or {}
    if isinstance(extra, dict) and extra.get("triton.cudagraphs"):
        return "options={'triton.cudagraphs': True}"
    return ""


def _with_cpu(devices: Callable[[], Any]) -> Callable[[], List[str]]:
    def with_cpu() -> List[str]:
        listed = list(devices())
        return listed if "cpu" in listed else listed + ["cpu"]

    return with_cpu


def _has_cpu_kernel(op: str) -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"))


def _patch_amp_kernels(p: Patches) -> None:
    """GradScaler's two kernels on the host, for torch releases that have them for CUDA only
    (2.2: aten/src/ATen/native/cuda/AmpKernels.cu; CPU kernels arrived in 2.3, AmpKernels.cpp).

    In profile mode the gradients are real host tensors. Both kernels work in place and
    allocate nothing on the GPU, so their host stand-ins run untraced (every mode off).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    if not _has_cpu_kernel("aten::_amp_foreach_non_finite_check_and_unscale_"):
        def unscale(grads: Any, found_inf: Any, inv_scale: Any) -> None:
            # AmpKernels.cu: every element multiplied by inv_scale; found_inf set to 1.0 when
            # any element of any tensor is inf or NaN.
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                for grad in grads:
                    if not bool(torch.isfinite(grad).all()):
                        found_inf.fill_(1.0)
                    grad.mul_(inv_scale)

        p.set(torch, "_amp_foreach_non_finite_check_and_unscale_", unscale)
    if not _has_cpu_kernel("aten::_amp_update_scale_"):
        def update_scale(scale: Any, growth_tracker: Any, found_inf: Any, growth_factor: float,
                         backoff_factor: float, growth_interval: int) -> Any:
            # AmpKernels.cu, amp_update_scale_cuda_kernel: back off on inf, grow after
            # growth_interval clean steps in a row.
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                if float(found_inf) != 0.0:
                    scale.mul_(backoff_factor)
                    growth_tracker.fill_(0)
                elif int(growth_tracker) + 1 == growth_interval:
                    scale.mul_(growth_factor)
                    growth_tracker.fill_(0)
                else:
                    growth_tracker.add_(1)
            return scale

        p.set(torch, "_amp_update_scale_", update_scale)


def _patch_fused_adam(p: Patches) -> None:
    """Adam's and AdamW's fused kernels on the host, for releases that have them for CUDA only
    (2.2-2.3: aten/src/ATen/native/cuda/fused_adam_impl.cu; CPU kernels arrived in 2.4,
    FusedAdamKernel.cpp). ``fused=True`` (nanoGPT's AdamW) steps through them.

    The kernels update parameters and state in place and allocate nothing, so the stand-in runs
    untraced (every mode off): with real tensors (profile mode, host data) it applies Adam's
    update (torch/optim/adam.py, the single-tensor reference); a fake tensor has no value to
    update, so it is left as it is.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    def fused(decoupled: bool) -> Callable[..., None]:
        def step(params: Any, grads: Any, exp_avgs: Any, exp_avg_sqs: Any, max_exp_avg_sqs: Any,
                 state_steps: Any, *, lr: Any, beta1: float, beta2: float, weight_decay: float,
                 eps: float, amsgrad: bool, maximize: bool, grad_scale: Any = None,
                 found_inf: Any = None) -> None:
            from torch._subclasses.fake_tensor import FakeTensor

            tensors = list(params) + list(grads) + list(exp_avgs) + list(exp_avg_sqs)
            if any(isinstance(t, FakeTensor) for t in tensors):
                return
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                if found_inf is not None and float(found_inf) != 0.0:
                    return
                rate = float(lr)
                for i, (param, grad) in enumerate(zip(params, grads)):
                    grad = grad / grad_scale if grad_scale is not None else grad
                    grad = -grad if maximize else grad
                    if weight_decay and decoupled:
                        param.mul_(1 - rate * weight_decay)
                    elif weight_decay:
                        grad = grad.add(param, alpha=weight_decay)
                    exp_avgs[i].lerp_(grad, 1 - beta1)
                    exp_avg_sqs[i].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    count = float(state_steps[i])
                    second = exp_avg_sqs[i]
                    if amsgrad:
                        torch.maximum(max_exp_avg_sqs[i], second, out=max_exp_avg_sqs[i])
                        second = max_exp_avg_sqs[i]
                    denom = (second.sqrt() / (1 - beta2 ** count) ** 0.5).add_(eps)
                    param.addcdiv_(exp_avgs[i], denom, value=-rate / (1 - beta1 ** count))

        return step

    for name, decoupled in (("_fused_adam_", False), ("_fused_adamw_", True)):
        if hasattr(torch, name) and not _has_cpu_kernel(f"aten::{name}"):
            p.set(torch, name, fused(decoupled))


# Where the script last moved or converted each module (``model.to(...)``, ``.cuda()``,
# ``.half()``): the probe names that call when a module's parameters stay on the host.
# Each entry is (sequence number, "file:line (source)"); the highest number is the latest call.
APPLY_SITES: weakref.WeakKeyDictionary[Any, Tuple[int, str]] = weakref.WeakKeyDictionary()
_APPLY_DEPTH = [0]
_APPLY_COUNT = [0]


def _module_apply(self: Any, fn: Any, recurse: bool = True) -> Any:
    """``Module._apply`` with the ``param.data = ...`` semantics of PyTorch's default path.

    On fake tensors torch forces ``swap_tensors`` (module.py, ``_apply``), which refuses
    tensors that have weak references, and the probe's tracker holds exactly those. Replacing
    ``.data`` keeps the Parameter objects (optimizers built earlier keep working) and frees the
    old storage, as ``module.to("cuda")`` does on a GPU.
    """
    if _APPLY_DEPTH[0] == 0:
        from xmem_admission.estimator.probe.tracker import where_in_script

        _APPLY_COUNT[0] += 1
        APPLY_SITES[self] = (_APPLY_COUNT[0], where_in_script())
    _APPLY_DEPTH[0] += 1
    try:
        return _apply_to_module(self, fn, recurse)
    finally:
        _APPLY_DEPTH[0] -= 1


def _apply_to_module(self: Any, fn: Any, recurse: bool) -> Any:
    if recurse:
        for module in self.children():
            module._apply(fn)
    for key, param in self._parameters.items():
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        if applied is not param and not torch._has_compatible_shallow_copy_type(param, applied):
            # another kind of tensor (a meta parameter made real by ``to_empty``, in profile
            # mode): a new Parameter, as module.py's ``_apply`` makes where ``set_data`` cannot
            grad = param.grad
            param = self._parameters[key] = torch.nn.Parameter(applied, param.requires_grad)
            if grad is not None:
                with torch.no_grad():
                    param.grad = fn(grad)
            continue
        if applied is not param:
            param.data = applied
        if param.grad is not None:
            with torch.no_grad():
                grad = fn(param.grad)
            if grad is not param.grad:
                param.grad.data = grad
    for key, buf in self._buffers.items():
        if buf is not None:
            self._buffers[key] = fn(buf)
    return self


def _patch_fake_tolist(p: Patches) -> None:
    """``tolist`` of a fake tensor answers as ``Tensor.tolist`` does under the probe's modes
    (its known value, else placeholders). Older torch's ``FakeTensor.tolist`` makes an unbacked
    symbol per element from the fake mode's shape environment, which the probe's fake mode does
    not have (torch 2.2: ``AttributeError`` on ``None``); newer torch's asks ``item()`` per
    element, which the probe answers already."""
    from torch._subclasses.fake_tensor import FakeTensor

    own = vars(FakeTensor).get("tolist")
    if own is None or "create_unbacked_symint" not in own.__code__.co_names:
        return

    def tolist(self: Any) -> Any:
        return torch.Tensor.tolist(self)

    p.set(FakeTensor, "tolist", tolist)


def _patch_fake_tensor_device(p: Patches, tracker: AllocationTracker) -> None:
    """Fake tensors on the virtual GPU report ``cuda:0`` to the script (not to torch's guts)."""
    from torch._subclasses.fake_tensor import FakeTensor

    prop = FakeTensor.__dict__["device"]
    cuda0 = torch.device("cuda", 0)

    def device(self: Any) -> torch.device:
        value = prop.fget(self)
        if tracker.dispatch_depth == 0 and value.type == "cpu" and tracker.is_cuda(self):
            return cuda0
        return value

    p.set(FakeTensor, "device", property(device, prop.fset))


def _patch_init(p: Patches) -> None:
    """Initial values never matter for memory, and some init paths call ``.item()`` (which
    raises ``DataDependentOutputException`` under fake mode) or loop until a sampled value fits
    (answered with a dummy value, torchvision's ``convnext_base`` never finishes building):
    neutralise them."""
    import torch.nn.init as init

    for name in ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                 "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                 "kaiming_normal_", "orthogonal_", "sparse_"):
        if hasattr(init, name):
            p.set(init, name, lambda tensor, *a, **k: tensor)


def _cuda_location(map_location: Any) -> Optional[bool]:
    """Whether ``torch.load``'s ``map_location`` sends storages to the GPU (None: not said)."""
    if map_location is None or callable(map_location):
        return None
    if isinstance(map_location, dict):
        return any(str(v).startswith("cuda") for v in map_location.values())
    return str(map_location).startswith("cuda")


def _patch_serialization(p: Patches, tracker: AllocationTracker, fake: bool) -> None:
    """Checkpoints in and out of the virtual GPU.

    ``torch.load`` reads the file for real on the host (a checkpoint's values are data: a script
    may decide on them), memory-mapped where the format allows (only what is read costs host
    memory), and what ``map_location`` (or, without one, the location saved in the file) puts
    on the GPU is moved there through the virtual device, so it is traced. In fake mode a
    FakeTensor pickles as its real value when the probe knows it and as zeros of its shape
    otherwise (``torch.save``, ``multiprocessing`` queues and pools).
    """
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_map

    real_load = torch.load

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        to_cuda = _cuda_location(map_location)
        saved: List[str] = []

        def on_host(storage: Any, location: str) -> Any:
            if callable(map_location):
                # ``lambda storage, loc: storage.cuda(gpu)`` (a CUDA call: it fails here) or
                # ``lambda storage, loc: storage`` (stays on the host)
                try:
                    storage = map_location(storage, location)
                    saved.append("cpu")
                except Exception:  # noqa: BLE001 - any failure is the missing CUDA device
                    saved.append("cuda")
                return storage
            saved.append(location)
            return storage

        with _disable_current_modes():
            obj = _load_mapped(real_load, f, on_host, args, kwargs)
        if to_cuda is None:
            to_cuda = bool(saved) and all(loc.startswith("cuda") for loc in saved)
        if not to_cuda:
            return obj
        return tree_map(lambda t: t.to("cuda") if isinstance(t, torch.Tensor) else t, obj)

    p.set(torch, "load", load)
    if not fake:
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def reduce_ex(self: Any, protocol: Any) -> Any:
        real = tracker.shadow(self)
        with _disable_current_modes():
            if real is None:
                real = torch.zeros(tuple(self.shape), dtype=self.dtype)
            elif real.requires_grad != self.requires_grad:
                real = real.detach().requires_grad_(self.requires_grad)
            return real.__reduce_ex__(protocol)

    p.set(FakeTensor, "__reduce_ex__", reduce_ex)


def _load_mapped(real_load: Any, f: Any, map_location: Any, args: Any, kwargs: Any) -> Any:
    """``torch.load`` memory-mapped when ``f`` is a path to a zip checkpoint, else plainly."""
    import os

    if isinstance(f, (str, os.PathLike)) and "mmap" not in kwargs and not args:
        try:
            return real_load(f, map_location, mmap=True, **kwargs)
        except RuntimeError:  # a legacy (non-zip) checkpoint cannot be mapped
            pass
    return real_load(f, map_location, *args, **kwargs)


def _patch_parameter_check(p: Patches) -> None:
    """``isinstance(t, Parameter)`` is true for a tensor flagged ``_is_param`` (the probe's fake
    parameters are such tensors); up to 2.2 the metaclass answered so for every subclass of
    Parameter too, so DDP and FSDP took them for ``UninitializedParameter`` and refused the
    model (torch/nn/parameter.py ``_ParameterMeta.__instancecheck__``; 2.3 asks ``self is
    Parameter`` first). The later rule, for every release."""
    from torch.nn import parameter

    meta = getattr(parameter, "_ParameterMeta", None)
    if meta is None:
        return
    base = torch._C._TensorMeta.__instancecheck__

    def instancecheck(cls: Any, instance: Any) -> bool:
        if cls is parameter.Parameter and isinstance(instance, torch.Tensor) \
                and getattr(instance, "_is_param", False):
            return True
        return bool(base(cls, instance))

    p.set(meta, "__instancecheck__", instancecheck)


def _patch_parameters(p: Patches, tracker: AllocationTracker) -> None:
    """In fake mode host data is real (see ``tracker``) but model state is shape-only: a real
    tensor wrapped as an ``nn.Parameter`` becomes a fake one (the real one is dropped, so a
    model built on the host costs no host memory)."""
    real_new = torch.nn.Parameter.__new__

    def new(cls: Any, data: Any = None, requires_grad: bool = True) -> Any:
        if type(data) is torch.Tensor and data.device.type in ("cpu", "meta"):
            data = tracker.adopt_parameter(data)
        return real_new(cls, data, requires_grad)

    p.set(torch.nn.Parameter, "__new__", new)

    # A parameter in fake mode is a FakeTensor (``_patch_parameter_check`` makes it one for
    # ``isinstance``), so ``type(param)`` is FakeTensor: code that rebuilds a parameter by its
    # type, ``type(param)(param.to(device), requires_grad=...)`` (accelerate's and transformers
    # 4.x's init_empty_weights, register_empty_parameter), calls FakeTensor as a Parameter.
    from torch._subclasses.fake_tensor import FakeTensor

    real_fake_new = vars(FakeTensor)["__new__"]

    def fake_new(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], torch.Tensor):  # a Parameter's (data, requires_grad)
            grad = kwargs.get("requires_grad", args[1] if len(args) > 1 else True)
            return torch.nn.Parameter(args[0], bool(grad))
        return real_fake_new.__get__(None, cls)(cls, *args, **kwargs)

    p.set(FakeTensor, "__new__", staticmethod(fake_new))
