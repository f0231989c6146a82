"""Every way into the CUDA runtime from Python, and what the virtual GPU does with each.

A traced script, and torch's own Python code under it (optimizers, GradScaler, checkpointing,
DDP, FSDP), reach the GPU through two layers: the public ``torch.cuda`` functions and classes,
and the ``torch._C._cuda_*`` bindings they call. On a machine without a CUDA driver the second
layer fails (``CUDA driver version is insufficient``, ``Found no NVIDIA driver``), and which
public function reaches which binding changes from release to release: the Adam step's
``_cuda_graph_capture_health_check`` asks ``torch.cuda.is_current_stream_capturing()`` in 2.2 to
2.13, and ``torch.accelerator`` from 2.14.

So the virtual device covers both layers, and every name has a disposition here:

- ``answer_bindings``: the bindings the virtual GPU answers, replaced wherever torch bound
  them (``torch._C`` and the modules that imported them by name: ``install``);
- ``C_HOST``: bindings that answer without a driver as torch ships them (configuration flags,
  build facts): left alone;
- every other binding needs a real GPU: it is replaced by one that raises ``GPUOnlyCall``
  naming it and the reason (``C_GPU_ONLY``), which the runner reports as ``unsupported`` when
  the script dies of it (a script that catches it and goes on, as torch's own fallbacks do,
  is traced as usual);
- ``PUBLIC``: the public names that are not answered by ``torch_patches._patch_cuda_api`` nor
  by the bindings below them, each with what happens and why.

``tests/estimator/test_cuda_surface.py`` enumerates the names of the torch it runs with and
fails on any without a disposition; ``make test`` runs it with the oldest and newest supported
torch, ``make compat`` with every minor release between them.
"""

from __future__ import annotations

import enum
import sys
from typing import Any, Callable, Dict, Iterable, Mapping, Tuple

from xmem_admission.estimator.probe.outcomes import GPUOnlyCall


class Reach(str, enum.Enum):
    """What the virtual GPU does with a name of ``torch.cuda`` or ``torch._C._cuda_*``."""

    ANSWERED = "answered"  # the virtual device answers it
    THROUGH = "through"  # torch's Python code that calls only answered or host names
    HOST = "host"  # answers without a GPU or driver, as torch ships it
    GPU_ONLY = "gpu_only"  # needs a real GPU: raises GPUOnlyCall, reported as unsupported
    INTERNAL = "internal"  # a helper reached only from names answered above it


