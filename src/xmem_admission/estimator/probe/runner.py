"""The probe: run an unmodified training script on the CPU and record its GPU allocation trace.

``python -m xmem_admission.estimator.probe.runner --out RESULT.json [options] -- python train.py ARGS`` runs the
script with ``runpy`` under the virtual CUDA device (``virtual_cuda``/``patches``) and the
allocation tracker (``tracker``), counts optimizer steps with PyTorch's global optimizer hooks,
stops the script cleanly right after step K (nothing after it runs: no checkpoint is written),
and writes one JSON result: status, steps, seconds, peak RSS and the trace.

Statuses: ``ok``; ``needs_real_values`` (fake mode met a decision on a value it cannot know:
rerun in profile mode); ``script_error`` (the script raised or exited non-zero before step K:
traceback and exit code included, ``steps`` counts the steps it made, and when it made any the
reason says so too); ``no_step`` (the script ended without an optimizer step). Python >= 3.9
and torch >= 2.1 only: this module ships in the probe bundle.
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
from typing import Any, Dict, List, Optional, Sequence

MODES = ("fake", "profile")


class StopProbe(BaseException):
    """Raised from the optimizer hook after the last recorded step; ends the script cleanly."""


class ProbeResult:
    def __init__(self, status: str, mode: str, steps: int, seconds: float, trace: Any = None,
                 reason: str = "", exit_code: int = 0, tb: str = "") -> None:
        self.status = status
        self.mode = mode
        self.steps = steps
        self.seconds = seconds
        self.trace = trace
        self.reason = reason
        self.exit_code = exit_code
        self.traceback = tb

    def to_dict(self) -> Dict[str, Any]:
        return {
            "status": self.status, "mode": self.mode, "steps": self.steps,
            "seconds": round(self.seconds, 3), "reason": self.reason,
            "exit_code": self.exit_code, "traceback": self.traceback,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "trace": self.trace.to_dict() if self.trace is not None else None,
        }


def split_command(command: Sequence[str]) -> List[str]:
    """``python [-u] train.py a b`` / ``python -m pkg a`` / ``train.py a`` -> argv without python."""
    argv = list(command)
    if argv and os.path.basename(argv[0]).startswith("python"):
        argv = argv[1:]
        while argv and argv[0] in ("-u", "-B", "-O", "-W") or (argv and argv[0].startswith("-W")):
            argv = argv[2:] if argv[0] == "-W" else argv[1:]
    return argv


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

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _forward_pre(self, module: Any, _inputs: Any) -> None:
        if self.depth == 0 and self.tracker.phase != "backward":
            self.tracker.enter_phase("forward")
            if module not in self._seen_roots:
                self._seen_roots.add(module)
                from xmem_admission.estimator.trace import Category

                for tensor in list(module.parameters()) + list(module.buffers()):
                    self.tracker.tag(tensor, Category.PARAMETER)
                for sub in module.modules():
                    self._modules.add(sub)
        self.depth += 1

    def _forward_post(self, _module: Any, _inputs: Any, _output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.tracker.phase == "forward":
            self.tracker.enter_phase("loss")

    def _backward(self, *args: Any, **kwargs: Any) -> Any:
        self.depth = 0
        previous = self.tracker.phase
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
        self._tag_gradients(group["params"] for group in optimizer.param_groups)
        self.tracker.enter_phase("optimizer")

    def _step_post(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        from xmem_admission.estimator.trace import Category

        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, self.torch.Tensor):
                    self.tracker.tag(value, Category.OPTIMIZER_STATE)
        self.tracker.enter_phase("after_step")
        self.steps += 1
        self.tracker.trace.mark(f"step {self.steps}")
        if self.steps >= self.steps_wanted:
            raise StopProbe()


def run(argv: Sequence[str], mode: str, steps: int, device: Dict[str, Any]) -> ProbeResult:
    """Run the script given by ``argv`` (no interpreter) in this process and trace it."""
    import torch

    from xmem_admission.estimator.probe import torch_patches as patching
    from xmem_admission.estimator.probe.tracker import AllocationTracker
    from xmem_admission.estimator.probe.virtual_cuda import DeviceMode, NeedsRealValues
    from xmem_admission.estimator.trace import Trace

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    fake = mode == "fake"
    capability = tuple(device["compute_capability"])
    props = patching.VirtualDeviceProperties(device["name"], int(device["total_memory"]),
                                             capability, int(device.get("multi_processor_count", 1)))
    trace = Trace(meta={"tool": "xmem-probe", "mode": mode, "torch": torch.__version__,
                        "device": device["name"], "command": list(argv)})
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
    try:
        patching.apply(patches, props, tracker, device_mode, fake)
        hooks.install(patches)
        _run_argv(argv, fake_mode, tracker, device_mode)
    except StopProbe:
        pass
    except NeedsRealValues as exc:
        status, reason = "needs_real_values", str(exc)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code != 0:
            status, reason = "script_error", f"the script exited with status {code}"
            reason += _after_steps(hooks.steps, steps)
    except Exception as exc:  # the user's script failed: report it, never hide it
        status, code = "script_error", 1
        reason = f"the script raised {type(exc).__name__}: {exc}"
        reason += _after_steps(hooks.steps, steps)
        tb = _user_traceback(exc)
    finally:
        tracker.finish()
        hooks.remove()
        patches.restore()
        sys.argv[:], sys.path[:] = saved_argv, saved_path
    if status == "ok" and hooks.steps == 0:
        status, reason = "no_step", "the script finished without an optimizer step"
    return ProbeResult(status, mode, hooks.steps, time.perf_counter() - started, trace, reason,
                       code, tb)


def _after_steps(done: int, wanted: int) -> str:
    """How far a failed script got, for its reason: nothing before the first optimizer step."""
    if done == 0:
        return ""
    return f" after {done} of {wanted} optimizer steps"


def _run_argv(argv: Sequence[str], fake_mode: Any, tracker: Any, device_mode: Any) -> None:
    import contextlib

    if not argv:
        raise ValueError("no script given")
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        stack.enter_context(tracker)
        stack.enter_context(device_mode)
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
    result = run(split_command(command), ns.mode, ns.steps, json.loads(ns.device_json))
    with open(ns.out, "w", encoding="utf-8") as fh:
        json.dump(result.to_dict(), fh, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
