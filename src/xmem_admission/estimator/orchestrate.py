"""CPU trace -> the allocation stream a CUDA run of the same job would make on a given GPU.

The probe already drops host memory (only storages on the virtual GPU are traced) and already
runs the CUDA code paths whose tensors differ (autocast lists, fused dropout, flash /
memory-efficient attention, foreach optimizers: see ``virtual_cuda``). What is left are buffers
that exist only on a GPU and depend on the GPU model: the cuBLAS workspaces, and the cuDNN
convolution workspaces. The probe marks the
first BLAS op of each thread (``cublas:main`` for forward ops, ``cublas:autograd`` for the
autograd engine's device thread); here each mark becomes the allocations CUDA makes at that
moment, sized for the target GPU. They are never freed: PyTorch keeps a workspace per
(handle, stream) for the life of the process (CublasHandlePool.cpp, ``getCUDABlasLtWorkspace`` /
``getCurrentCUDABlasHandle`` cache them in a map).

The probe marks each convolution PyTorch runs through cuDNN (``cudnn:fwd``,
``cudnn:bwd_data+bwd_filter`` with the shapes, geometry, layout, dtype and cuDNN flags;
``conv_marks``);
each becomes a workspace allocated and freed at once, sized by the target GPU architecture's rule
(``contract.cudnn``), in the order of ``cudnn_convolution_backward`` (data, then filter). The
simulator treats a workspace it cannot allocate as PyTorch does: the next plan runs with a
smaller one (``try_plans``), not an OOM.

Standard library only (probe bundle).
"""

from __future__ import annotations

import math
import os
import re
from typing import List, Mapping, Optional, Tuple

from xmem_admission.contract import cudnn
from xmem_admission.contract.gpus import GPU
from xmem_admission.estimator.conv_marks import ConvMark
from xmem_admission.estimator.trace import ALLOC, FREE, MARK, Alloc, Category, Event, Free, Trace

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


def conv_workspaces(label: str, rule: cudnn.ConvWorkspaceRule,
                    cap_bytes: Optional[int] = None) -> List[Tuple[str, int]]:
    """(call, workspace bytes) for each cuDNN call of a ``cudnn:`` mark (``conv_marks``: marks
    of older traces and newer ones alike), in the order they run."""
    mark = ConvMark.parse(label)

    def nbytes(shape: Tuple[int, ...]) -> int:
        return math.prod(shape) * mark.itemsize

    x, y, w = nbytes(mark.x), nbytes(mark.y), nbytes(mark.w)
    return [(call, cudnn.workspace_bytes(rule, cudnn.ConvCall(call), x, y, w, cap_bytes))
            for call in mark.calls]


def for_gpu(trace: Trace, gpu: GPU, env: Optional[Mapping[str, str]] = None,
            conv_rule: Optional[cudnn.ConvWorkspaceRule] = None) -> Trace:
    """Return a new trace for ``gpu``: cuBLAS marks replaced by that GPU's workspaces, cuDNN
    marks by transient convolution workspaces (``conv_rule``, default the architecture's)."""
    workspace = cublas_workspace_bytes(gpu, env)
    lt_workspace = cublaslt_workspace_bytes(gpu, env)
    rule = conv_rule if conv_rule is not None else cudnn.rule_for(gpu.compute_capability)
    cap = cudnn.workspace_cap_bytes(env)
    next_id = 1 + max((e.id for e in trace.events if e.op == ALLOC), default=0)
    events: List[Event] = []
    workspace_category = Category.WORKSPACE.value
    resident_done = False
    for event in trace.events:
        events.append(event)
        if event.op != MARK:
            continue
        if event.label.startswith("cudnn:") and rule is not None:
            if not resident_done and rule.resident_bytes > 0:
                events.append(Alloc(ALLOC, next_id, rule.resident_bytes, 0,
                                    workspace_category, cudnn.RESIDENT_PHASE))
                next_id += 1
            resident_done = True
            for call, size in conv_workspaces(event.label, rule, cap):
                if size > 0:
                    events.append(Alloc(ALLOC, next_id, size, 0, workspace_category,
                                        f"{cudnn.TRANSIENT_PREFIX}{call}"))
                    events.append(Free(FREE, next_id))
                    next_id += 1
            continue
        if not event.label.startswith("cublas:"):
            continue
        for size in (workspace, lt_workspace):
            if size > 0:
                events.append(Alloc(ALLOC, next_id, size, 0, workspace_category, event.label))
                next_id += 1
    meta = dict(trace.meta, gpu=gpu.key, cublas_workspace_bytes=workspace,
                cublaslt_workspace_bytes=lt_workspace)
    return Trace(events, meta)