# -- the bindings ------------------------------------------------------------------------------
# torch._C._cuda_* that answer without a driver (each called with no GPU and no driver on this
# project's machines, torch 2.2.2 and 2.14.1: tests/estimator/test_cuda_surface.py calls the
# ones that take no argument again with every torch it runs under).
C_HOST: Mapping[str, str] = {
    "_cuda_getArchFlags": "the architectures torch was built for",
    "_cuda_getCompiledVersion": "the CUDA version torch was built with",
    "_cuda_isInBadFork": "a host flag",
    "_cuda_getAllocatorBackend": "the configured allocator backend (native/cudaMallocAsync)",
    "_cuda_cudaCachingAllocator_is_enabled": "a host flag",
    "_cuda_getHipblasltVersion": "ROCm builds only; None on CUDA builds",
    "_cuda_hostMemoryStats": "pinned host memory statistics: no device involved",
    "_cuda_resetAccumulatedHostMemoryStats": "pinned host memory statistics",
    "_cuda_resetPeakHostMemoryStats": "pinned host memory statistics",
    "_cuda_cudaHostAllocator": "the pinned host allocator's address",
    "_cuda_memoryMetadataSupported": "a build fact",
    "_cuda_get_conv_benchmark_empty_cache": "a host flag",
    "_cuda_get_cudnn_benchmark_limit": "a host setting (cudnn.benchmark_limit)",
    "_cuda_set_cudnn_benchmark_limit": "a host setting (cudnn.benchmark_limit)",
    "_cuda_get_sync_debug_mode": "a host setting",
    "_cuda_set_sync_debug_mode": "a host setting",
    "_cuda_clearCublasWorkspaces": "frees nothing when no handle was made",
    "_cuda_resetCublasWorkspaceSize": "a host setting",
    "_cuda_resetCublasLtWorkspaceSize": "a host setting",
    "_cuda_record_untuned_is_enabled": "TunableOp's host settings",
    "_cuda_record_untuned_enable": "TunableOp's host settings",
    "_cuda_tunableop_enable": "TunableOp's host settings",
    "_cuda_tunableop_is_enabled": "TunableOp's host settings",
    "_cuda_tunableop_tuning_enable": "TunableOp's host settings",
    "_cuda_tunableop_tuning_is_enabled": "TunableOp's host settings",
    "_cuda_tunableop_write_file_on_exit": "TunableOp's host settings",
    "_cuda_tunableop_set_filename": "TunableOp's host settings",
    "_cuda_tunableop_get_filename": "TunableOp's host settings",
    "_cuda_tunableop_set_max_tuning_duration": "TunableOp's host settings",
    "_cuda_tunableop_get_max_tuning_duration": "TunableOp's host settings",
    "_cuda_tunableop_set_max_tuning_iterations": "TunableOp's host settings",
    "_cuda_tunableop_get_max_tuning_iterations": "TunableOp's host settings",
    "_cuda_tunableop_set_cublaslt_requested_algo_count":  "TunableOp's host settings",
    "_cuda_tunableop_get_cublaslt_requested_algo_count": "TunableOp's host settings",
    "_cuda_tunableop_set_numerical_check_tolerances": "TunableOp's host settings",
    "_cuda_tunableop_read_file": "reads TunableOp's results file on the host",
    "_cuda_tunableop_write_file": "writes TunableOp's results file on the host",
    "_cuda_tunableop_set_rotating_buffer_size": "TunableOp's host settings",
    "_cuda_tunableop_clear_all": "TunableOp's host results table (2.15)",
    "_cuda_tunableop_push_dynamic_dims_mask": "TunableOp's host settings (2.15)",
    "_cuda_tunableop_pop_dynamic_dims_mask": "TunableOp's host settings (2.15)",
    "_cuda_tunableop_wildcard_fallback_enable": "TunableOp's host settings (2.15)",
    "_cuda_tunableop_wildcard_fallback_is_enabled": "TunableOp's host settings (2.15)",
    "_cuda_ipc_collect": "frees IPC handles other processes released: none here",
    "_cuda_lock_mutex": "the allocator's host mutex around NCCL calls (2.2-2.x)",
    "_cuda_unlock_mutex": "the allocator's host mutex around NCCL calls (2.2-2.x)",
}

