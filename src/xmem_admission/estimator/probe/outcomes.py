"""How a traced run ends other than by finishing: the types every part of the probe raises.

The runner catches them and turns each into the result's status; the virtual device, the
distributed patches and the version checks raise them. They live here, below all of those, so
that none of them imports the runner (which imports them all). Each is a ``BaseException`` so
that a script's own ``except Exception`` does not swallow it.
"""

from __future__ import annotations

from typing import Dict, Optional, Set


class Refused(BaseException):
    """A job the probe does not estimate, for the reason given (status ``unsupported``)."""


class ShortcutFailed(Refused):
    """A shortcut of the probe's own (writing repeated steps instead of tracing them) failed
    its check: this trace is refused, and the job is traced again with the environment ``env``
    (the shortcut turned off), in a new process (status ``unsupported`` with ``retry_env``)."""

    def __init__(self, message: str, env: Dict[str, str]) -> None:
        super().__init__(message)
        self.env = dict(env)


class NotAGPUJob(Refused):
    """The script steps a model that is not on the virtual GPU (status ``not_on_gpu``)."""


class NeedsRealValues(BaseException):
    """Raised inside the traced script when it takes a decision on a value fake mode lacks, or
    runs an op whose size has no bound without values (status ``needs_real_values``: ``auto``
    traces again in profile mode).

    A ``BaseException`` so the script's own ``except Exception`` does not swallow it.
    """


class StopProbe(BaseException):
    """Raised from the optimizer hook after the last recorded step; ends the script cleanly."""


class GPUOnlyCall(RuntimeError):
    """The script (or torch under it) called a CUDA function only a real GPU can answer.

    A ``RuntimeError``, as the real call's failure would be, so code that catches it and goes
    on without (torch's own fallbacks do) is traced as usual; a script that dies of it is
    reported as ``unsupported`` with the name and the reason, never as a script error.
    """

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} needs a real GPU ({reason}); the probe's virtual GPU cannot "
                         f"answer it, so this job is not estimated")
        self.name = name
        self.reason = reason


# What torch says when a call reaches the CUDA runtime or driver on a machine without a GPU
# (c10/cuda/CUDAException.h C10_CUDA_CHECK: "CUDA error: ..."; CUDAHooks.cpp /
# CUDAFunctions.cpp device_count_impl: "Found no NVIDIA driver ..."; torch/cuda/__init__.py
# _lazy_init: "Torch not compiled with CUDA enabled", "No CUDA GPUs are available").
# Triton's, for a kernel launched on a machine without a GPU (triton/backends/nvidia/driver.py,
# libcuda_dirs: "libcuda.so cannot found!"; triton/runtime/driver.py, _create_driver: "0 active
# drivers").
_RUNTIME_FAILURES = ("CUDA error:", "Found no NVIDIA driver", "No CUDA GPUs are available",
                     "CUDA driver version is insufficient", "Torch not compiled with CUDA",
                     "CUDA driver initialization failed", "no CUDA-capable device",
                     "libcuda.so cannot found", "0 active drivers")


def gpu_only_cause(exc: BaseException) -> Optional[GPUOnlyCall]:
    """The ``GPUOnlyCall`` behind ``exc`` (itself, or in its cause or context chain), or one
    made for a failure of the CUDA runtime itself, named after the innermost torch function on
    its way there: a call the virtual device has no disposition for."""
    seen: Set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, GPUOnlyCall):
            return current
        if any(text in str(current) for text in _RUNTIME_FAILURES):
            return GPUOnlyCall(_innermost_torch_call(current),
                               f"it reached the CUDA runtime: {str(current).splitlines()[0]}")
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


# What torch's fake execution raises when it meets a value it does not have: the probe's own
# ``DataDependentValue`` (data_dependent.py), FakeTensor's exceptions (torch/_subclasses/
# fake_tensor.py: DataDependentOutputException, DynamicOutputShapeException,
# UnsupportedOperatorException is not one of them) and the symbolic-shape guard on an unbacked
# value (torch/fx/experimental/symbolic_shapes.py: GuardOnDataDependentSymNode).
_NEEDS_VALUES = ("DataDependentValue", "DataDependentOutputException",
                 "DynamicOutputShapeException", "GuardOnDataDependentSymNode")


def needs_values_cause(exc: BaseException) -> Optional[str]:
    """Why the script failed for want of a value fake execution lacks: such an exception
    itself, or one in its cause or context chain (a library that caught it and raised its own),
    however far from the op that raised it; None for any other failure."""
    seen: Set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, NeedsRealValues):
            return str(current)
        if any(cls.__name__ in _NEEDS_VALUES for cls in type(current).__mro__):
            detail = str(current).splitlines()[0] if str(current) else type(current).__name__
            return f"the script needs a value fake execution does not have: {detail}"
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _installed_module(path: str) -> Optional[str]:
    """The dotted module of a file of an installed package (torch, triton, transformers...),
    from the folder Python installs packages in; None for the script's own files."""
    for folder in ("/site-packages/", "/dist-packages/"):
        if folder in path:
            return path[path.rindex(folder) + len(folder):].rsplit(".", 1)[0].replace("/", ".")
    return None


def _innermost_torch_call(exc: BaseException) -> str:
    """The innermost frame of an installed package's Python code (torch's, or a library's such
    as Triton's) on the way to the failure, else the script's line that made the call."""
    import traceback

    torch_call = user_call = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        path = frame.filename.replace("\\", "/")
        if "xmem_admission" in path or path.endswith("runpy.py"):
            continue
        module = _installed_module(path)
        if module is not None:
            torch_call = f"{module}.{frame.name} ({frame.filename}:{frame.lineno})"
        else:
            user_call = f"the call at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return torch_call or user_call or "a CUDA call"
