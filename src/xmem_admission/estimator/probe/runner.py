"""The probe: run an unmodified training script on the CPU and record its GPU allocation trace.

``python -m xmem_admission.estimator.probe.runner --out RESULT.json [options] -- python train.py ARGS`` runs the
script with ``runpy`` under the virtual CUDA device (``virtual_cuda``/``patches``) and the
allocation tracker (``tracker``), counts optimizer steps with PyTorch's global optimizer hooks,
stops the script cleanly right after step K (nothing after it runs: no checkpoint is written),
and writes one JSON result: status, steps, seconds, peak RSS and the trace.

Statuses: ``ok``; ``needs_real_values`` (fake mode met a decision on a value it cannot know:
rerun in profile mode); ``not_on_gpu`` (the script steps a model that is not on the virtual
GPU: a placement the probe did not see; the reason names the module and the call that left it
on the host); ``script_error`` (the script raised or exited non-zero before step K:
traceback and exit code included, ``steps`` counts the steps it made, and when it made any the
reason says so too); ``no_step`` (the script ended without an optimizer step: neither a ``torch.optim`` step nor
in-place updates of the model's parameters after a backward pass). Python >= 3.9
and torch >= 2.2 only (older: ``unsupported`` with the range): this module ships in the probe bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import sys
import time
import traceback
import weakref
from typing import Any, Dict, List, Optional, Sequence, Set

# Also read as the runner's own (sitehook): re-exported.
from xmem_admission.estimator.command import launch_of as launch_of
from xmem_admission.estimator.command import split_command as split_command
from xmem_admission.estimator.probe import replaced
from xmem_admission.estimator.probe.outcomes import (
    NeedsRealValues,
    NotAGPUJob,
    Refused,
    ShortcutFailed,
    StopProbe,
    gpu_only_cause,
    needs_values_cause,
)
from xmem_admission.estimator.trace import gc_paused

MODES = ("fake", "profile")


class ProbeResult:
    def __init__(self, status: str, mode: str, steps: int, seconds: float, trace: Any = None,
                 reason: str = "", exit_code: int = 0, tb: str = "",
                 retry_env: Optional[Dict[str, str]] = None) -> None:
        self.status = status
        self.mode = mode
        self.steps = steps
        self.seconds = seconds
        self.trace = trace
        self.reason = reason
        self.exit_code = exit_code
        self.traceback = tb
        # an ``unsupported`` trace that a new process with these variables set traces again
        # (``outcomes.ShortcutFailed``)
        self.retry_env = dict(retry_env or {})

    def to_dict(self) -> Dict[str, Any]:
        return {
            "status": self.status, "mode": self.mode, "steps": self.steps,
            "seconds": round(self.seconds, 3), "reason": self.reason,
            "exit_code": self.exit_code, "traceback": self.traceback,
            "retry_env": self.retry_env,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "trace": self.trace.to_dict() if self.trace is not None else None,
        }


class _StepHooks:
    """Phases (forward, backward, optimizer) and step counting through PyTorch's global hooks."""

    def __init__(self, tracker: Any, steps: int) -> None:
        import torch

        self.torch = torch
        self.tracker = tracker
        self.steps_wanted = steps
        self.steps = 0
        self.depth = 0
        self._seen_roots: weakref.WeakSet[Any] = weakref.WeakSet()
        self._modules: weakref.WeakSet[Any] = weakref.WeakSet()
        self._handles: List[Any] = []
        self._real_backward = torch.autograd.backward
        self.manual_open = False
        self.stop_pending = False
        tracker.on_parameter_update = self._parameter_update

    def install(self, patches: Any) -> None:
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optim_mod

        self._handles = [
            module_mod.register_module_forward_pre_hook(self._forward_pre),
            module_mod.register_module_forward_hook(self._forward_post),
            optim_mod.register_optimizer_step_pre_hook(self._step_pre),
            optim_mod.register_optimizer_step_post_hook(self._step_post),
        ]
        patches.set(self.torch.autograd, "backward", self._backward)
        real_zero_grad = self.torch.nn.Module.zero_grad

        def zero_grad(module: Any, *args: Any, **kwargs: Any) -> Any:
            self.step_boundary()
            return real_zero_grad(module, *args, **kwargs)

        patches.set(self.torch.nn.Module, "zero_grad", zero_grad)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _forward_pre(self, module: Any, _inputs: Any) -> None:
        if self.depth == 0 and self.tracker.phase != "backward":
            self.step_boundary()
            self.tracker.enter_phase("forward")
            if module not in self._seen_roots:
                self._seen_roots.add(module)
                self.tracker.tag_parameters(module)
                for sub in module.modules():
                    self._modules.add(sub)
        self.depth += 1
        self.tracker.modules.enter(module)

    def _forward_post(self, module: Any, _inputs: Any, _output: Any) -> None:
        self.tracker.modules.exit(module)
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.tracker.phase == "forward":
            self.tracker.enter_phase("loss")
            self.tracker.modules.leave_forward()

    def _backward(self, *args: Any, **kwargs: Any) -> Any:
        self.step_boundary()
        self.depth = 0
        previous = self.tracker.phase
        self.tracker.modules.reset()
        self.tracker.enter_phase("backward")
        try:
            return self._real_backward(*args, **kwargs)
        finally:
            self._tag_gradients(module.parameters() for module in list(self._modules))
            self.tracker.enter_phase("after_backward" if previous != "backward" else previous)

    def _tag_gradients(self, groups: Any) -> None:
        from xmem_admission.estimator.trace import Category

        for params in groups:
            for p in params:
                if getattr(p, "grad", None) is not None:
                    self.tracker.tag(p.grad, Category.GRADIENT)

    def _step_pre(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._check_on_gpu([p for group in optimizer.param_groups for p in group["params"]],
                           f"{type(optimizer).__name__}.step()")
        self._tag_gradients(group["params"] for group in optimizer.param_groups)
        self.tracker.enter_phase("optimizer")

    def _check_on_gpu(self, params: List[Any], call: str) -> None:
        """Refuse a step that is not a GPU job's: a silently low estimate is the worst answer.

        A GPU run cannot step host parameters of a module whose forward ran on the GPU (it
        fails with a device mismatch), and a step with no parameter on the GPU traces nothing
        of the model: both mean the script kept its model off the (virtual) GPU here, most
        likely through a placement idiom the probe does not see. Offloaded optimizer copies
        (parameters of no module) are left alone.
        """
        stepped = [p for p in params if isinstance(p, self.torch.Tensor)]
        if not stepped:
            return
        offloaded = self._offloaded_ids()
        if offloaded and all(id(p) in offloaded for p in stepped):
            if self.tracker.forward_allocations > 0:
                return  # FSDP keeps them on the host by design and computes on the GPU
            raise NotAGPUJob(self._host_message(stepped, call, False))
        stepped = [p for p in stepped if id(p) not in offloaded]
        on_gpu = [self.tracker.is_cuda(p) for p in stepped]
        module_ids = {id(p) for m in list(self._modules) for p in m.parameters(recurse=False)}
        host = [p for p, cuda in zip(stepped, on_gpu) if not cuda and id(p) in module_ids]
        gpu_activations = self.tracker.forward_allocations > 0
        if any(on_gpu) and not (host and gpu_activations):
            return
        raise NotAGPUJob(self._host_message(host or stepped, call, any(on_gpu)))

    def _offloaded_ids(self) -> Set[int]:
        """Parameters FSDP keeps on the host on purpose (CPU offload): it copies each shard to the
        GPU to gather it, and the optimizer steps it on the host. FSDP1:
        ``FullyShardedDataParallel(cpu_offload=CPUOffload(offload_params=True))`` (its flat
        parameters); FSDP2: ``fully_shard(offload_policy=CPUOffloadPolicy())`` (its sharded
        parameters)."""
        ids: Set[int] = set()
        for module in list(self._modules):
            if getattr(getattr(module, "cpu_offload", None), "offload_params", False):
                # its flat parameters are registered on the module it wraps
                ids.update(id(p) for p in module.parameters())
            state = getattr(module, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
            if group is not None and type(getattr(group, "offload_policy", None)).__name__ \
                    == "CPUOffloadPolicy":
                ids.update(id(fp.sharded_param) for fp in getattr(group, "fsdp_params", ()))
        return ids

    def _host_message(self, host: List[Any], call: str, some_on_gpu: bool) -> str:
        from xmem_admission.estimator.probe.torch_patches import APPLY_SITES

        host_ids = {id(p) for p in host}
        what = (f"{len(host)} parameter tensors "
                f"({sum(p.numel() * p.element_size() for p in host) / 2**20:.1f} MiB)")
        site: Any = None
        for root in list(self._seen_roots):
            names = [n for n, p in root.named_parameters() if id(p) in host_ids]
            if not names:
                continue
            # The innermost module that holds them all, and the latest move of it or of a
            # module above it.
            parts = [n.split(".")[:-1] for n in names]
            common: List[str] = []
            for level in zip(*parts):
                if len(set(level)) > 1:
                    break
                common.append(level[0])
            modules = dict(root.named_modules())
            paths = [".".join(common[:i]) for i in range(len(common), -1, -1)]
            site = max((APPLY_SITES[modules[q]] for q in paths if modules[q] in APPLY_SITES),
                       default=None)
            holder = modules[paths[0]]
            what += (f" of {paths[0] or 'the model'} ({type(holder).__name__}): "
                     f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''},")
            break
        where = ("while the step's activations are on the GPU" if some_on_gpu
                 else "and no parameter is on the GPU at all")
        why = (f"the last move of that module, at {site[1]}, left it on the host" if site
               else "no .to()/.cuda() call ever moved that module")
        return (f"{call} updates {what} that live on the host {where}: {why}. This is not a "
                f"GPU job as traced, so it is not estimated (a GPU run would fail or use "
                f"memory the trace does not hold)")

    def _step_post(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        from xmem_admission.estimator.trace import Category

        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, self.torch.Tensor):
                    self.tracker.tag(value, Category.OPTIMIZER_STATE)
        self._finish_step(raise_at_last=True)

    def _finish_step(self, raise_at_last: bool) -> None:
        self.tracker.enter_phase("after_step")
        self.tracker.forward_allocations = 0
        self.steps += 1
        self.tracker.trace.mark(f"step {self.steps}")
        if raise_at_last and self.steps >= self.steps_wanted:
            raise StopProbe()

    # -- steps without torch.optim ------------------------------------------------------------
    # A backward pass followed by in-place updates of the model's parameters (word_language_model's
    # ``p.data.add_(p.grad, alpha=-lr)``) is a step. The tracker reports every op after a backward
    # (``on_parameter_update``, True for a write into a parameter): the first update opens the
    # step, the first other op closes it (the step's mark goes there); backward passes without an
    # update between them are one step's gradient accumulation. After the last step the script
    # stops where its next forward or backward pass, or its zero_grad, begins, so the rest of the
    # update loop is traced.
    def _parameter_update(self, updating: bool) -> None:
        if updating and not self.manual_open and self.tracker.phase == "after_backward":
            self.manual_open = True
            self.tracker.enter_phase("optimizer")
        elif not updating and self.manual_open:
            self.close_manual_step()

    def close_manual_step(self) -> None:
        """Count an open manual step; stop the script if it was the last one and we are at a
        point where the script's own step is over (see above)."""
        if self.manual_open:
            self.manual_open = False
            self._finish_step(raise_at_last=False)
            self.stop_pending = self.steps >= self.steps_wanted

    def step_boundary(self) -> None:
        """A forward, backward or zero_grad begins: any manual step is over."""
        self.close_manual_step()
        if self.stop_pending:
            raise StopProbe()


# Whether a probe runs in this process now: a process the script forks (a multiprocessing pool
# preparing data) leaves it at once (see ``_forked_child``).
_RUNNING = [False]
_FORK_HOOK = [False]
_CHILD_MODES_OFF: List[Any] = []


def _forked_child() -> None:
    """In a process forked by the traced script: host work with real tensors, untraced.

    The child inherits the probe's modes; it prepares data (a ``multiprocessing.Pool``, a
    worker of the script's own) whose results reach the script through a pickle, which fake
    tensors cannot cross. Nothing a child does reaches the GPU of the traced job.
    """
    if not _RUNNING[0]:
        return
    from torch.utils._python_dispatch import _disable_current_modes

    # Popped for the life of the child: the context is kept, never exited (a collected one
    # would push the modes back).
    _CHILD_MODES_OFF.append(_disable_current_modes())
    _CHILD_MODES_OFF[-1].__enter__()


def _cudnn_library() -> Optional[str]:
    """Where the traced torch's libcudnn is (``cudnn_heuristics.find_libcudnn`` in this
    process), so that a simulation on the same machine (``xmem estimate --python``) plans with
    that cuDNN, not its own; None without one."""
    try:
        from xmem_admission.estimator.cudnn_heuristics import find_libcudnn

        return find_libcudnn()
    except Exception:  # noqa: BLE001 - no cuDNN to name is no cuDNN here
        return None


def _cudnn_version() -> Optional[int]:
    """The traced torch's cuDNN (``torch.backends.cudnn.version()``, 8902 for 8.9.2), None
    without one: whoever simulates the trace elsewhere (``xmem estimate --python``) plans its
    convolutions as cuDNN beside this torch would (``orchestrate.ConvPlanner``)."""
    import torch

    try:
        version = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 - a library that does not load is no cuDNN here
        return None
    return int(version) if version else None


def run(argv: Sequence[str], mode: str, steps: int, device: Dict[str, Any]) -> ProbeResult:
    """Run the script given by ``argv`` (no interpreter) in this process and trace it."""
    import torch

    from xmem_admission.contract.torch_version import unsupported_reason

    too_old = unsupported_reason(torch.__version__)
    if too_old is not None:  # before importing what the probe stands on
        return ProbeResult("unsupported", mode, 0, 0.0, None, too_old)
    from xmem_admission.estimator.probe import distributed, side_effects
    from xmem_admission.estimator.probe import torch_patches as patching
    from xmem_admission.estimator.probe.tracker import AllocationTracker
    from xmem_admission.estimator.probe.virtual_cuda import DeviceMode
    from xmem_admission.estimator.trace import Trace

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    fake = mode == "fake"
    capability = tuple(device["compute_capability"])
    props = patching.VirtualDeviceProperties(device["name"], int(device["total_memory"]),
                                             capability, int(device.get("multi_processor_count", 1)))
    trace = Trace(meta={"tool": "xmem-probe", "mode": mode, "torch": torch.__version__,
                        "cuda": torch.version.cuda,  # the CUDA torch was built for, or None
                        "cudnn": _cudnn_version(), "cudnn_library": _cudnn_library(),
                        "device": device["name"],
                        "command": list(argv)})
    fake_mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = AllocationTracker(trace, fake=fake, fake_mode=fake_mode)
    device_mode = DeviceMode(tracker, capability, fake)
    hooks = _StepHooks(tracker, steps)
    patches = patching.Patches()
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    started = time.perf_counter()
    status, reason, code, tb = "ok", "", 0, ""
    retry_env: Dict[str, str] = {}
    world = None
    if not _FORK_HOOK[0] and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forked_child)
        _FORK_HOOK[0] = True
    _RUNNING[0] = True
    try:
        side_effects.install(patches, trace, fake)  # no tracker run, no Hub push (see there)
        patching.apply(patches, props, tracker, device_mode, fake)
        world = distributed.install(patches, tracker, device_mode)
        hooks.install(patches)
        replaced.install(patches)
        _run_argv(argv, fake_mode, tracker, device_mode)
        hooks.close_manual_step()
    except StopProbe:
        pass
    except NeedsRealValues as exc:
        status, reason = "needs_real_values", str(exc)
    except NotAGPUJob as exc:
        status, reason = "not_on_gpu", str(exc)
    except ShortcutFailed as exc:
        status, reason, retry_env = "unsupported", str(exc), exc.env
    except Refused as exc:
        status, reason = "unsupported", str(exc)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        gpu_only = gpu_only_cause(exc)
        if code != 0 and gpu_only is not None:  # the script caught it and exited
            status, reason = "unsupported", str(gpu_only)
        elif code != 0:
            status, reason = "script_error", f"the script exited with status {code}"
            reason += _after_steps(hooks.steps, steps)
    except Exception as exc:  # the user's script failed: report it, never hide it
        gpu_only = gpu_only_cause(exc)
        needs_values = needs_values_cause(exc) if fake else None
        if gpu_only is not None:
            status, reason = "unsupported", str(gpu_only)
        elif needs_values is not None:  # a value fake mode lacks, raised wherever it was
            status, reason = "needs_real_values", needs_values
        else:
            status, code = "script_error", 1
            reason = f"the script raised {type(exc).__name__}: {exc}"
            reason += _after_steps(hooks.steps, steps)
            tb = _user_traceback(exc)
    finally:
        _RUNNING[0] = False
        if world is not None:
            world.close()
        tracker.finish()
        hooks.remove()
        patches.restore()
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        _forget_script_module()
    if status == "ok" and hooks.steps == 0:
        status, reason = "no_step", "the script finished without an optimizer step"
    return ProbeResult(status, mode, hooks.steps, time.perf_counter() - started, trace, reason,
                       code, tb, retry_env)


def _forget_script_module() -> None:
    """Let go of the script's module once it has run, as ``runpy`` does for ``__main__``.

    ``multiprocessing``, imported for the first time by the script (datasets and transformers
    do), aliases the running ``__main__`` as ``__mp_main__`` (multiprocessing/__init__.py): the
    script's module, then kept for the process's life with everything its globals hold (a
    Trainer, its model's fake tensors), freed only at interpreter shutdown, when torch is half
    torn down (a segfault there with transformers 5 and torch 2.15). The alias is pointed back
    at the process's own ``__main__``, as multiprocessing would have set it."""
    main = sys.modules.get("__main__")
    if "__mp_main__" in sys.modules and sys.modules["__mp_main__"] is not main:
        sys.modules["__mp_main__"] = main  # type: ignore[assignment]


def _after_steps(done: int, wanted: int) -> str:
    """How far a failed script got, for its reason: nothing before the first optimizer step."""
    if done == 0:
        return ""
    return f" after {done} of {wanted} optimizer steps"


# Warnings that the probe's own machinery causes, never the script: reading a data pointer of a
# FakeTensor (torch warns it is deprecated; the script's code does it on every tensor, e.g.
# RNNBase.flatten_parameters, and on a GPU there is no FakeTensor), and torch.compile's note that
# global module hooks (the probe's step hooks) fire once more for an OptimizedModule.
_OWN_WARNINGS = (r"Accessing the data pointer of FakeTensor",
                 r"Using `torch\.compile\(module\)` when there are global hooks")


def _run_argv(argv: Sequence[str], fake_mode: Any, tracker: Any, device_mode: Any) -> None:
    import contextlib
    import warnings

    if not argv:
        raise ValueError("no script given")
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        for message in _OWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        stack.enter_context(tracker)
        stack.enter_context(device_mode)
        while True:
            try:
                _run_program(argv)
                return
            except replaced.Replaced as exc:  # os.exec*: trace the program it starts instead
                command = replaced.follow(exc, os.environ)
                prepare_rank(command, os.environ)
                argv = split_command(command)


def _run_program(argv: Sequence[str]) -> None:
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ValueError("-m needs a module name")
        sys.argv[:] = [argv[1]] + list(argv[2:])
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv[:] = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def _user_traceback(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "xmem_admission" not in f.filename and "runpy" not in f.filename]
    lines = traceback.format_list(frames[-40:])
    return "".join(lines) + "".join(traceback.format_exception_only(type(exc), exc))


def prepare_rank(command: Sequence[str], environ: Any) -> None:
    """Set the environment of the rank the probe traces: rank 0 of a launcher's world, or the
    ``env://`` variables a script that initialises itself reads (see ``distributed``)."""
    from xmem_admission.estimator.probe.distributed import rank_environment

    launch = launch_of(command)
    if launch is not None:
        environ.update(launch.rank0_environment())
    rank_environment(environ)


def main(args: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmem_admission.estimator.probe.runner",
                                     description="Trace a training script's GPU allocations.")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--mode", choices=MODES, default="fake")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device-json", required=True,
                        help='{"name", "total_memory", "compute_capability", '
                             '"multi_processor_count"} of the virtual GPU')
    parser.add_argument("command", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    command = ns.command[1:] if ns.command and ns.command[0] == "--" else ns.command
    prepare_rank(command, os.environ)
    result = run(split_command(command), ns.mode, ns.steps, json.loads(ns.device_json))
    with open(ns.out, "w", encoding="utf-8") as fh, gc_paused():
        fh.write(json.dumps(result.to_dict(), separators=(",", ":")))  # json.dump: pure Python
    return 0


if __name__ == "__main__":
    # Run as ``python -m``, this module is ``__main__``; a module that imports it by its name
    # (a script importing the probe, the site hook) would load a second copy with its own
    # process state (``_RUNNING``, the fork hook). One module under both names.
    if __spec__ is not None:
        sys.modules.setdefault(__spec__.name, sys.modules[__name__])
    # the result is written: nothing the script would still do at exit is wanted (``leave``)
    from xmem_admission.estimator.probe.leave import leave

    leave(main())