# torch._C._cuda_* that need a real GPU and that no answered path reaches: what a script that
# calls them directly (or through the public name next to each) is told.
C_GPU_ONLY: Mapping[str, str] = {
    "_cuda_CUDAAllocator": "a custom allocator (CUDAPluggableAllocator): its placement is not "
                           "the caching allocator's, which is what the estimate simulates",
    "_cuda_CUDAAllocator_AllocatorState": "CUDA graph pool state",
    "_cuda_changeCurrentAllocator": "a custom allocator replaces the caching allocator that "
                                    "the estimate simulates",
    "_cuda_customAllocator": "a custom allocator replaces the caching allocator",
    "_cuda_getAllocator": "the allocator object itself (custom allocators)",
    "_cuda_cudaCachingAllocator_enable": "turning the caching allocator off changes every "
                                         "placement the estimate simulates",
    "_cuda_cudaCachingAllocator_raw_alloc": "raw device memory outside tensors "
                                            "(torch.cuda.caching_allocator_alloc)",
    "_cuda_cudaCachingAllocator_raw_delete": "raw device memory outside tensors",
    "_cuda_beginAllocateToPool": "private memory pools (CUDA graphs, torch.cuda.MemPool)",
    "_cuda_beginAllocateCurrentStreamToPool": "private memory pools (CUDA graphs)",
    "_cuda_beginAllocateCurrentThreadToPool": "private memory pools (torch.cuda.MemPool)",
    "_cuda_endAllocateCurrentStreamToPool": "private memory pools (CUDA graphs)",
    "_cuda_endAllocateToPool": "private memory pools",
    "_cuda_releasePool": "private memory pools",
    "_cuda_checkPoolLiveAllocations": "private memory pools (CUDA graph trees)",
    "_cuda_getCheckpointState": "CUDA graph trees' allocator checkpoints",
    "_cuda_setCheckpointPoolState": "CUDA graph trees' allocator checkpoints",
    "_cuda_cudaCachingAllocator_set_allocator_settings":
        "changes the caching allocator's settings while the job runs; the estimate simulates "
        "the settings PYTORCH_CUDA_ALLOC_CONF gives the job: set them there",
    "_cuda_memorySnapshot": "a snapshot of real GPU memory; `xmem estimate --trace` writes the "
                            "traced allocations instead",
    "_cuda_allocationTraceback": "the stack of a real GPU allocation",
    "_cuda_attach_out_of_memory_observer": "observes real out-of-memory events",
    "_cuda_getCurrentBlasHandle": "a live cuBLAS handle (torch.cuda.current_blas_handle), "
                                  "for custom CUDA extensions",
    "_cuda_getCurrentSolverHandle": "a live cuSOLVER handle, for custom CUDA extensions",
    "_cuda_getCurrentRawStream": "a raw cudaStream_t, for custom CUDA extensions",
    "_cuda_getStreamFromExternal": "wraps a cudaStream_t made outside torch",
    "_cuda_getCublasWorkspaceSize": "asks the live cuBLAS handle",
    "_cuda_getCublasLtWorkspaceSize": "asks the live cuBLASLt handle",
    "_cuda_setCublasWorkspaceSize": "resizes the live cuBLAS workspace",
    "_cuda_setCublasLtWorkspaceSize": "resizes the live cuBLASLt workspace",
    "_cuda_jiterator_compile_and_launch_kernel": "compiles and launches a CUDA kernel "
                                                 "(torch.cuda.jiterator)",
    "_cuda_sleep": "spins a kernel on the GPU (torch.cuda._sleep)",
    "_cuda_busy_wait_for_flag": "spins a kernel on the GPU until a flag is set (2.10-2.x, "
                                "torch.cuda._busy_wait_for_flag)",
    "_cuda_clear_flag": "clears that GPU flag (torch.cuda._clear_flag)",
    "_cuda_getMemoryMetadata": "annotations of real allocations",
    "_cuda_setMemoryMetadata": "annotations of real allocations",
    "_cuda_annotateMemory": "annotations of real allocations",
    "_cuda_tunableop_get_results": "TunableOp's tuning results (tuned on a GPU)",
    "_cuda_tunableop_get_rotating_buffer_size": "asks the device for its L2 size",
    "_cuda_tunableop_get_validators": "asks the device for its driver and architecture",
    "_cuda_canDeviceAccessPeer": "peer access between two GPUs: the traced job has one",
    "_cuda_getDefaultStream": "answered above it (torch.cuda.default_stream)",
    "_cuda_getCurrentStream": "answered above it (torch.cuda.current_stream)",
    "_cuda_setStream": "answered above it (torch.cuda.set_stream)",
}


def answer_bindings(tracker: Any, props: Any) -> Dict[str, Callable[..., Any]]:
    """The torch._C._cuda_* bindings the virtual GPU answers, as functions of its state."""

    def stats(*_a: Any, **_k: Any) -> Dict[str, Any]:
        # The nested layout of torch._C._cuda_memoryStats (c10/cuda/CUDACachingAllocator.h,
        # DeviceStats; torch/csrc/cuda/Module.cpp, memoryStats): "all" / "large_pool" /
        # "small_pool" for each stat; the probe knows live and peak bytes of tensors.
        live, peak = tracker.live_bytes, tracker.peak_live_bytes

        def stat(current: int, top: int) -> Dict[str, Dict[str, int]]:
            one = {"current": current, "peak": top, "allocated": top, "freed": top - current}
            zero = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
            return {"all": one, "large_pool": dict(one), "small_pool": zero}

        out: Dict[str, Any] = {key: stat(live, peak) for key in (
            "allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")}
        for key in ("allocation", "segment", "active", "inactive_split"):
            out[key] = stat(0, 0)
        out["inactive_split_bytes"] = stat(0, 0)
        out["oversize_allocations"] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        out["oversize_segments"] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                    "num_device_alloc", "num_device_free", "max_split_size"):
            out[key] = 0
        return out

    def reset_peak(*_a: Any, **_k: Any) -> None:
        tracker.peak_live_bytes = tracker.live_bytes

    def exchange(device: Any = 0) -> int:
        # c10/cuda/CUDAFunctions.cpp ExchangeDevice: a negative index means "no device", and
        # the answer is the device that was current before: always 0 on a one-GPU device.
        return -1 if isinstance(device, int) and device < 0 else 0

    return {
        "_cuda_init": lambda *a, **k: None,
        "_cuda_getDeviceCount": lambda *a, **k: 1,
        "_cuda_getDevice": lambda *a, **k: 0,
        "_cuda_setDevice": lambda *a, **k: None,
        "_cuda_exchangeDevice": exchange,
        "_cuda_maybeExchangeDevice": exchange,
        "_cuda_hasPrimaryContext": lambda *a, **k: True,
        "_cuda_synchronize": lambda *a, **k: None,
        "_cuda_isCurrentStreamCapturing": lambda *a, **k: False,
        "_cuda_emptyCache": lambda *a, **k: tracker.trace.empty_cache(),
        "_cuda_memoryStats": stats,
        "_cuda_resetPeakMemoryStats": reset_peak,
        "_cuda_resetAccumulatedMemoryStats": lambda *a, **k: None,
        "_cuda_getMemoryFraction": lambda *a, **k: 1.0,
        "_cuda_setMemoryFraction": lambda *a, **k: None,
        # Recording allocation history is the probe's own job: nothing to record on the
        # virtual GPU (a snapshot of it is refused: _cuda_memorySnapshot).
        "_cuda_record_memory_history": lambda *a, **k: None,
        "_cuda_record_memory_history_legacy": lambda *a, **k: None,
        "_cuda_isHistoryEnabled": lambda *a, **k: False,
    }


