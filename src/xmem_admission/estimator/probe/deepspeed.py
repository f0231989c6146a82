"""DeepSpeed ZeRO jobs traced as rank 0 of their world: DeepSpeed's own engine runs.

A job that trains through DeepSpeed (its ``deepspeed`` launcher, ``accelerate launch
--use_deepspeed``, the Hugging Face Trainer with ``TrainingArguments(deepspeed=...)``,
``deepspeed.initialize`` in the script) makes its engine, whose ZeRO optimizer decides what each
rank holds. The probe runs that code unchanged under the
fake process group (``distributed``): DeepSpeed's communication (``deepspeed.comm``) is a
``TorchBackend`` over ``torch.distributed`` (deepspeed/comm/torch.py, ``TorchBackend`` calls
``torch.distributed.init_process_group``), so it gets the fake group of the launcher's world;
its accelerator is CUDA, as ``torch.cuda.is_available()`` answers on the virtual GPU
(deepspeed/accelerator/real_accelerator.py, ``get_accelerator``); and ZeRO's partitioning
allocates on the virtual GPU what it allocates on a GPU. ZeRO-1 and 2
(deepspeed/runtime/zero/stage_1_and_2.py, ``DeepSpeedZeroOptimizer``) flatten each parameter
group's 16-bit parameters into one buffer padded to a multiple of 2N elements
(``flatten_dense_tensors_aligned``) that the parameters then view, and keep an fp32 copy of
this rank's 1/N of it (``single_partition_of_fp32_groups``), which the wrapped optimizer steps,
so its state is 1/N too. Gradients are reduced through buckets of ``reduce_bucket_size``
elements (``ipg_buckets``) into this rank's partition (``grads_in_partition``): by stage 2 as
backward makes them, by stage 1 at the step unless ``overlap_comm`` is set.

ZeRO-3 (deepspeed/runtime/zero/stage3.py, ``DeepSpeedZeroOptimizer_Stage3``, with
``deepspeed.zero.Init`` in partition_parameters.py) keeps this rank's 1/N of every 16-bit
parameter and frees the rest: a freed parameter's data is an empty tensor on the GPU
(``free_param``), which the tracker keeps a GPU tensor though it holds no block. Before a
module runs, its parameters are all-gathered into new GPU tensors and freed after it; how many
are gathered at once (prefetch, ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``)
is DeepSpeed's own decision, which runs unchanged (``_name_gathered``). The fp32 partition and
the optimizer state are 1/N. With ``offload_optimizer`` to the CPU the fp32 partitions, their
gradients and the optimizer state are host tensors, stepped by DeepSpeedCPUAdam
(``_host_adam``); with ``offload_param`` (ZeRO-3) the 16-bit partitions are host tensors too,
copied to the GPU to be gathered. Host tensors hold no GPU block.

What does not run on a CPU host is stood for here: decisions on values fake mode does not have
(the fp16/bf16 overflow check: a step is never skipped, as for torch's GradScaler); the step
count (one ZeRO step steps the wrapped optimizer once per group); CPU Adam's C++ update, which
writes host values only; and the tensors DeepSpeed makes are named for the breakdown. What is
not traced truthfully is refused with the option named: offload to NVMe (``_untraced``,
``_refuse_nvme_params``), and pipeline engines, whose ranks differ.

Python >= 3.9, torch >= 2.2; DeepSpeed is touched only once the job imports it: this module
ships in the probe bundle.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

from xmem_admission.estimator.trace import Category


def install(patches: Any, tracker: Any, after_import: Any) -> None:
    """Patch DeepSpeed once the job imports it (``after_import``: an ``_AfterImport`` hook for
    the ``deepspeed`` package), or now if it already has."""

    def patch(module: Any) -> None:
        _patch(patches, tracker, module)

    if "deepspeed" in sys.modules:
        patch(sys.modules["deepspeed"])
    else:
        after_import.arm(patches, patch)


def _patch(patches: Any, tracker: Any, deepspeed: Any) -> None:
    # DeepSpeed's own modules, which the job's ``import deepspeed`` has loaded (deepspeed/
    # __init__.py imports runtime.engine, which imports ZeRO-1/2), by name: the probe bundle
    # imports no third-party package itself.
    stage_1_and_2 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = importlib.import_module("deepspeed.runtime.zero.stage3")
    engine = importlib.import_module("deepspeed.runtime.engine")
    pipe = importlib.import_module("deepspeed.runtime.pipe.engine")
    _refuse_untraced(patches, engine.DeepSpeedEngine, pipe.PipelineEngine)
    _no_overflow(patches, stage_1_and_2)
    _no_overflow(patches, stage3)
    _host_adam(patches, tracker)
    _name_zero12(patches, tracker, stage_1_and_2.DeepSpeedZeroOptimizer)
    _name_zero3(patches, tracker, stage3.DeepSpeedZeroOptimizer_Stage3)
    partition_parameters = importlib.import_module("deepspeed.runtime.zero.partition_parameters")
    _name_gathered(patches, tracker, partition_parameters)
    _refuse_nvme_params(patches, partition_parameters)
    _one_step(patches, stage_1_and_2.DeepSpeedZeroOptimizer)
    _one_step(patches, stage3.DeepSpeedZeroOptimizer_Stage3)


PIPELINE_REASON = (
    "DeepSpeed pipeline-parallel jobs (deepspeed.pipe.PipelineModule, PipelineEngine) are not "
    "estimated: each rank builds a different stage of the model and keeps a different number of "
    "micro-batches' activations, so one rank's trace is not every GPU's peak; give the job a "
    "whole-GPU request")


def _nvme(option: str) -> str:
    """Why offload to NVMe is refused."""
    return (f"DeepSpeed's zero_optimization.{option} to NVMe (device 'nvme') is not estimated: "
            f"its swapper's pinned buffers and asynchronous file I/O (DeepSpeed's AIO, a C++ "
            f"extension) are not traced; estimate the job with offload to 'cpu' instead "
            f"(DeepSpeed moves the same tensors off the GPU), or give it a whole-GPU request")


def _untraced(engine: Any) -> str:
    """Why a DeepSpeed engine's configuration cannot be traced truthfully, or ''."""
    zero = engine._config.zero_config
    for option, offload in (("offload_optimizer", zero.offload_optimizer),
                            ("offload_param", zero.offload_param)):
        # OffloadDeviceConfig.device: an OffloadDeviceEnum (runtime/zero/offload_config.py)
        device = getattr(offload, "device", None)
        if str(getattr(device, "value", device)) == "nvme":
            return _nvme(option)
    return ""


