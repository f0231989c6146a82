"""Every CUDA entry point of the torch under test has a disposition, and each one holds.

These run with whichever torch runs pytest: the development pin in the suite, the oldest and
newest supported releases in ``make test``'s torch runs, every minor release in ``make compat``.
A torch release that adds a ``torch.cuda`` function or a ``torch._C._cuda_*`` binding fails the
first test until ``probe/cuda_surface.py`` says what the virtual GPU does with it.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from tests.estimator.conftest import H200
from xmem_admission.estimator.probe import cuda_surface
from xmem_admission.estimator.probe import torch_patches as patching
from xmem_admission.estimator.probe.cuda_surface import C_GPU_ONLY, C_HOST, PUBLIC, Reach
from xmem_admission.estimator.probe.tracker import AllocationTracker
from xmem_admission.estimator.probe.virtual_cuda import DeviceMode
from xmem_admission.estimator.trace import Trace


def cuda_names():
    """torch.cuda's own functions and classes (not typing helpers, modules or exceptions)."""
    names = {}
    for name in dir(torch.cuda):
        value = getattr(torch.cuda, name)
        if inspect.ismodule(value) or not callable(value):
            continue
        if isinstance(value, type) and issubclass(value, BaseException):
            continue
        home = getattr(value, "__module__", None) or ""
        if home == "torch" or home.startswith(("torch.cuda", "torch._C", "torch._utils",
                                               "torch.storage")):
            names[name] = value
    return names


def binding_names():
    return sorted(n for n in dir(torch._C) if n.startswith("_cuda_"))


@pytest.fixture
def virtual_gpu():
    """The virtual device's patches applied as the runner applies them; undone afterwards."""
    props = patching.VirtualDeviceProperties(H200["name"], H200["total_memory"],
                                             tuple(H200["compute_capability"]),
                                             H200["multi_processor_count"])
    tracker = AllocationTracker(Trace(meta={}), fake=False, fake_mode=None)
    mode = DeviceMode(tracker, (9, 0), False)
    patches = patching.Patches()
    before = cuda_names()
    patching.apply(patches, props, tracker, mode, False)
    try:
        yield before
    finally:
        patches.restore()


def test_every_cuda_function_and_binding_of_this_torch_has_a_disposition(virtual_gpu):
    before = virtual_gpu
    answered = {name for name, value in before.items() if getattr(torch.cuda, name) is not value}
    missing = sorted(name for name, value in before.items()
                     if name not in answered and name not in PUBLIC
                     and not _legacy_type(value))
    bindings = set(cuda_surface.answer_bindings(None, None)) | set(C_HOST) | set(C_GPU_ONLY)
    unknown = [name for name in binding_names() if name not in bindings]
    assert not missing, (f"torch {torch.__version__}: torch.cuda names the virtual GPU neither "
                         f"answers nor lists in cuda_surface.PUBLIC: {missing}")
    assert not unknown, (f"torch {torch.__version__}: torch._C bindings with no disposition in "
                         f"cuda_surface: {unknown}")


def test_public_names_listed_as_answered_or_gpu_only_are_replaced(virtual_gpu):
    before = virtual_gpu
    kept = [name for name, (reach, _) in PUBLIC.items()
            if reach in (Reach.ANSWERED, Reach.GPU_ONLY) and name in before
            and not isinstance(before[name], type) and getattr(torch.cuda, name) is before[name]]
    assert not kept, f"listed as answered or refused but left as torch has them: {kept}"