def gpu_only(name: str, reason: str) -> Callable[..., Any]:
    """A stand-in for a binding or function that needs a real GPU."""

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise GPUOnlyCall(name, reason)

    refuse.__name__ = name
    return refuse


def install(patches: Any, public: Mapping[str, Any], tracker: Any, props: Any) -> None:
    """Answer ``public`` (torch.cuda names) and every ``torch._C._cuda_*`` binding but the host
    ones, wherever torch holds them.

    torch's Python modules bind many of them by name at import (``torch.cuda.graphs``:
    ``from torch._C import _cuda_isCurrentStreamCapturing``; ``torch.cuda.memory``: ``from .
    import is_initialized``; ``torch.cuda._exchange_device`` is the binding itself), so every
    module of torch that holds the same object, under any name, gets the replacement too.
    """
    import torch

    by_id: Dict[int, Tuple[Any, Any]] = {}  # id(original) -> (original, replacement)
    for name, value in public.items():
        original = getattr(torch.cuda, name, None)
        if callable(original):
            by_id[id(original)] = (original, value)
        patches.set(torch.cuda, name, value)
    answers = answer_bindings(tracker, props)
    for name in dir(torch._C):
        if not name.startswith("_cuda_") or name in C_HOST:
            continue
        original = getattr(torch._C, name)
        if isinstance(original, type):
            continue  # classes: their constructors reach only the bindings below
        value = answers.get(name) or gpu_only(f"torch._C.{name}", C_GPU_ONLY.get(
            name, "a CUDA runtime call the virtual GPU does not answer"))
        by_id[id(original)] = (original, value)
        patches.set(torch._C, name, value)
    rebind(patches, by_id)


def rebind(patches: Any, by_id: Mapping[int, Tuple[Any, Any]]) -> None:
    """Replace each object of ``by_id`` (id(original) -> (original, replacement)) wherever a
    module of torch holds it, under any name (``from x import f`` binds f at import)."""
    for module in _torch_modules():
        for key, held in list(vars(module).items()):
            found = by_id.get(id(held))
            if found is not None and found[0] is held:
                patches.set(module, key, found[1])


def _torch_modules() -> Iterable[Any]:
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "torch" or name.startswith("torch.")) \
                and name != "torch._C":
            yield module


# -- the public names ----------------------------------------------------------------------------
_TELEMETRY = "NVML telemetry for logging; the virtual GPU reports 0 (no effect on memory)"
_GRAPHS = ("CUDA graphs: captured kernels replay from a private memory pool the estimate "
           "does not simulate")
_POOLS = "private memory pools route allocations around the caching allocator's pools"
_CUSTOM = "a custom allocator replaces the caching allocator that the estimate simulates"
_LEGACY = ("a legacy tensor or storage type: the virtual device reads it as (dtype, GPU) "
           "(virtual_cuda._legacy_type)")
_HELPER = "a helper of a function the virtual device answers above it"