def _refuse_nvme_params(patches: Any, module: Any) -> None:
    """Parameters offloaded to NVMe are refused where ``deepspeed.zero.Init`` makes their
    swapper (partition_parameters.py, ``Init.__init__``: ``AsyncPartitionedParameterSwapper``
    for remote_device 'nvme'), before the engine is made."""
    from xmem_admission.estimator.probe.outcomes import Refused

    def swapper(*args: Any, **kwargs: Any) -> Any:
        raise Refused(_nvme("offload_param"))

    patches.set(module, "AsyncPartitionedParameterSwapper", swapper)


def _refuse_untraced(patches: Any, engine_class: Any, pipeline_class: Any) -> None:
    """Refuse, where the engine sets up its optimizer (engine.py, ``DeepSpeedEngine.__init__``
    calls ``_configure_optimizer`` once the config is read), what is not traced truthfully
    (``_untraced``), and pipeline engines (``PIPELINE_REASON``)."""
    from xmem_admission.estimator.probe.outcomes import Refused

    real_configure = engine_class._configure_optimizer

    def configure_optimizer(self: Any, *args: Any, **kwargs: Any) -> Any:
        reason = _untraced(self)
        if reason:
            raise Refused(reason)
        return real_configure(self, *args, **kwargs)

    def pipeline(self: Any, *args: Any, **kwargs: Any) -> None:
        raise Refused(PIPELINE_REASON)

    patches.set(engine_class, "_configure_optimizer", configure_optimizer)
    patches.set(pipeline_class, "__init__", pipeline)