def test_what_the_virtual_gpu_answers_or_torch_answers_on_the_host_runs_without_a_driver(
        virtual_gpu):
    failures = {}
    for name in sorted(cuda_names()):
        reach = PUBLIC.get(name, (Reach.ANSWERED, ""))[0]
        if reach not in (Reach.ANSWERED, Reach.THROUGH, Reach.HOST):
            continue
        value = getattr(torch.cuda, name)
        if isinstance(value, type) or not _takes_no_arguments(value):
            continue
        try:
            value()
        except Exception as exc:  # noqa: BLE001 - every failure is reported by name
            failures[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    for name in binding_names():
        # the bindings that only read (a setter called with nothing crashes some releases)
        if name in C_HOST and any(w in name for w in ("get", "is_", "Is", "Stats")) \
                and "set" not in name.lower():
            try:
                getattr(torch._C, name)()
            except TypeError:
                pass  # a binding whose signature pybind11 does not show takes arguments
            except Exception as exc:  # noqa: BLE001
                failures[f"torch._C.{name}"] = f"{type(exc).__name__}: {exc}"
    assert not failures, f"torch {torch.__version__}: {failures}"


def test_bindings_torch_imported_by_name_are_answered_there_too(virtual_gpu):
    # torch.cuda.graphs binds _cuda_isCurrentStreamCapturing at import; the optimizers' capture
    # health check asks through it (2.2-2.13): before, it reached the CUDA runtime and failed.
    assert torch.cuda.graphs.is_current_stream_capturing() is False
    assert torch.cuda.is_current_stream_capturing() is False
    assert torch._C._cuda_getDeviceCount() == 1


@pytest.mark.parametrize("call, named", [
    ("torch.cuda.caching_allocator_alloc(1024)", "caching_allocator_alloc"),
    ("with torch.cuda.graph(torch.cuda.CUDAGraph()):\n            pass", "torch.cuda.graph"),
    ("torch.cuda.current_blas_handle()", "current_blas_handle"),
    ("torch._C._cuda_getCurrentBlasHandle()", "_cuda_getCurrentBlasHandle"),
])
def test_a_script_that_dies_of_a_gpu_only_call_is_unsupported_with_the_name(
        probe_run, tmp_path, call, named):
    path = tmp_path / "gpu_only.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        model = torch.nn.Linear(8, 8).cuda()
        {call}
        """))
    result, _ = probe_run([str(path)])
    assert result.status == "unsupported"
    assert named in result.reason and "needs a real GPU" in result.reason


def test_a_script_that_catches_a_gpu_only_call_and_goes_on_is_traced(probe_run, tmp_path):
    path = tmp_path / "fallback.py"
    path.write_text(textwrap.dedent("""
        import torch
        try:
            handle = torch.cuda.current_blas_handle()
        except RuntimeError:
            handle = None
        model = torch.nn.Linear(8, 8).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(4, 8, device="cuda")).sum().backward()
            opt.step()
        """))
    result, _ = probe_run([str(path)])
    assert result.status == "ok" and result.steps == 3


@pytest.mark.parametrize("optimizer, amp, checkpoint", [
    ("adamw", "", False), ("adam", "fp16", False), ("adamw", "bf16", True), ("sgd", "fp16", True),
])
def test_optimizers_autocast_and_checkpointing_step_without_a_driver(
        probe_run, script, optimizer, amp, checkpoint):
    # The Adam/AdamW step failed with every torch from 2.4 to 2.13 (the capture health check),
    # and every script with 2.2 and 2.3 (torch.get_autocast_dtype does not exist there).
    argv = [script("amp_checkpoint.py"), "--optimizer", optimizer]
    if amp:
        argv += ["--amp", amp]
    if checkpoint:
        argv += ["--grad-ckpt"]
    for mode in ("fake", "profile"):
        result, _ = probe_run(argv, mode)
        assert (result.status, result.reason) == ("ok", ""), (mode, result.traceback)
        assert result.steps == 3


def test_a_torch_older_than_the_supported_range_is_refused_with_the_range(
        probe_run, script, monkeypatch):
    from xmem_admission.estimator.probe import runner

    monkeypatch.setattr(torch, "__version__", "2.1.2+cu121")
    result = runner.run([script("tiny_mlp.py")], "fake", 3, H200)
    assert result.status == "unsupported"
    assert "2.1.2+cu121" in result.reason and "2.2 to 2.15" in result.reason


def _takes_no_arguments(func):
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return True  # a builtin without a signature: try it
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in signature.parameters.values())


def _legacy_type(value):
    """torch.cuda.FloatTensor and friends, and the legacy storages: DeviceMode reads them."""
    name = getattr(value, "__name__", "")
    return isinstance(value, type) and (name.endswith("Tensor") or name.endswith("Storage"))
