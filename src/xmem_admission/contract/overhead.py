"""What a training process holds on the GPU outside the caching allocator, per GPU and CUDA.

Two parts, each a figure with its basis and source:

- **context**: what creating the CUDA context costs (the driver's per-context state, the
  CUDA runtime's and torch's module images under lazy loading). It depends on the GPU, the
  driver and the CUDA major version the job's torch was built for (``torch.version.cuda``, which
  the probe records in the trace).
- **runtime**: what the training step adds after the context exists: kernel modules loaded
  lazily on first use (cuBLAS/cuBLASLt, elementwise and reduction kernels, the optimizer's),
  library handles. The job's convolutions add cuDNN's modules on top (``cudnn``), counted only
  when the trace has convolutions.

Every figure says whether it was **measured** (read off a GPU run in this repository's data),
**fitted** (a quantile of measured rows, scored on rows it was not fitted on:
``bench/fits/fit_overhead.py``) or **inferred** (no measurement for this GPU and CUDA major: taken from
the one that was measured, and why). Inference always reaches for the largest figure known,
because on a shared GPU a request below what the job takes is a failed job.

The figures, and where they come from:

- H200, CUDA 13 (driver 580.159.04, torch 2.11.0+cu130; ``bench/data/H200/measurements.jsonl``,
  17 jobs): the context is 552,402,944 bytes (526.8 MiB) in every job
  (``context_bytes``: NVML used after ``torch.cuda.synchronize()`` created the context minus
  before). NVML's peak minus ``max_memory_reserved`` minus that context, over the 14 jobs that
  ran to completion and whose NVML peak saw the allocator's peak: 224-240 MiB for the jobs
  without convolutions (fp32 GEMMs 224, bf16 autocast 240), 240-244 MiB with convolutions.
  ``bench/fits/fit_overhead.py --h200`` fits the runtime figure as the largest value of the jobs
  without convolutions and cuDNN's as the largest excess of the jobs with them, each
  leave-one-out (every job scored with the figure fitted on the others).
- RTX 3060, RTX 4060, A100-40GB, CUDA 12 (torch 2.6 + CUDA 12.4, the xMem paper's runs): the
  runtime figure fitted on the paper's rows (85th percentile of measured minus simulated peak
  reserved, NVML measured after CUDA init so the context is excluded; ``bench/fits/fit_overhead.py``
  on ``xmem bench paper`` output, scored leave-one-out by ``bench/fits/fit_paper_conv_workspace.py``).
  Those rows include convolution jobs, so cuDNN's modules are inside that figure.
- A GPU without a measured context is given one inferred from the H200's: the driver backs a
  1 KiB stack for every thread the GPU can hold resident (SMs x threads per SM), the part of a
  context that grows with the GPU; the rest is taken as it was measured (``_context``). On an
  RTX 4060 (24 SMs of 1536 threads) that is 299 MiB, where the conservative "largest figure"
  would give 527 MiB and call jobs that ran on the paper's RTX 4060 out of memory.
- Each fitted figure carries the spread of the rows it was fitted on (``Figure.low``/``high``):
  the H200's runtime 224-240 MiB, its cuDNN 0-4 MiB; on the paper's GPUs, what their
  convolution jobs needed beyond their simulated high end. An estimate's range carries it.
- The documented figure (PyTorch PR 86509: "about 290 MB" of context with lazy loading) was
  1.8x low on the one GPU measured, so it is used nowhere.

Standard library only: the probe bundle (Python >= 3.9) and the cluster side both read it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from xmem_admission.contract import gpu_devices
from xmem_admission.contract.errors import UnknownGPUError

MiB = 1 << 20

# The CUDA major version assumed when the job's is unknown (a trace from an older probe, a torch
# built without CUDA): the newest one with a measured context, whose figures are the largest
# known, so an unknown job is never given less than a measured one.
NEWEST_CUDA_MAJOR = 13


class Basis(str, enum.Enum):
    """How a figure was obtained."""

    MEASURED = "measured"
    FITTED = "fitted"
    INFERRED = "inferred"


@dataclass(frozen=True)
class Figure:
    """One number of bytes, how it was obtained and from what."""

    bytes: int
    basis: Basis
    source: str
    # How far the rows the figure was measured or fitted on spread around it (``spread`` says
    # which rows): the job's figure lies in [low, high]. None: exact as far as is known.
    low: Optional[int] = None
    high: Optional[int] = None
    spread: str = ""

    @property
    def low_bytes(self) -> int:
        return self.bytes if self.low is None else min(self.low, self.bytes)

    @property
    def high_bytes(self) -> int:
        return self.bytes if self.high is None else max(self.high, self.bytes)

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"bytes": self.bytes, "basis": self.basis.value,
                               "source": self.source}
        if self.low_bytes != self.bytes or self.high_bytes != self.bytes:
            out.update(low_bytes=self.low_bytes, high_bytes=self.high_bytes, spread=self.spread)
        return out


@dataclass(frozen=True)
class Overhead:
    """The memory outside the allocator for one GPU, one CUDA major and one kind of job."""

    gpu: str
    cuda_major: int
    cuda_major_known: bool  # False: the job's CUDA was not known and NEWEST_CUDA_MAJOR assumed
    uses_cudnn: bool
    context: Figure
    runtime: Figure
    cudnn: Figure  # counted in total_bytes only when uses_cudnn

    @property
    def runtime_bytes(self) -> int:
        """What the step adds after the context: the runtime figure, plus cuDNN's if used."""
        return self.runtime.bytes + (self.cudnn.bytes if self.uses_cudnn else 0)

    @property
    def total_bytes(self) -> int:
        return self.context.bytes + self.runtime_bytes

    def _parts(self) -> List[Figure]:
        return [self.context, self.runtime] + ([self.cudnn] if self.uses_cudnn else [])

    @property
    def low_bytes(self) -> int:
        """The low end of the figures' spreads, summed (``total_bytes`` lies in the range)."""
        return sum(f.low_bytes for f in self._parts())

    @property
    def high_bytes(self) -> int:
        return sum(f.high_bytes for f in self._parts())

    def to_dict(self) -> Dict[str, Any]:
        return {"gpu": self.gpu, "cuda_major": self.cuda_major,
                "cuda_major_known": self.cuda_major_known, "uses_cudnn": self.uses_cudnn,
                "total_bytes": self.total_bytes, "low_bytes": self.low_bytes,
                "high_bytes": self.high_bytes, "context": self.context.to_dict(),
                "runtime": self.runtime.to_dict(), "cudnn": self.cudnn.to_dict()}