# Public names (functions and classes defined by torch.cuda) that torch_patches._patch_cuda_api
# does not replace, each with what reaches the GPU under it.
PUBLIC: Mapping[str, Tuple[Reach, str]] = {
    # answered here (torch_patches adds them with the others; listed for the reason)
    "is_current_stream_capturing": (Reach.ANSWERED, "never capturing: no CUDA graphs"),
    "memory_stats": (Reach.THROUGH, "_cuda_memoryStats (answered)"),
    "memory_stats_as_nested_dict": (Reach.THROUGH, "_cuda_memoryStats (answered)"),
    "memory_summary": (Reach.THROUGH, "_cuda_memoryStats (answered)"),
    "reset_accumulated_memory_stats": (Reach.THROUGH, "_cuda_resetAccumulatedMemoryStats"),
    "reset_max_memory_cached": (Reach.THROUGH, "_cuda_resetPeakMemoryStats (answered)"),
    "memory_cached": (Reach.THROUGH, "memory_reserved (answered)"),
    "max_memory_cached": (Reach.THROUGH, "max_memory_reserved (answered)"),
    "get_per_process_memory_fraction": (Reach.THROUGH, "_cuda_getMemoryFraction (answered)"),
    "memory_snapshot": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_memorySnapshot"]),
    "list_gpu_processes": (Reach.ANSWERED, "NVML's process list: this process alone"),
    "host_memory_stats": (Reach.HOST, "pinned host memory"),
    "host_memory_stats_as_nested_dict": (Reach.HOST, "pinned host memory"),
    "reset_accumulated_host_memory_stats": (Reach.HOST, "pinned host memory"),
    "reset_peak_host_memory_stats": (Reach.HOST, "pinned host memory"),
    "get_allocator_backend": (Reach.HOST, "the configured backend"),
    "caching_allocator_alloc": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_cudaCachingAllocator_raw_alloc"]),
    "caching_allocator_delete": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_cudaCachingAllocator_raw_delete"]),
    "caching_allocator_enable": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_cudaCachingAllocator_enable"]),
    "caching_allocator_disabled": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_cudaCachingAllocator_enable"]),
    "CUDAPluggableAllocator": (Reach.GPU_ONLY, _CUSTOM),
    "change_current_allocator": (Reach.GPU_ONLY, _CUSTOM),
    "MemPool": (Reach.GPU_ONLY, _POOLS),
    "MemPoolContext": (Reach.GPU_ONLY, _POOLS),
    "use_mem_pool": (Reach.GPU_ONLY, _POOLS),
    "CUDAGraph": (Reach.GPU_ONLY, _GRAPHS),
    "graph": (Reach.GPU_ONLY, _GRAPHS),
    "graph_pool_handle": (Reach.GPU_ONLY, _GRAPHS),
    "make_graphed_callables": (Reach.GPU_ONLY, _GRAPHS),
    "export_dot": (Reach.GPU_ONLY, _GRAPHS),
    "export_graph_data": (Reach.GPU_ONLY, _GRAPHS),
    "GreenContext": (Reach.GPU_ONLY, "a partition of the GPU's SMs"),
    "_sleep": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_sleep"]),
    "_busy_wait_for_flag": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_busy_wait_for_flag"]),
    "_clear_flag": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_clear_flag"]),
    "_compile_kernel": (Reach.GPU_ONLY, "compiles a CUDA kernel with NVRTC"),
    "_register_triton_kernels": (Reach.INTERNAL, "registers Triton kernels lazily at first use"),
    "_WrappedTritonKernel": (Reach.INTERNAL, "a Triton kernel's wrapper, run on a GPU only"),
    "cudart": (Reach.GPU_ONLY, "the CUDA runtime library itself (profiler start/stop)"),
    "current_blas_handle": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_getCurrentBlasHandle"]),
    "current_solver_handle": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_getCurrentSolverHandle"]),
    "get_stream_from_external": (Reach.GPU_ONLY, C_GPU_ONLY["_cuda_getStreamFromExternal"]),
    "can_device_access_peer": (Reach.ANSWERED, "no peer: the traced job has one GPU"),
    "set_stream": (Reach.ANSWERED, "streams are inert on the virtual GPU"),
    "_set_stream_by_id": (Reach.ANSWERED, "streams are inert on the virtual GPU"),
    "StreamContext": (Reach.ANSWERED, "streams are inert on the virtual GPU"),
    "_DeviceGuard": (Reach.THROUGH, "_cuda_exchangeDevice (answered)"),
    "_exchange_device": (Reach.THROUGH, "_cuda_exchangeDevice (answered)"),
    "_maybe_exchange_device": (Reach.THROUGH, "_cuda_maybeExchangeDevice (answered)"),
    "initial_seed": (Reach.ANSWERED, "seeds are inert on the virtual GPU"),
    "_get_rng_state_offset": (Reach.ANSWERED, "RNG state is inert on the virtual GPU"),
    "_set_rng_state_offset": (Reach.ANSWERED, "RNG state is inert on the virtual GPU"),
    "_get_generator": (Reach.ANSWERED, "a host generator stands for the GPU's"),
    "is_tf32_supported": (Reach.ANSWERED, "from the target GPU's compute capability"),
    "utilization": (Reach.ANSWERED, _TELEMETRY),
    "temperature": (Reach.ANSWERED, _TELEMETRY),
    "power_draw": (Reach.ANSWERED, _TELEMETRY),
    "clock_rate": (Reach.ANSWERED, _TELEMETRY),
    "memory_usage": (Reach.ANSWERED, _TELEMETRY),
    "device_memory_used": (Reach.ANSWERED, "the traced live bytes (NVML's used memory)"),
    "get_arch_list": (Reach.HOST, "the architectures torch was built for"),
    "get_gencode_flags": (Reach.HOST, "the architectures torch was built for"),
    "get_sync_debug_mode": (Reach.HOST, "a host setting"),
    "set_sync_debug_mode": (Reach.HOST, "a host setting"),
    "check_error": (Reach.HOST, "turns a CUDA status code into an exception"),
    "_is_compiled": (Reach.HOST, "a build fact"),
    "_is_in_bad_fork": (Reach.HOST, "a host flag"),
    "_lazy_call": (Reach.HOST, "queues a call for CUDA initialisation (answered: _lazy_init)"),
    "_get_device_index": (Reach.HOST, "parses a device argument"),
    "_device": (Reach.HOST, "torch.device itself (2.2-2.3)"),
    "_primary_context_devices": (Reach.ANSWERED, "the one virtual GPU holds the context"),
    "_check_stray_context": (Reach.THROUGH, "_primary_context_devices (answered), 2.15"),
    "_get_stray_context_mode": (Reach.HOST, "reads TORCH_CUDA_CHECK_STRAY_CONTEXT, 2.15"),
    "_StrayContextCheckType": (Reach.HOST, "an enum of that setting, 2.15"),
    "_get_device": (Reach.HOST, "parses a device argument"),
    "_dummy_type": (Reach.HOST, "a stand-in class torch makes for builds without CUDA"),
    "_LazySeedTracker": (Reach.HOST, "remembers seed calls for CUDA initialisation"),
    "_CudaDeviceProperties": (Reach.ANSWERED, "get_device_properties answers the target GPU"),
    "_warn_typed_storage_removal": (Reach.HOST, "a deprecation warning"),
    "classproperty": (Reach.HOST, "a decorator"),
    "_lazy_new": (Reach.HOST, _LEGACY),
    "_CudaBase": (Reach.HOST, _LEGACY),
    "_CudaLegacyStorage": (Reach.HOST, _LEGACY),
    "_LegacyStorage": (Reach.HOST, _LEGACY),
    "_POOL_HANDLE": (Reach.INTERNAL, "a type alias of graph pools"),
    "_CompatInterval": (Reach.INTERNAL, "architecture tables of _check_capability"),
    "_CompatSet": (Reach.INTERNAL, "architecture tables of _check_capability"),
    "cudaStatus": (Reach.HOST, "status codes"),
    "_check_capability": (Reach.INTERNAL, "run by _lazy_init (answered)"),
    "_check_cubins": (Reach.INTERNAL, "run by _lazy_init (answered)"),
    "_check_bf16_tensor_supported": (Reach.INTERNAL, "run by is_bf16_supported (answered)"),
    "_host_arch_key": (Reach.INTERNAL, "run by _lazy_init (answered)"),
    "_code_compatible_with_device": (Reach.INTERNAL, "run by _lazy_init (answered)"),
    "_extract_arch_version": (Reach.INTERNAL, "run by _lazy_init (answered)"),
    "_warn_unsupported_code": (Reach.INTERNAL, "run by _lazy_init (answered)"),
    "_device_requirement": (Reach.INTERNAL, "run by _lazy_init (answered)"),
    "_use_uvm": (Reach.INTERNAL, "unified memory setting, read by _lazy_init (answered)"),
    "_nvml_based_avail": (Reach.INTERNAL, "run by is_available (answered)"),
    "_parse_visible_devices": (Reach.INTERNAL, "run by device_count (answered)"),
    "_raw_device_count_nvml": (Reach.INTERNAL, "run by device_count (answered)"),
    "_device_count_nvml": (Reach.INTERNAL, "run by device_count (answered)"),
    "_raw_device_uuid_nvml": (Reach.INTERNAL, "run by device_count (answered)"),
    "_transform_uuid_to_ordinals": (Reach.INTERNAL, "run by device_count (answered)"),
    "_get_nvml_device_index": (Reach.INTERNAL, "run by the telemetry functions (answered)"),
    "_get_pynvml_handler": (Reach.INTERNAL, "run by the telemetry functions (answered)"),
    "_raw_device_count_amdsmi": (Reach.INTERNAL, "ROCm builds: run by device_count"),
    "_raw_device_uuid_amdsmi": (Reach.INTERNAL, "ROCm builds: run by device_count"),
    "_device_count_amdsmi": (Reach.INTERNAL, "ROCm builds: run by device_count"),
    "_get_amdsmi_handler": (Reach.INTERNAL, "ROCm builds: telemetry"),
    "_get_amdsmi_device_index": (Reach.INTERNAL, "ROCm builds: telemetry"),
    "_get_amdsmi_device_index_from_hip_index": (Reach.INTERNAL, "ROCm builds: telemetry"),
    "_get_amdsmi_device_memory_used": (Reach.INTERNAL, "ROCm builds: telemetry"),
    "_get_amdsmi_memory_usage": (Reach.INTERNAL, "ROCm builds: telemetry"),
    "_get_amdsmi_utilization": (Reach.INTERNAL, "ROCm builds: telemetry"),
    "_get_amdsmi_temperature": (Reach.INTERNAL, "ROCm builds: telemetry"),
    "_get_amdsmi_power_draw": (Reach.INTERNAL, "ROCm builds: telemetry"),
    "_get_amdsmi_clock_rate": (Reach.INTERNAL, "ROCm builds: telemetry"),
}


