"""A training job whose step needs more GPU memory than its first pod is given (the OOM retry e2e).

Under xmem's probe (the estimation pod's virtual GPU) it trains a small model for real, so the
estimate is small. On the process node there is no GPU: the device the job runs on is the one
its pod was granted, ``GRANTED_BYTES`` (the pod's ``xmem.io/request-bytes``, through the
downward API): HAMi-core's limit under HAMi (and KAI, whose isolation uses HAMi-core); with MIG
(``ENFORCER=mig``) the whole slice the request maps to, the smallest of ``MIG_SLICE_BYTES`` that
holds it, as the device plugin hands out. The step allocates ``NEED_BYTES`` in two blocks (weights, then activations) on top of the
CUDA context. A block that does not fit fails as it does on a GPU under HAMi: HAMi-core logs its
refusal on stderr (``oom_check``, Project-HAMi/HAMi-core src/allocator/allocator.c at 8f3a89c6),
then PyTorch raises ``torch.OutOfMemoryError`` with the caching allocator's message (the text of
``DeviceCachingAllocator::malloc`` in torch 2.14's libc10_cuda.so, sizes by c10's
``format_size``), which nothing catches: Python prints the traceback to stderr and exits 1. No
termination message is written: the kubelet's FallbackToLogsOnError copies the log's tail.
A step that fits stays up ``HOLD_SECONDS`` (unset: none) before the process exits 0.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

CONTEXT_BYTES = 300 << 20  # the CUDA context's share of the device, outside the allocator


def format_size(size: int) -> str:
    """c10::format_size (c10/util/Logging or CUDACachingAllocator.cpp): two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"


def out_of_memory(asked: int, reserved: int, capacity: int) -> str:
    in_use = reserved + CONTEXT_BYTES
    return (
        f"CUDA out of memory. Tried to allocate {format_size(asked)}. GPU 0 has a total capacity "
        f"of {format_size(capacity)} of which {format_size(max(0, capacity - in_use))} is free. "
        f"Process {os.getpid()} has {format_size(in_use)} memory in use. Of the allocated memory "
        f"{format_size(reserved)} is allocated by PyTorch, and {format_size(0)} is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/"
        "cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    )


class Device:
    """The granted device: allocations past its memory fail as HAMi-core and PyTorch fail them."""

    def __init__(self, capacity: int, hami: bool) -> None:
        self.capacity = capacity
        self.hami = hami
        self.reserved = 0

    def allocate(self, size: int) -> None:
        if CONTEXT_BYTES + self.reserved + size > self.capacity:
            if self.hami:
                print(f"[HAMI-core ERROR (pid:{os.getpid()} thread={threading.get_native_id()} "
                      f"allocator.c:52)]: Device 0 OOM {CONTEXT_BYTES + self.reserved + size} / "
                      f"{self.capacity}", file=sys.stderr, flush=True)
            raise torch.OutOfMemoryError(out_of_memory(size, self.reserved, self.capacity))
        self.reserved += size


def load_weights(device: Device, size: int) -> None:
    device.allocate(size)


def forward(device: Device, size: int) -> None:
    device.allocate(size)


def train_on_the_granted_device() -> None:
    need = int(os.environ["NEED_BYTES"])
    granted = int(os.environ["GRANTED_BYTES"])
    enforcer = os.environ.get("ENFORCER", "")
    if enforcer == "mig":
        slices = sorted(int(s) for s in os.environ["MIG_SLICE_BYTES"].split(","))
        granted = next(s for s in slices if s >= granted)
    device = Device(granted, enforcer in ("HAMi", "KAI"))
    print(f"training on a device of {format_size(device.capacity)}", flush=True)
    load_weights(device, need // 2)
    forward(device, need - need // 2)
    print("trained", flush=True)
    # A run that keeps its peak for a while (the right-sizing test scrapes it meanwhile).
    time.sleep(float(os.environ.get("HOLD_SECONDS") or 0))


def train_under_the_probe() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(16, 64, device="cuda")).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    if torch.cuda.is_available():
        train_under_the_probe()
    else:
        train_on_the_granted_device()