# --- Measured and fitted figures -----------------------------------------------------------------

_H200_RUN = ("bench/data/H200/measurements.jsonl (H200, driver 580.159.04, torch 2.11.0+cu130, "
             "cuDNN 9.19, 2026-12-04)")
_H200_FIT = "bench/fits/fit_overhead.py --h200, leave-one-out"

# (GPU key, CUDA major) -> figure. Keys are the catalogue's (contract.gpus).
_CONTEXT: Dict[Tuple[str, int], Figure] = {
    ("H200", 13): Figure(552_402_944, Basis.MEASURED,
                         f"context_bytes of all 17 jobs of {_H200_RUN}: NVML used after "
                         "torch.cuda.synchronize() created the context minus before"),
}

_RUNTIME: Dict[Tuple[str, int], Figure] = {
    # The largest of NVML peak - max_memory_reserved - context over the 8 completed jobs
    # without convolutions (GPT/Llama fp32: 224 MiB; bf16 autocast: 240 MiB).
    ("H200", 13): Figure(240 * MiB, Basis.FITTED,
                         f"largest of NVML peak - reserved peak - context over the jobs without "
                         f"convolutions of {_H200_RUN} (fp32 224 MiB, bf16 240 MiB); "
                         f"{_H200_FIT}",
                         low=224 * MiB, spread="the 8 jobs without convolutions: 224-240 MiB"),
}


def _paper(mib: int, rows: int) -> Figure:
    return Figure(mib * MiB, Basis.FITTED,
                  f"{mib} MiB fitted from {rows} rows of the xMem paper's measured runs (torch 2.6,"
                  " CUDA 12.4; 85th percentile of NVML peak after CUDA init minus simulated peak"
                  " reserved; bench/fits/fit_overhead.py), convolution jobs included")