def public_answers(tracker: Any, props: Any) -> Dict[str, Any]:
    """The public names of ``PUBLIC`` marked ANSWERED, as the virtual device answers them
    (the rest of ``torch.cuda``'s answers are in ``torch_patches._patch_cuda_api``)."""
    import torch

    from xmem_admission.estimator.probe.inert import Inert

    capability = (props.major, props.minor)

    def generator(*_a: Any, **_k: Any) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return torch.Generator()

    zero = lambda *a, **k: 0  # noqa: E731 - one answer for several names
    return {
        "is_current_stream_capturing": lambda *a, **k: False,
        "list_gpu_processes": lambda *a, **k: "GPU:0\nno processes are running",
        "can_device_access_peer": lambda *a, **k: False,
        "set_stream": lambda *a, **k: None,
        "_set_stream_by_id": lambda *a, **k: None,
        "StreamContext": Inert,
        "initial_seed": zero,
        "_get_rng_state_offset": zero,
        "_set_rng_state_offset": lambda *a, **k: None,
        "_get_generator": generator,
        "is_tf32_supported": lambda *a, **k: capability >= (8, 0),
        "utilization": zero,
        "temperature": zero,
        "power_draw": zero,
        "clock_rate": zero,
        "memory_usage": zero,
        "device_memory_used": lambda *a, **k: tracker.live_bytes,
        "_primary_context_devices": lambda *a, **k: [0],
    }


def public_gpu_only() -> Dict[str, Callable[..., Any]]:
    """Stand-ins for the public functions that need a real GPU, carrying the originals'
    metadata (torch's own modules read some of it: ``torch._dynamo`` lists
    ``torch.cuda.use_mem_pool.__wrapped__``). Classes (``CUDAGraph``, ``MemPool``) stay: their
    methods reach the bindings, and what reaches the runtime anyway is reported by the runner
    (``outcomes.gpu_only_cause``)."""
    import functools

    import torch

    out: Dict[str, Callable[..., Any]] = {}
    for name, (reach, reason) in PUBLIC.items():
        original = getattr(torch.cuda, name, None)
        if reach is Reach.GPU_ONLY and callable(original) and not isinstance(original, type):
            out[name] = functools.wraps(original)(gpu_only(f"torch.cuda.{name}", reason))
    return out
