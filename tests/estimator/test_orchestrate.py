"""CPU trace -> CUDA allocation stream: the GPU-only buffers each GPU model adds."""

from __future__ import annotations

from xmem_admission.contract import gpus
from xmem_admission.estimator.orchestrate import cublas_workspace_bytes, for_gpu
from xmem_admission.estimator.trace import Trace


def traced():
    t = Trace()
    t.alloc(1, 1000, category="activation", phase="forward")
    t.mark("cublas:main")
    t.free(1)
    t.mark("cublas:autograd")
    return t


def workspaces(trace):
    return [e.size for e in trace.events if e.op == "alloc" and e.category == "workspace"]


def test_each_blas_thread_gets_a_workspace_sized_for_the_gpu():
    a100 = gpus.lookup("A100-80GB")
    h100 = gpus.lookup("H100-80GB")
    # CublasHandlePool.cpp: 4096*1024*2 + 16*1024*8 below sm90, 32 MiB on sm90
    assert workspaces(for_gpu(traced(), a100, env={})) == [
        8519680, a100.cublaslt_workspace_bytes] * 2
    assert workspaces(for_gpu(traced(), h100, env={}))[0] == 32 * 1024 * 1024


def test_cublas_workspace_config_overrides_the_default():
    gpu = gpus.lookup("A100-40GB")
    assert cublas_workspace_bytes(gpu, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * 2**20
    assert cublas_workspace_bytes(gpu, {"CUBLAS_WORKSPACE_CONFIG": ":16:8:4096:2"}) == (
        16 * 1024 * 8 + 4096 * 1024 * 2)
    assert cublas_workspace_bytes(gpu, {"CUBLAS_WORKSPACE_CONFIG": "garbage"}) == 8519680


def test_a_unified_lt_workspace_adds_no_second_buffer():
    gpu = gpus.lookup("A100-40GB")
    out = for_gpu(traced(), gpu, env={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"})
    assert workspaces(out) == [8519680, 8519680]


def test_rewriting_keeps_the_original_trace_and_valid_ids():
    t = traced()
    out = for_gpu(t, gpus.lookup("L40S"), env={})
    assert len(t.events) == 4
    out.validate()
    assert out.meta["gpu"] == "L40S"