# The xMem paper's runs (bench/fits/README.md, "The fitted runtime overhead").
_RUNTIME.update({
    ("RTX-3060", 12): _paper(92, 54),
    ("RTX-4060", 12): _paper(84, 18),
    ("A100-40GB", 12): _paper(92, 9),
})

_CUDNN: Dict[Tuple[str, int], Figure] = {
    # Largest excess of the 6 convolution jobs (240-244 MiB after the context) over the runtime
    # figure above.
    ("H200", 13): Figure(4 * MiB, Basis.FITTED,
                         f"largest of NVML peak - reserved peak - context over the convolution "
                         f"jobs of {_H200_RUN} (240-244 MiB) minus the runtime figure; "
                         f"{_H200_FIT}",
                         low=0, spread="the 6 convolution jobs: 240-244 MiB, 0-4 MiB over the "
                         "runtime figure"),
}
# Where the runtime figure was fitted on rows that include convolution jobs, cuDNN is inside it.
# Its spread is what those convolution jobs needed beyond their simulated high end (the
# largest plan workspaces cuDNN ranks): NVML's peak after CUDA init minus that end's simulated
# reserved peak, minus the runtime figure, at its largest over the rows
# (``bench/fits/fit_overhead.py`` on ``xmem bench paper`` output). It holds cuDNN's modules and
# what the deviceless ranking cannot see of the plans the runs' cuDNN 9.1 picked.
_PAPER_CONV_SPREAD = {
    ("RTX-3060", 12): (472, "25 convolution jobs: up to 564 MiB over their high end's reserved "
                            "peak (MnasNet SGD b323), 472 MiB over the runtime figure"),
    ("RTX-4060", 12): (52, "10 convolution jobs: up to 136 MiB over their high end's reserved "
                           "peak (RegNetY-400MF Adam b698), 52 MiB over the runtime figure"),
}
for _key in (("RTX-3060", 12), ("RTX-4060", 12), ("A100-40GB", 12)):
    _over, _rows = _PAPER_CONV_SPREAD.get(_key) or max(_PAPER_CONV_SPREAD.values())
    if _key not in _PAPER_CONV_SPREAD:  # the paper ran no convolution job on it: the largest
        _rows = "no convolution job measured on it; the largest of the others': " + _rows
    _CUDNN[_key] = Figure(0, Basis.FITTED, "inside the runtime figure: " + _RUNTIME[_key].source,
                          low=0, high=_over * MiB, spread=_rows)


def _figure(table: Dict[Tuple[str, int], Figure], what: str, gpu: str, major: int) -> Figure:
    """The table's figure for (gpu, major), else one inferred: the largest of the figures for
    the same CUDA major on any GPU and for the same GPU under any CUDA major (the largest overall
    when there are none), since a request below what the job takes fails it."""
    found = table.get((gpu, major))
    if found is not None:
        return found
    pool = [(k, f) for k, f in table.items() if k[1] == major or k[0] == gpu] or \
        list(table.items())
    # the largest figure, then the widest spread above it (the paper GPUs' cuDNN figures are
    # all 0, inside their runtime figure: their spreads differ)
    (other, other_major), figure = max(pool, key=lambda item: (item[1].bytes,
                                                               item[1].high_bytes, item[0]))
    return Figure(figure.bytes, Basis.INFERRED,
                  f"no {what} figure for {gpu} with CUDA {major}: the largest related one, "
                  f"{other} with CUDA {other_major} ({figure.basis.value}: {figure.source})",
                  low=figure.low, high=figure.high,
                  spread=f"{other}'s with CUDA {other_major}: {figure.spread}"
                  if figure.spread else "")


# The per-thread stack the driver backs with local memory for every thread a GPU can hold
# resident: cudaLimitStackSize, 1 KiB unless the program raises it (CUDA Runtime API,
# cudaDeviceSetLimit; "the size of thread local memory is controlled automatically by the CUDA
# driver", forums.developer.nvidia.com/t/whats-the-difference-between-cuda-stack-and-local-memory
# /305003). torch does not raise it.
STACK_BYTES_PER_THREAD = 1024