def _no_overflow(patches: Any, module: Any) -> None:
    """A step is never skipped. DeepSpeed skips one when a gradient holds inf or NaN: the
    overflow check of fp16 loss scaling (``has_overflow``, stage_1_and_2.py) and the check of
    the global gradient norm (``is_invalid_grad_norm``, deepspeed/runtime/utils.py). Fake
    gradients have no values; the check runs (what it allocates is traced) and, where it would
    read a value fake mode lacks, answers "finite", as a real run does on all but a few first
    fp16 steps (a skipped step allocates less: the optimizer state is made by a step)."""
    import torch

    from xmem_admission.estimator.probe.outcomes import NeedsRealValues

    def finite(real: Callable[..., Any]) -> Callable[..., Any]:
        def check(*args: Any, **kwargs: Any) -> Any:
            try:
                out = real(*args, **kwargs)
                # a check that answers with a tensor (``_has_inf_or_nan``), read here
                return bool(out) if isinstance(out, torch.Tensor) else out
            except NeedsRealValues:
                return False

        return check

    real_check = getattr(module, "is_invalid_grad_norm", None)
    if real_check is not None:
        patches.set(module, "is_invalid_grad_norm", finite(real_check))
    for cls in vars(module).values():
        if not (isinstance(cls, type) and cls.__module__ == module.__name__):
            continue
        if "has_overflow" in vars(cls):
            patches.set(cls, "has_overflow", finite(vars(cls)["has_overflow"]))
        # the offloaded step checks each gradient as it copies it to the host
        # (stage_1_and_2.py, ``update_offload_overflow_tracker``)
        check = vars(cls).get("_has_inf_or_nan")
        if isinstance(check, staticmethod):
            patches.set(cls, "_has_inf_or_nan", staticmethod(finite(check.__func__)))


def _name_zero12(patches: Any, tracker: Any, cls: Any) -> None:
    """ZeRO-1/2's buffers by what they hold (``DeepSpeedZeroOptimizer``), named once it is made
    and again after each reduction: the flat 16-bit groups the parameters view are parameters;
    the fp32 partitions the optimizer steps are optimizer state (ZeRO's accounting: master
    weights with the optimizer's moments); the reduction buckets (``ipg_buckets``, of
    ``reduce_bucket_size`` elements each: ``setup_buckets``) are communication; this rank's
    reduced gradients (``grads_in_partition`` for stage 2, ``averaged_gradients``) and their
    fp32 copy the step makes (``unscale_and_clip_grads`` gets it) are gradients."""

    def name(self: Any) -> None:
        for flat in getattr(self, "bit16_groups_flat", ()):
            tracker.tag(flat, Category.PARAMETER)
        for master in getattr(self, "single_partition_of_fp32_groups", ()):
            tracker.tag(master, Category.OPTIMIZER_STATE)
            tracker.tag(getattr(master, "grad", None), Category.GRADIENT)
        for group in getattr(self, "bit16_groups", ()):
            for param in group:
                tracker.tag(getattr(param, "grad", None), Category.GRADIENT)
        tracker.tag(getattr(self, "grads_in_partition", None), Category.GRADIENT)
        averaged = getattr(self, "averaged_gradients", None)
        for grads in (averaged.values() if isinstance(averaged, dict) else ()):
            for grad in grads or ():
                tracker.tag(grad, Category.GRADIENT)
        for bucket in getattr(self, "ipg_buckets", {}).values():
            for buffer in getattr(bucket, "buffer", ()):
                tracker.tag(buffer, Category.COMMUNICATION)

    def around(method: str) -> None:
        # before as well: the probe names each parameter's ``.grad`` a gradient when the
        # backward pass returns, and the last bucket's are still views of its buffer then
        real = getattr(cls, method, None)
        if real is None:
            return

        def named(self: Any, *args: Any, **kwargs: Any) -> Any:
            if method != "__init__":
                name(self)
            out = real(self, *args, **kwargs)
            name(self)
            return out

        patches.set(cls, method, named)

    for method in ("__init__", "independent_gradient_partition_epilogue", "reduce_gradients"):
        around(method)
    real_clip = cls.unscale_and_clip_grads

    def unscale_and_clip_grads(self: Any, grad_groups_flat: Any, *args: Any, **kwargs: Any) -> Any:
        for grad in grad_groups_flat:
            tracker.tag(grad, Category.GRADIENT)
        return real_clip(self, grad_groups_flat, *args, **kwargs)

    patches.set(cls, "unscale_and_clip_grads", unscale_and_clip_grads)


