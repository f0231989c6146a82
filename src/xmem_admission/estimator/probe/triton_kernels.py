"""Triton kernels a script launches itself, in fake mode: what they write is what their callers
allocated.

Libraries launch hand-written Triton kernels on CUDA tensors (TRL's chunked log-probabilities
behind ``SFTTrainer``'s fused LM head, Liger's fused losses): ``kernel[grid](*tensors, ...)``.
The tensors a kernel reads and writes are made by the calling Python code with torch (its
outputs, its scratch): the probe traces those as any other allocation. The launch itself takes
nothing from PyTorch's caching allocator (triton/runtime/jit.py, ``JITFunction.run``: it
compiles, then calls the driver's launcher with the tensors' pointers). On the probe's virtual
GPU there is no driver to compile for or launch on (Triton's NVIDIA backend asserts it finds
``libcuda.so``), and fake tensors have no memory to write: in fake mode a launch does nothing
and the trace notes which kernels ran this way. An autotuned kernel
(``triton.runtime.autotuner.Autotuner.run``) would benchmark its configurations on the GPU
first; nothing is benchmarked either.

Not modelled: a kernel's own global scratch (Triton's ``set_allocator`` memory for tensor
descriptors, used by TMA kernels; the libraries above do not use it).

Python >= 3.9, standard library and torch only: the probe bundle.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from xmem_admission.estimator.probe.distributed import _AfterImport
from xmem_admission.estimator.trace import NoteKind

_JIT = _AfterImport("triton.runtime.jit")
_AUTOTUNER = _AfterImport("triton.runtime.autotuner")


def install(patches: Any, tracker: Any, fake: bool) -> None:
    """In fake mode, make Triton launches no-ops once the script imports Triton."""
    if not fake:
        return
    for hook, patch in ((_JIT, _patch_jit), (_AUTOTUNER, _patch_autotuner)):
        if hook.name in sys.modules:
            patch(patches, tracker, sys.modules[hook.name])
        else:
            hook.arm(patches, functools.partial(patch, patches, tracker))


def _kernel_name(kernel: Any) -> str:
    """The Python function behind a JITFunction, an Autotuner or a Heuristics wrapper."""
    seen = 0
    while kernel is not None and seen < 8:
        fn = getattr(kernel, "fn", None)
        if fn is None or fn is kernel:
            break
        kernel, seen = fn, seen + 1
    return str(getattr(kernel, "__qualname__", None) or getattr(kernel, "__name__", "a kernel"))


def _launch(tracker: Any) -> Any:
    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        name = _kernel_name(self)
        tracker.trace.note(
            NoteKind.MODELLED, f"Triton kernel {name}: launched on tensors its caller "
            f"allocated (the launch itself allocates nothing; not run in fake mode)",
            key=f"triton {name}")
        return None

    return run


def _patch_jit(patches: Any, tracker: Any, module: Any) -> None:
    cls = getattr(module, "JITFunction", None)
    if cls is not None:
        patches.set(cls, "run", _launch(tracker))


def _patch_autotuner(patches: Any, tracker: Any, module: Any) -> None:
    for name in ("Autotuner", "Heuristics"):
        cls = getattr(module, name, None)
        if cls is not None:
            patches.set(cls, "run", _launch(tracker))