def local_memory_bytes(gpu: str) -> int:
    """What the context reserves for thread stacks on ``gpu`` (a catalogue key): SMs x resident
    threads per SM (``gpu_devices.ARCHITECTURES``, the CUDA programming guide's table) x the
    default stack. The SM count and compute capability are the model's datasheet figures
    (``gpu_devices.PRODUCTS``), which tests/gpus/test_device_descriptions.py holds equal to the
    catalogue's for every model."""
    entry = gpu_devices.PRODUCTS.get(gpu)
    if entry is None:
        raise UnknownGPUError(f"unknown GPU {gpu!r}: no SM count for it in "
                              f"contract/gpu_devices.py; known GPUs: "
                              f"{', '.join(gpu_devices.PRODUCTS)}")
    limits = gpu_devices.ARCHITECTURES.get(entry.compute_capability)
    threads = limits.max_threads_per_sm if limits is not None else max(
        a.max_threads_per_sm for a in gpu_devices.ARCHITECTURES.values())
    return entry.multi_processor_count * threads * STACK_BYTES_PER_THREAD


def _context(gpu: str, major: int) -> Figure:
    """The context: measured where it was; else inferred from the measured one closest in CUDA
    (the same major, else the largest): its part that does not depend on the GPU's size (the
    measured figure less the local memory its GPU reserves for thread stacks) plus this GPU's
    local memory. The stack reservation is the part of a context that grows with the GPU: an
    H200's 132 SMs x 2048 threads x 1 KiB is 264 MiB of its 527."""
    found = _CONTEXT.get((gpu, major))
    if found is not None:
        return found
    pool = [(k, f) for k, f in _CONTEXT.items() if k[1] == major] or list(_CONTEXT.items())
    (other, other_major), figure = max(pool, key=lambda item: (item[1].bytes, item[0]))
    fixed = figure.bytes - local_memory_bytes(other)
    mine = local_memory_bytes(gpu)
    return Figure(fixed + mine, Basis.INFERRED,
                  f"no context measured for {gpu} with CUDA {major}: {other}'s with CUDA "
                  f"{other_major} ({figure.bytes / MiB:.0f} MiB, {figure.basis.value}) less its "
                  f"thread-stack local memory ({local_memory_bytes(other) / MiB:.0f} MiB) plus "
                  f"{gpu}'s ({mine / MiB:.0f} MiB: SMs x resident threads per SM x "
                  f"{STACK_BYTES_PER_THREAD} B); {figure.source}")


def for_gpu(gpu: str, cuda_major: Optional[int] = None, uses_cudnn: bool = True) -> Overhead:
    """The memory outside the allocator of a job on ``gpu`` (a catalogue key) whose torch was
    built for CUDA ``cuda_major`` (None: unknown, ``NEWEST_CUDA_MAJOR`` assumed) and that does or
    does not call cuDNN."""
    major = NEWEST_CUDA_MAJOR if cuda_major is None else int(cuda_major)
    assert major > 0, f"CUDA major version must be positive, got {major}"
    return Overhead(gpu=gpu, cuda_major=major, cuda_major_known=cuda_major is not None,
                    uses_cudnn=uses_cudnn,
                    context=_context(gpu, major),
                    runtime=_figure(_RUNTIME, "runtime", gpu, major),
                    cudnn=_figure(_CUDNN, "cuDNN", gpu, major))


def cuda_majors(gpu: str) -> List[int]:
    """The CUDA majors with a measured or fitted figure for ``gpu`` (for display), newest first,
    and always the assumed default."""
    found = {m for table in (_CONTEXT, _RUNTIME, _CUDNN) for (k, m) in table if k == gpu}
    return sorted(found | {NEWEST_CUDA_MAJOR}, reverse=True)


_LOCAL_CUDA = re.compile(r"\+cu(\d+)$")


def cuda_major_of(cuda: Optional[str] = None, torch_version: Optional[str] = None
                  ) -> Optional[int]:
    """The CUDA major version a torch was built for: from ``torch.version.cuda`` ("13.0"), else
    from the wheel's local version ("2.11.0+cu130" -> 13, "2.2.2+cu121" -> 12); None when
    neither says (a CPU build, an older trace)."""
    if cuda:
        head = str(cuda).split(".", 1)[0]
        if head.isdigit() and int(head) > 0:
            return int(head)
    if torch_version:
        match = _LOCAL_CUDA.search(str(torch_version).strip())
        if match and len(match.group(1)) >= 3:
            return int(match.group(1)[:-1])
    return None
