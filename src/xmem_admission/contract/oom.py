"""Recognising a CUDA out-of-memory failure from what a container left behind.

PyTorch writes no termination message, so the controller reads the kubelet's copy of the
container's last output (``terminationMessagePolicy: FallbackToLogsOnError``: the last 80 lines,
at most 2048 bytes, the end kept; kubernetes ``pkg/kubelet/container/runtime.go``
``MaxContainerTerminationMessageLogLines`` / ``MaxContainerTerminationMessageLogLength``), or a
termination message (at most 4096 bytes, ``termination.LIMIT_BYTES``). Either can begin in the
middle of a line. ``read`` finds in that text the last CUDA out-of-memory report and returns
what it says, or None when there is none. It never looks at an exit code, and a container the
kubelet reports ``OOMKilled`` (the host memory cgroup's killer) is never a GPU OOM.

Recognised texts, each with where its wording comes from:

1. PyTorch's caching allocator, torch 2.2 to 2.15 (``c10/cuda/CUDACachingAllocator.cpp``,
   ``DeviceCachingAllocator::malloc``, read at pytorch/pytorch main as stored in 2026, and the
   same fragments checked in the ``libc10_cuda.so`` of torch 2.2.2, 2.4.1, 2.14.1 and 2.15.0)::

       CUDA out of memory. Tried to allocate <S>. GPU <n> has a total capacity of <S> of which
       <S> is free. [Process <pid> has <S> memory in use. ...][Including non-PyTorch memory, this
       process has <S> memory in use. ][<S> allowed; ]Of the allocated memory <S> is allocated by
       PyTorch, [with <S> allocated in private pools (e.g., CUDA Graphs), ]and <S> is reserved by
       PyTorch but unallocated. <advice that changed between releases>

   The process lines come from NVML (``reportProcessMemoryInfo``): one line per process on the
   device, "this process" only when NVML's pid is the caller's, so in a container (its own pid
   namespace) the job's own process usually appears as ``Process <host pid>``; 2.14 and later
   omit the lines when NVML fails. The private-pool clause is new in 2.4 (absent from 2.2.2's
   library). ``<S>`` is ``format_size``: ``<n> bytes`` up to 1024 bytes, else two decimals of
   KiB, MiB or GiB (c10 ``format_size``, ``os.precision(2)``).
2. The same message in torch 2.1, which spelled "total capacty" (a torch 2.1-era report,
   carolchenyx/MGFN issue 35, 2023-11; 2.2.2's library spells "capacity"), and the form of torch 2.0 and earlier (pytorch
   PR 13751, then the "reserved in total by PyTorch" wording)::

       CUDA out of memory. Tried to allocate <S> (GPU <n>; <S> total capacity; <S> already
       allocated; <S> free; [<S> allowed; ]<S> reserved in total by PyTorch)

   Both are older than the supported range (``torch_version``) but cost nothing to read.
3. torch 2.14 and later with ``per_process_memory_fraction`` and ``throw_on_cudamalloc_oom``
   (pytorch PR 179473, 2026-04): ``CUDA out of memory. Allocation was preemptively rejected
   because it would exceed per_process_memory_fraction limit. Requested size: <S>`` (the
   sentence as in 2.14.1's and 2.15.0's ``libc10_cuda.so``; the size is read as ``<S>`` or a
   plain byte count).
4. A CUDA call that failed with cudaErrorMemoryAllocation outside the caching allocator
   (``C10_CUDA_CHECK``: ``CUDA error: out of memory``, c10/cuda/CUDAException.cpp, the text
   ``cudaGetErrorString`` gives), and cuBLAS failing to allocate its handle's memory
   (``CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)```,
   aten/src/ATen/cuda/Exceptions.h; both strings in torch 2.2.2's libraries): no figures.
5. HAMi-core's refusal, written to stderr by ``oom_check`` in ``src/allocator/allocator.c``
   (Project-HAMi/HAMi-core at 8f3a89c67b037d8fdfe6c4cd4d8c4f0cd6504811, 2026-06-30, line 52;
   the same format string since the first commit 8b7cd78)::

       [HAMI-core ERROR (pid:<pid> thread=<tid> allocator.c:<line>)]: Device <d> OOM <new> / <limit>

   ``LOG_ERROR`` (``src/include/log_utils.h``; ``[4pdvGPU ERROR ...`` before commit d88e4d4,
   2024-02) prints it at every log level. ``<new>`` is the container's usage plus the refused
   allocation and ``<limit>`` the limit, in bytes. HAMi-core also answers ``cuMemGetInfo`` with the
   limit as the total (``src/cuda/memory.c``, ``cuMemGetInfo_v2``), so PyTorch's "total capacity"
   under HAMi is the request, not the card. A HAMi line alone is weaker evidence: HAMi logs
   before it retries after clearing dead processes' slots, and PyTorch retries a refused
   ``cudaMalloc`` after freeing its cache, so the job may have survived that line; ``confirmed``
   says whether PyTorch (or CUDA) also reported the failure.

The exception that carried the message is read when its name survives:
``torch.cuda.OutOfMemoryError`` (torch 2.2's libtorch_python.so), ``torch.OutOfMemoryError``
(2.4 and later), ``RuntimeError`` or ``torch.AcceleratorError`` (2.14 and later) for the
``CUDA error:`` form.

Sizes are bounds, not the printed figure: a demand (asked, in use, allocated, reserved) is read
as the most the two-decimal figure can stand for, a supply (capacity, free) as the least, so
evidence built from them errs towards a larger request. Standard library only, Python 3.9.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

# c10 format_size: bytes up to 1024, then KiB up to 1 MiB, MiB up to 1 GiB, GiB beyond.
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_SIZE = r"(\d+(?:\.\d+)?) (bytes|KiB|MiB|GiB)"

OOM_KILLED = "OOMKilled"  # the kubelet's reason for a container the kernel's OOM killer ended

PYTORCH = "pytorch"  # the caching allocator's message, torch 2.1 and later
PYTORCH_LEGACY = "pytorch-legacy"  # torch 2.0 and earlier
PYTORCH_FRACTION = "pytorch-fraction"  # preemptive per_process_memory_fraction rejection
CUDA_ERROR = "cuda-error"  # CUDA error: out of memory / CUBLAS_STATUS_ALLOC_FAILED
HAMI = "hami-core"  # HAMi-core's oom_check line only


def _upper(value: str, unit: str) -> int:
    """The most bytes a format_size figure can stand for (half a unit of its last digit more)."""
    scale = _UNITS[unit]
    if scale == 1:
        return int(value)
    hundredths = round(float(value) * 100)
    return ((2 * hundredths + 1) * scale) // 200


def _lower(value: str, unit: str) -> int:
    """The fewest bytes a format_size figure can stand for."""
    scale = _UNITS[unit]
    if scale == 1:
        return int(value)
    hundredths = round(float(value) * 100)
    return max(0, -((-(2 * hundredths - 1) * scale) // 200))


@dataclass(frozen=True)
class CudaOOM:
    """What a CUDA out-of-memory report says; a field is None where the text does not say it."""

    source: str  # PYTORCH, PYTORCH_LEGACY, PYTORCH_FRACTION, CUDA_ERROR or HAMI
    exception: Optional[str] = None  # e.g. "torch.OutOfMemoryError", when its name survived
    device: Optional[int] = None
    asked_bytes: Optional[int] = None  # "Tried to allocate" (the allocator's rounded block)
    capacity_bytes: Optional[int] = None  # "total capacity" (under HAMi: the limit)
    free_bytes: Optional[int] = None
    allowed_bytes: Optional[int] = None  # set_per_process_memory_fraction's ceiling
    in_use_bytes: Optional[int] = None  # "this process has ... memory in use"
    other_processes: Tuple[Tuple[int, int], ...] = ()  # (pid, bytes) of "Process <pid> has"
    allocated_bytes: Optional[int] = None  # allocated by PyTorch (private pools included)
    reserved_bytes: Optional[int] = None  # allocated + reserved but unallocated
    private_pool_bytes: Optional[int] = None
    hami_requested_bytes: Optional[int] = None  # HAMi: usage + the refused allocation
    hami_limit_bytes: Optional[int] = None
    confirmed: bool = True  # False for a HAMi line with no PyTorch or CUDA report
    truncated: bool = False  # the text began inside the message: its head was cut off

    def need_bytes(self, overhead_bytes: int = 0) -> Optional[int]:
        """The least the failed process needed on the GPU, from the best evidence the text has.

        The largest of: this process's memory in use plus what it asked for (NVML's figure, all
        of the process: context included); PyTorch's reserved memory plus what it asked for,
        plus ``overhead_bytes`` (the memory a process holds outside the allocator, from the GPU
        catalogue, which the allocator's figures leave out); HAMi's usage plus the refused
        allocation. None when the text gives none of them (then only a growth factor can size a
        retry).
        """
        asked = self.asked_bytes or 0
        candidates: List[int] = []
        if self.in_use_bytes is not None:
            candidates.append(self.in_use_bytes + asked)
        if self.reserved_bytes is not None:
            candidates.append(self.reserved_bytes + asked + overhead_bytes)
        if self.hami_requested_bytes is not None:
            candidates.append(self.hami_requested_bytes)
        if not candidates:
            return None
        return max(candidates)


# --- the patterns ------------------------------------------------------------------------------

_HEAD = re.compile(r"CUDA out of memory\.")
_EXCEPTION = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception))(?:\s*:\s*)$")
_ASKED = re.compile(r"Tried to allocate " + _SIZE)
_CAPACITY = re.compile(r"GPU (\d+) has a total capac(?:ity|ty) of " + _SIZE + r" of which " + _SIZE
                       + r" is free\.")
_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use\.")
_THIS_PROCESS = re.compile(r"this process has " + _SIZE + r" memory in use\.")
_ALLOWED = re.compile(_SIZE + r" allowed; ")
_ALLOCATED = re.compile(
    r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, (?:with " + _SIZE
    + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?and " + _SIZE
    + r" is reserved by PyTorch but unallocated\."
)
# Fragments that only PyTorch's OOM message has: a tail cut before "CUDA out of memory." is
# still recognised by them.
_TAIL_MARKS = (
    re.compile(r"by PyTorch but unallocated\."),
    re.compile(r"If reserved but unallocated memory is large try setting"),  # 2.1 and later
    re.compile(r"If reserved memory is >> allocated memory try setting max_split_size_mb"),
    re.compile(r"reserved in total by PyTorch\)"),
    re.compile(r"of which " + _SIZE + r" is free\. "),
    re.compile(r"this process has " + _SIZE + r" memory in use\. Of the allocated memory"),
)
_LEGACY = re.compile(
    r"\(GPU (\d+); " + _SIZE + r" total capacity; " + _SIZE + r" already allocated; " + _SIZE
    + r" free; (?:" + _SIZE + r" allowed; )?" + _SIZE + r" reserved in total by PyTorch\)"
)
_FRACTION = re.compile(
    r"Allocation was preemptively rejected because it would exceed per_process_memory_fraction"
    r" limit\. Requested size: (?:" + _SIZE + r"|(\d+))"
)
_CUDA_ERROR = re.compile(r"CUDA error: (?:out of memory|CUBLAS_STATUS_ALLOC_FAILED)")
_HAMI = re.compile(
    r"(?:(?:\[(?:HAMI-core|4pdvGPU) ERROR \(pid:\d+ thread=-?\d+ [^()\s]*:\d+\)\]: )|^|\)\]: )"
    r"Device (\d+) OOM (\d+) / (\d+)[ \t]*$",
    re.MULTILINE,
)
# PyTorch 2.15: an expandable segment that cannot reserve virtual address space says it is "not
# physical GPU OOM" (libc10_cuda.so of torch 2.15.0): a bigger request would not help.
_VA_EXHAUSTION = re.compile(r"not physical GPU OOM")


def _exception_before(text: str, at: int) -> Optional[str]:
    line_start = text.rfind("\n", 0, at) + 1
    found = _EXCEPTION.search(text[line_start:at])
    return found.group(1) if found else None


def _pytorch(text: str) -> Optional[CudaOOM]:
    """The last PyTorch allocator report in ``text`` (whole, or with its head cut off)."""
    heads = list(_HEAD.finditer(text))
    if heads:
        start = heads[-1].start()
        truncated = False
    else:
        marks = [m.start() for mark in _TAIL_MARKS for m in mark.finditer(text)]
        if not marks:
            return None
        start = text.rfind("\n", 0, max(marks)) + 1  # the cut line holding the last fragment
        truncated = True
    body = text[start:]
    newline = body.find("\n")  # the message is one line
    if newline >= 0:
        body = body[:newline]
    fraction = _FRACTION.search(body)
    if fraction is not None:
        asked = (_upper(fraction.group(1), fraction.group(2)) if fraction.group(1)
                 else int(fraction.group(3)))
        return CudaOOM(PYTORCH_FRACTION, _exception_before(text, start), asked_bytes=asked,
                       truncated=truncated)
    asked_match = _ASKED.search(body)
    asked_bytes = _upper(*asked_match.groups()) if asked_match else None
    legacy = _LEGACY.search(body)
    if legacy is not None:
        g = legacy.groups()
        return CudaOOM(
            PYTORCH_LEGACY, _exception_before(text, start), device=int(g[0]),
            asked_bytes=asked_bytes, capacity_bytes=_lower(g[1], g[2]),
            allocated_bytes=_upper(g[3], g[4]), free_bytes=_lower(g[5], g[6]),
            allowed_bytes=_lower(g[7], g[8]) if g[7] else None,
            reserved_bytes=_upper(g[9], g[10]), truncated=truncated,
        )
    capacity = _CAPACITY.search(body)
    this_process = _THIS_PROCESS.search(body)
    allowed = _ALLOWED.search(body)
    allocated = _ALLOCATED.search(body)
    others = tuple((int(m.group(1)), _upper(m.group(2), m.group(3)))
                   for m in _PROCESS.finditer(body))
    allocated_bytes = reserved_bytes = private = None
    if allocated is not None:
        g = allocated.groups()
        allocated_bytes = _upper(g[0], g[1])
        private = _upper(g[2], g[3]) if g[2] else None
        reserved_bytes = allocated_bytes + _upper(g[4], g[5])
    return CudaOOM(
        PYTORCH, _exception_before(text, start),
        device=int(capacity.group(1)) if capacity else None,
        asked_bytes=asked_bytes,
        capacity_bytes=_lower(capacity.group(2), capacity.group(3)) if capacity else None,
        free_bytes=_lower(capacity.group(4), capacity.group(5)) if capacity else None,
        allowed_bytes=_lower(*allowed.groups()) if allowed else None,
        in_use_bytes=_upper(*this_process.groups()) if this_process else None,
        other_processes=others,
        allocated_bytes=allocated_bytes, reserved_bytes=reserved_bytes,
        private_pool_bytes=private, truncated=truncated,
    )


def read(text: Optional[str], reason: Optional[str] = None) -> Optional[CudaOOM]:
    """The CUDA out-of-memory failure ``text`` reports (a termination message or a log tail).

    ``reason`` is the kubelet's ``state.terminated.reason``: ``OOMKilled`` means the host's
    memory cgroup killed the container, which is never a GPU OOM, whatever the text says.
    None when the text holds no CUDA OOM (or only a PyTorch 2.15 virtual-address-space one).
    """
    if not text or reason == OOM_KILLED:
        return None
    if _VA_EXHAUSTION.search(text):
        return None
    hami = list(_HAMI.finditer(text))
    hami_requested = int(hami[-1].group(2)) if hami else None
    hami_limit = int(hami[-1].group(3)) if hami else None
    found = _pytorch(text)
    if found is None:
        error = list(_CUDA_ERROR.finditer(text))
        if error:
            start = error[-1].start()
            found = CudaOOM(CUDA_ERROR, _exception_before(text, start))
    if found is None:
        if not hami:
            return None
        return CudaOOM(HAMI, device=int(hami[-1].group(1)), hami_requested_bytes=hami_requested,
                       hami_limit_bytes=hami_limit, confirmed=False,
                       truncated=not hami[-1].group(0).startswith("["))
    if hami:
        found = _with_hami(found, int(hami[-1].group(1)), hami_requested, hami_limit)
    return found


def _with_hami(found: CudaOOM, device: int, requested: Optional[int],
               limit: Optional[int]) -> CudaOOM:
    return dataclasses.replace(
        found, device=found.device if found.device is not None else device,
        hami_requested_bytes=requested, hami_limit_bytes=limit,
    )


__all__ = [
    "CUDA_ERROR", "CudaOOM", "HAMI", "OOM_KILLED", "PYTORCH", "PYTORCH_FRACTION",
    "PYTORCH_LEGACY", "read",
]
