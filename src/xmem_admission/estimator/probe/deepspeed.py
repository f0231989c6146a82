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

What does not run on a CPU host is stood for here: decisions on values fake mode does not have
(the fp16/bf16 overflow check: a step is never skipped, as for torch's GradScaler); the step
count (one ZeRO step steps the wrapped optimizer once per group); and the tensors DeepSpeed
makes are named for the breakdown. What is not traced truthfully yet is refused with the
option named (``_untraced``): ZeRO-3, whose freed (empty) parameters read as host tensors on
the virtual GPU; optimizer and parameter offload; and pipeline engines, whose ranks differ.

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
    engine = importlib.import_module("deepspeed.runtime.engine")
    pipe = importlib.import_module("deepspeed.runtime.pipe.engine")
    _refuse_untraced(patches, engine.DeepSpeedEngine, pipe.PipelineEngine)
    _no_overflow(patches, stage_1_and_2)
    _name_zero12(patches, tracker, stage_1_and_2.DeepSpeedZeroOptimizer)
    _one_step(patches, stage_1_and_2.DeepSpeedZeroOptimizer)


PIPELINE_REASON = (
    "DeepSpeed pipeline-parallel jobs (deepspeed.pipe.PipelineModule, PipelineEngine) are not "
    "estimated: each rank builds a different stage of the model and keeps a different number of "
    "micro-batches' activations, so one rank's trace is not every GPU's peak; give the job a "
    "whole-GPU request")


def _untraced(engine: Any) -> str:
    """Why a DeepSpeed engine's configuration cannot be traced truthfully yet, or ''."""
    zero = engine._config.zero_config
    stage = engine.zero_optimization_stage()
    for option, offload in (("offload_optimizer", zero.offload_optimizer),
                            ("offload_param", zero.offload_param)):
        if offload is None:
            continue
        # OffloadDeviceConfig.device: an OffloadDeviceEnum (runtime/zero/offload_config.py)
        device = str(getattr(offload.device, "value", offload.device))
        if device != "none":
            return (f"DeepSpeed's zero_optimization.{option} (device {device!r}) is not "
                    f"estimated: the probe does not trace the offloaded optimizer step (DeepSpeed's "
                    f"CPU Adam, a C++ extension) nor the pinned host buffers it streams through; "
                    f"estimate the job without offloading (an upper bound of its GPU memory), or "
                    f"give it a whole-GPU request")
    if stage == 3:
        # A freed ZeRO-3 parameter's data is an empty tensor, which holds no block on the
        # virtual GPU and so reads as a host tensor; DeepSpeed makes tensors on the device
        # that data reads (partition_parameters.py: ``free_param``'s empty tensor,
        # ``_all_gather_sequential``'s ``.to(param.device)``). Seen with an embedding, whose
        # weight is freed again after a backward that does not gather it: a real host tensor
        # becomes its data and the next view of it fails in fake mode.
        return ("DeepSpeed ZeRO-3 (zero_optimization.stage 3) is not estimated yet: the "
                "probe does not yet keep its freed (empty) parameters on the virtual GPU, so "
                "gathered parameters would be traced on the host; estimate the job with ZeRO-2 "
                "(an upper bound of ZeRO-3's GPU memory), or use torchrun with FSDP")
    return ""


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
    from xmem_admission.estimator.probe.outcomes import NeedsRealValues

    def finite(real: Callable[..., Any]) -> Callable[..., Any]:
        def check(*args: Any, **kwargs: Any) -> Any:
            try:
                return real(*args, **kwargs)
            except NeedsRealValues:
                return False

        return check

    real_check = getattr(module, "is_invalid_grad_norm", None)
    if real_check is not None:
        patches.set(module, "is_invalid_grad_norm", finite(real_check))
    for cls in vars(module).values():
        if isinstance(cls, type) and cls.__module__ == module.__name__ \
                and "has_overflow" in vars(cls):
            patches.set(cls, "has_overflow", finite(vars(cls)["has_overflow"]))


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
        for hook in list(optimizer_module._global_optimizer_pre_hooks.values()):
            hook(inner, args, kwargs)
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
