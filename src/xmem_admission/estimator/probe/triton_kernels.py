"""Triton kernels a script launches itself: in fake mode what they write is what their callers
allocated; in profile mode Triton's interpreter runs them on the host.

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

In profile mode the kernels run, on the host: a kernel a library defines outside torch runs in
Triton's interpreter, as under ``TRITON_INTERPRET=1`` (triton/runtime/interpreter.py,
``InterpretedFunction``: numpy on host copies of its tensors, what it wrote copied back in
place). It runs outside the probe's modes: like the launch on a GPU, it allocates nothing the
trace should see.

TRL's fold of a kernel's tiles into an fp32 accumulator (``torch.addmm`` with ``out_dtype``,
trl/kernels/chunked_logprob.py, ``_addmm_fp32``) has no CPU kernel in torch (``addmm.dtype_out``
is registered for CUDA only): in profile mode it is computed in fp32 into the same accumulator,
again outside the modes (cuBLAS writes the product in place; its workspace is traced with the
first matrix product). An autotuned kernel with more than one configuration still needs a GPU
in profile mode: choosing one benchmarks them (triton/runtime/autotuner.py, ``Autotuner.run``).

Not modelled: a kernel's own global scratch (Triton's ``set_allocator`` memory for tensor
descriptors, used by TMA kernels; the libraries above do not use it).

Python >= 3.9, standard library and torch only: the probe bundle.
"""

from __future__ import annotations

import functools
import gc
import importlib
import os
import sys
import tempfile
from typing import Any, Dict, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from xmem_admission.estimator.probe.distributed import _AfterImport
from xmem_admission.estimator.probe.outcomes import GPUOnlyCall
from xmem_admission.estimator.trace import NoteKind

_JIT = _AfterImport("triton.runtime.jit")
_AUTOTUNER = _AfterImport("triton.runtime.autotuner")
_TORCH_DIR = os.path.dirname(torch.__file__)


def install(patches: Any, tracker: Any, fake: bool) -> None:
    """In fake mode, make Triton launches no-ops once the script imports Triton; in profile
    mode, run library kernels with Triton's interpreter."""
    hooks = ((_JIT, _patch_jit), (_AUTOTUNER, _patch_autotuner)) if fake else (
        (_JIT, _interpret),)
    if not fake:
        patches.set(torch, "addmm", _addmm_on_host(torch.addmm))
    for hook, patch in hooks:
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


# -- profile mode: the kernels run on the host ------------------------------------------------

def _inductor_folders() -> Tuple[str, ...]:
    """Where Inductor writes the kernels it generates: ``TORCHINDUCTOR_CACHE_DIR`` (which
    Inductor sets once it runs), else ``<temporary folder>/torchinductor_<user>``
    (torch/_inductor/runtime/cache_dir_utils.py, ``cache_dir`` and ``default_cache_dir``)."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    default = os.path.join(tempfile.gettempdir(), "torchinductor_")
    return (default, os.path.abspath(chosen)) if chosen else (default,)


def _a_library_kernel(fn: Any) -> bool:
    """Defined by a library or the script: not by torch, and not generated by Inductor (its
    kernels are its own). A script may itself live in a temporary folder."""
    path = getattr(getattr(fn, "__code__", None), "co_filename", "")
    return bool(path) and not path.startswith(_TORCH_DIR) \
        and not path.startswith(_inductor_folders())


def _interpret(patches: Any, tracker: Any, module: Any) -> None:
    """``JITFunction`` launches (and its calls from inside a kernel: the functions a kernel
    calls are ``JITFunction`` objects too) run as ``InterpretedFunction``, Triton's own
    interpreter of the kernel's Python source."""
    cls = getattr(module, "JITFunction", None)
    if cls is None or "run" not in vars(cls) or "__call__" not in vars(cls):
        return
    real_run, real_call = vars(cls)["run"], vars(cls)["__call__"]
    interpreted: Dict[Any, Any] = {}

    def interpreter(self: Any) -> Any:
        made = interpreted.get(self.fn)
        if made is None:
            made = interpreted[self.fn] = importlib.import_module(
                "triton.runtime.interpreter").InterpretedFunction(self.fn)
        return made

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _a_library_kernel(self.fn):
            return real_run(self, *args, **kwargs)
        name = _kernel_name(self)
        tracker.trace.note(
            NoteKind.MODELLED, f"Triton kernel {name}: run by Triton's interpreter on the host "
            f"(the launch itself allocates nothing)", key=f"triton {name}")
        try:
            with _disable_current_modes():
                return interpreter(self).run(*args, **kwargs)
        except Exception as exc:
            # Triton's interpreter does not cover every kernel (triton/runtime/interpreter.py,
            # GridExecutor.__call__ wraps what it meets as InterpreterError). An interpreter
            # without that class (Triton 2.2, beside torch 2.2) raises what it meets as it is,
            # so there any failure inside it is taken as the interpreter's.
            wraps = hasattr(sys.modules.get("triton.runtime.interpreter"), "InterpreterError")
            if wraps and type(exc).__name__ != "InterpreterError":  # the kernel's own error
                raise
            raise GPUOnlyCall(f"Triton kernel {name}", f"Triton's interpreter cannot run it "
                              f"on the host: {exc}") from exc
        finally:
            # The interpreter leaves reference cycles that hold the kernel's arguments (the
            # caller's buffers) until the next garbage collection, which a GPU launch does not
            # do: collected now, they are freed where the caller drops them.
            gc.collect()

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _a_library_kernel(self.fn):
            return real_call(self, *args, **kwargs)
        return interpreter(self)(*args, **kwargs)

    patches.set(cls, "run", run)
    patches.set(cls, "__call__", call)


def _addmm_on_host(real_addmm: Any) -> Any:
    def addmm(*args: Any, **kwargs: Any) -> Any:
        out_dtype = kwargs.pop("out_dtype", None)
        if out_dtype is None:
            return real_addmm(*args, **kwargs)
        out = kwargs.pop("out", None)
        beta, alpha = kwargs.pop("beta", 1), kwargs.pop("alpha", 1)
        inp, mat1, mat2 = args[:3]
        if out is None:  # the kernel's output, as on the GPU
            out = inp.new_empty((mat1.shape[0], mat2.shape[1]), dtype=out_dtype)
        with _disable_current_modes():
            out.copy_(real_addmm(inp.to(out_dtype), mat1.to(out_dtype), mat2.to(out_dtype),
                                 beta=beta, alpha=alpha))
        return out

    return addmm