def _name_zero3(patches: Any, tracker: Any, cls: Any) -> None:
    """ZeRO-3's buffers by what they hold (stage3.py, ``DeepSpeedZeroOptimizer_Stage3``), named
    once it is made and after each reduction and step: this rank's 16-bit partition of every
    parameter (``lp_param_buffer``, which ``fp16_partitioned_groups_flat`` and each parameter's
    ``ds_tensor`` view: ``_create_fp16_partitions_with_defragmentation``) and the persistent
    parameters, kept whole (``persistent_parameters``: at most
    ``stage3_param_persistence_threshold`` elements each), are parameters; the fp32 partitions
    the optimizer steps (``fp32_partitioned_groups_flat``) are optimizer state; the reduced
    16-bit gradient partitions (``grad_partitions_flat_buffer``) and the fp32 gradient the step
    makes of a sub-group (``fp32_partitioned_groups_flat[i].grad``) are gradients; the reduce
    buckets (``ipg_buckets``, ``reduce_bucket_size`` elements each: ``_setup_for_real_optimizer``)
    are communication. Offloaded buffers are on the host and hold no block."""

    def name(self: Any) -> None:
        tracker.tag(getattr(self, "lp_param_buffer", None), Category.PARAMETER)
        for flat in getattr(self, "fp16_partitioned_groups_flat", ()):
            tracker.tag(flat, Category.PARAMETER)
        for group in getattr(self, "fp16_groups", ()):
            for param in group:
                tracker.tag(getattr(param, "ds_tensor", None), Category.PARAMETER)
        for param in getattr(self, "persistent_parameters", ()):
            tracker.tag(param.data, Category.PARAMETER)
        for master in getattr(self, "fp32_partitioned_groups_flat", ()):
            tracker.tag(master, Category.OPTIMIZER_STATE)
            tracker.tag(getattr(master, "grad", None), Category.GRADIENT)
        tracker.tag(getattr(self, "grad_partitions_flat_buffer", None), Category.GRADIENT)
        for bucket in getattr(self, "ipg_buckets", {}).values():
            tracker.tag(getattr(bucket, "buffer", None), Category.COMMUNICATION)

    def around(method: str) -> None:
        real = getattr(cls, method, None)
        if real is None:
            return

        def named(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = real(self, *args, **kwargs)
            name(self)
            return out

        patches.set(cls, method, named)

    for method in ("__init__", "independent_gradient_partition_epilogue",
                   "_prepare_fp32_grad_for_sub_group", "_post_step"):
        around(method)


def _name_gathered(patches: Any, tracker: Any, module: Any) -> None:
    """A gathered ZeRO-3 parameter is a parameter; the buffer a coalesced all-gather receives
    into is communication (partition_parameters.py: ``_all_gather_dtype`` receives every
    rank's partitions of a bucket of parameters into one ``flat_tensor``, and
    ``AllGatherCoalescedHandle.wait`` copies each parameter out of it with ``torch.cat``; a
    single parameter, ``_all_gather_sequential``, is received into a ``param_buffer`` its data
    then views, ``AllGatherHandle.wait``). How many are gathered at once is DeepSpeed's own
    decision, which runs unchanged (partitioned_param_coordinator.py, ``fetch_sub_module``:
    the prefetch of ``stage3_prefetch_bucket_size`` elements within
    ``stage3_max_live_parameters``; ``__params_to_release``: a parameter reused within
    ``stage3_max_reuse_distance`` elements stays gathered)."""

    def named(cls: Any, params_of: Callable[[Any], Any]) -> None:
        real_wait = cls.wait

        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            for partition in getattr(self, "partitions", None) or ():
                tracker.tag(partition, Category.COMMUNICATION)
            out = real_wait(self, *args, **kwargs)
            for param in params_of(self):
                tracker.tag(param.data, Category.PARAMETER)
            return out

        patches.set(cls, "wait", wait)

    named(module.AllGatherCoalescedHandle, lambda handle: handle.params)
    named(module.AllGatherHandle, lambda handle: [handle._AllGatherHandle__param])


def _one_step(patches: Any, cls: Any) -> None:
    """A ZeRO optimizer's ``step`` is the job's optimizer step. It steps the optimizer it wraps
    once per parameter group (stage_1_and_2.py and stage3.py, ``_optimizer_step``: the wrapped
    optimizer's ``param_groups`` narrowed to one group at a time), which torch's global step
    hooks (the probe's step counter) would count as that many steps; here they see the wrapped
    optimizer step once, around the whole ZeRO step: from the gradient norm to the all-gather of
    the updated 16-bit partitions. A step DeepSpeed skips for an fp16 overflow (profile mode,
    where values are real) is not counted."""
    from torch.optim import optimizer as optimizer_module

    real_step = cls.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        from collections import OrderedDict

        inner = self.optimizer
        seen = _ModelStep(self) if _offloads_optimizer(self) else inner
        for hook in list(optimizer_module._global_optimizer_pre_hooks.values()):
            hook(seen, args, kwargs)
        hooks = (optimizer_module._global_optimizer_pre_hooks,
                 optimizer_module._global_optimizer_post_hooks)
        optimizer_module._global_optimizer_pre_hooks = OrderedDict()
        optimizer_module._global_optimizer_post_hooks = OrderedDict()
        try:
            out = real_step(self, *args, **kwargs)
        finally:
            (optimizer_module._global_optimizer_pre_hooks,
             optimizer_module._global_optimizer_post_hooks) = hooks
        if not getattr(self, "overflow", False):
            for hook in list(optimizer_module._global_optimizer_post_hooks.values()):
                hook(inner, args, kwargs)
        return out

    patches.set(cls, "step", step)


def _offloads_optimizer(zero: Any) -> bool:
    """Whether a ZeRO optimizer keeps its fp32 partitions and optimizer state on the host
    (zero_optimization.offload_optimizer: ``cpu_offload`` in stage_1_and_2.py,
    ``offload_optimizer`` in stage3.py)."""
    return bool(getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False))


