"""CPU trace -> the allocation stream a CUDA run of the same job would make on a given GPU.

The probe already drops host memory (only storages on the virtual GPU are traced) and already
runs the CUDA code paths whose tensors differ (autocast lists, fused dropout, flash /
memory-efficient attention, foreach optimizers: see ``virtual_cuda``). What is left are buffers
that exist only on a GPU and depend on the GPU model: the cuBLAS workspaces. The probe marks the
first BLAS op of each thread (``cublas:main`` for forward ops, ``cublas:autograd`` for the
autograd engine's device thread); here each mark becomes the allocations CUDA makes at that
moment, sized for the target GPU. They are never freed: PyTorch keeps a workspace per
(handle, stream) for the life of the process (CublasHandlePool.cpp, ``getCUDABlasLtWorkspace`` /
``getCurrentCUDABlasHandle`` cache them in a map).

Standard library only (probe bundle).
"""

from __future__ import annotations

import os
import re
from typing import List, Mapping, Optional

from xmem_admission.contract.gpus import GPU
from xmem_admission.estimator.trace import ALLOC, MARK, Alloc, Category, Event, Trace

_WORKSPACE_CONFIG = re.compile(r"^(:\d+:\d+)+$")


def cublas_workspace_bytes(gpu: GPU, env: Optional[Mapping[str, str]] = None) -> int:
    """The cuBLAS workspace per handle: ``CUBLAS_WORKSPACE_CONFIG`` wins over the GPU default.

    The variable reads ``:SIZE_KIB:COUNT[:SIZE_KIB:COUNT...]`` and the workspace is the sum of
    SIZE_KIB * 1024 * COUNT (CublasHandlePool.cpp, ``parseChosenWorkspaceSize``); a malformed
    value falls back to the default there too.
    """
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG", "")
    if config and _WORKSPACE_CONFIG.match(config):
        numbers = [int(n) for n in config.strip(":").split(":")]
        return sum(size * 1024 * count for size, count in zip(numbers[::2], numbers[1::2]))
    return gpu.cublas_workspace_bytes


def cublaslt_workspace_bytes(gpu: GPU, env: Optional[Mapping[str, str]] = None) -> int:
    """The cuBLASLt workspace per handle; zero when it shares the cuBLAS one.

    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes Lt reuse the cuBLAS workspace, and
    ``CUBLASLT_WORKSPACE_SIZE`` (KiB) sets its size (CublasHandlePool.cpp,
    ``parseCUDABlasLtWorkspaceSize``).
    """
    env = os.environ if env is None else env
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") == "1":
        return 0
    size = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    if size.isdigit():
        return int(size) * 1024
    return gpu.cublaslt_workspace_bytes


def for_gpu(trace: Trace, gpu: GPU, env: Optional[Mapping[str, str]] = None) -> Trace:
    """Return a new trace for ``gpu``: cuBLAS marks replaced by that GPU's workspaces."""
    workspace = cublas_workspace_bytes(gpu, env)
    lt_workspace = cublaslt_workspace_bytes(gpu, env)
    next_id = 1 + max((e.id for e in trace.events if e.op == ALLOC), default=0)
    events: List[Event] = []
    workspace_category = Category.WORKSPACE.value
    for event in trace.events:
        events.append(event)
        if event.op != MARK or not event.label.startswith("cublas:"):
            continue
        for size in (workspace, lt_workspace):
            if size > 0:
                events.append(Alloc(ALLOC, next_id, size, 0, workspace_category, event.label))
                next_id += 1
    meta = dict(trace.meta, gpu=gpu.key, cublas_workspace_bytes=workspace,
                cublaslt_workspace_bytes=lt_workspace)
    return Trace(events, meta)