class _ModelStep:
    """What an offloaded ZeRO step updates, as the probe's step hooks see it: the model's 16-bit
    parameters, on the GPU (stage_1_and_2.py ``bit16_groups``, stage3.py ``fp16_groups``),
    which the step copies the updated host partitions into. The optimizer DeepSpeed steps
    holds only host tensors (the fp32 partitions), which are no GPU job's parameters."""

    def __init__(self, zero: Any) -> None:
        groups: Any = getattr(zero, "bit16_groups", None) or getattr(zero, "fp16_groups", ())
        self.param_groups = [{"params": list(group)} for group in groups]
        self.state = zero.optimizer.state


def _host_adam(patches: Any, tracker: Any) -> None:
    """DeepSpeedCPUAdam in fake mode (deepspeed/ops/adam/cpu_adam.py): the optimizer of
    zero_optimization.offload_optimizer. Its Python code runs (the moments are made on the
    host: ``step``'s ``torch.zeros_like(p.data, device='cpu')``); its update is a C++ op
    (``CPUAdamBuilder().load()``, csrc/adam/cpu_adam_impl.cpp, ``Adam_Optimizer::Step_AVX``)
    that writes the host parameter, gradient and moments in place and allocates nothing on the
    GPU. Fake host tensors have no data for it to read, so in fake mode the op is not built (a
    JIT build of it took 316 s with g++ 12.2 on the development machine) and its update, which
    changes values only, is not run. In profile mode DeepSpeed loads and runs its own op."""
    if not tracker.fake:
        return
    cpu_adam = importlib.import_module("deepspeed.ops.adam.cpu_adam")
    patches.set(cpu_adam, "CPUAdamBuilder", _HostAdamBuilder)


class _HostAdamBuilder:
    """``CPUAdamBuilder`` in fake mode: ``load()`` gives the host update that changes values
    only (``_host_adam``)."""

    def load(self) -> _HostAdamUpdate:
        return _HostAdamUpdate()


class _HostAdamUpdate:
    """The cpu_adam op's entry points (csrc/adam/cpu_adam.cpp, ``PYBIND11_MODULE``) for tensors
    without values: each writes host values in place and allocates no GPU memory."""

    def create_adam(self, *args: Any) -> None:
        return None

    def destroy_adam(self, *args: Any) -> None:
        return None

    def adam_update(self, *args: Any) -> None:
        return None

    def adam_rollback(self, *args: Any) -> None:
        return None
