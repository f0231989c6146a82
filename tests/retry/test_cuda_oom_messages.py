"""A CUDA out-of-memory failure is recognised from the text a container left, and nothing else is.

Message texts are written as their sources print them; where a text is a user's report, the
report is named. Sizes are read as bounds: a demand as the most its two-decimal figure can mean,
a supply as the least.
"""

from __future__ import annotations

from typing import Optional

import pytest

from xmem_admission.contract import oom

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def most(value: float, unit: int) -> int:
    """The largest byte count format_size prints as ``value`` (two decimals)."""
    return int((round(value * 100) * 2 + 1) * unit // 200)


def least(value: float, unit: int) -> int:
    return -(-((round(value * 100) * 2 - 1) * unit) // 200)


# torch 2.2 (torch.cuda.OutOfMemoryError; no private-pool clause): pytorch/pytorch issue 16417,
# comment of 2024-03-13.
TORCH_2_2 = (
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has a "
    "total capacity of 23.65 GiB of which 11.06 MiB is free. Including non-PyTorch memory, this "
    "process has 23.60 GiB memory in use. Of the allocated memory 22.90 GiB is allocated by "
    "PyTorch, and 194.87 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# torch 2.4 and later (torch.OutOfMemoryError): Junyi42/monst3r issue 51 (2024-12).
TORCH_2_4 = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.90 GiB. GPU 0 has a total "
    "capacity of 47.54 GiB of which 588.19 MiB is free. Including non-PyTorch memory, this "
    "process has 46.94 GiB memory in use. Of the allocated memory 43.08 GiB is allocated by "
    "PyTorch, and 2.30 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# torch 2.14/2.15 in a container: NVML lists the job's own process by its host pid, a CUDA
# graph pool holds memory (the message as DeviceCachingAllocator::malloc composes it at
# pytorch main, with 2.14.1's advice and URL).
TORCH_2_14_CONTAINER = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total "
    "capacity of 79.18 GiB of which 301.69 MiB is free. Process 2214506 has 78.87 GiB memory in "
    "use. Of the allocated memory 75.02 GiB is allocated by PyTorch, with 1.50 GiB allocated in "
    "private pools (e.g., CUDA Graphs), and 2.11 GiB is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
    "for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html"
    "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
)
# torch 2.9.1, sizes in bytes (a vLLM test corpus that captured it verbatim).
TORCH_BYTES = (
    "CUDA out of memory. Tried to allocate 37252.90 GiB. GPU 0 has a total capacity of 178.35 GiB"
    " of which 177.06 GiB is free. Process 597697 has 692.00 MiB memory in use. Including "
    "non-PyTorch memory, this process has 612.00 MiB memory in use. Of the allocated memory 0 "
    "bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
    "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# torch 2.1, "capacty": carolchenyx/MGFN issue 35 (2023-11).
TORCH_2_1 = (
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.70 GiB. GPU 0 has a "
    "total capacty of 6.00 GiB of which 0 bytes is free. Of the allocated memory 2.93 GiB is "
    "allocated by PyTorch, and 2.30 GiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  See "
    "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
# torch 2.0 and earlier, with a memory fraction: pytorch/pytorch issue 111729.
TORCH_LEGACY = (
    "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB (GPU 3; 11.93 GiB total "
    "capacity; 10.67 GiB already allocated; 515.38 MiB free; 11.93 GiB allowed; 10.92 GiB "
    "reserved in total by PyTorch) If reserved memory is >> allocated memory try setting "
    "max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and "
    "PYTORCH_CUDA_ALLOC_CONF"
)
# HAMi-core's oom_check (src/allocator/allocator.c:52 at 8f3a89c6), a 10 GiB limit.
HAMI_LINE = ("[HAMI-core ERROR (pid:1 thread=140121313527616 allocator.c:52)]: Device 0 OOM "
             "10758389760 / 10737418240")
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/workspace/train.py", line 88, in <module>\n'
    "    loss = model(batch).sum()\n"
    '  File "/usr/local/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1751, in '
    "_wrapped_call_impl\n"
    "    return self._call_impl(*args, **kwargs)\n"
)
CUDA_ERROR = (
    "RuntimeError: CUDA error: out of memory\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


def kubelet_tail(log: str) -> str:
    """What FallbackToLogsOnError keeps: the last 80 lines, then the last 2048 bytes of them."""
    lines = log.splitlines(keepends=True)[-80:]
    return "".join(lines).encode()[-2048:].decode(errors="replace")


@pytest.mark.parametrize("text, source, exception, asked, capacity, free, in_use, allocated, "
                         "reserved", [
    (TORCH_2_2, oom.PYTORCH, "torch.cuda.OutOfMemoryError", most(22, MiB), least(23.65, GiB),
     least(11.06, MiB), most(23.60, GiB), most(22.90, GiB), most(22.90, GiB) + most(194.87, MiB)),
    (TORCH_2_4, oom.PYTORCH, "torch.OutOfMemoryError", most(1.90, GiB), least(47.54, GiB),
     least(588.19, MiB), most(46.94, GiB), most(43.08, GiB), most(43.08, GiB) + most(2.30, GiB)),
    (TORCH_2_14_CONTAINER, oom.PYTORCH, "torch.OutOfMemoryError", most(512, MiB),
     least(79.18, GiB), least(301.69, MiB), None, most(75.02, GiB),
     most(75.02, GiB) + most(2.11, GiB)),
    (TORCH_BYTES, oom.PYTORCH, None, most(37252.90, GiB), least(178.35, GiB), least(177.06, GiB),
     most(612, MiB), 0, 0),
    (TORCH_2_1, oom.PYTORCH, "torch.cuda.OutOfMemoryError", most(1.70, GiB), least(6, GiB), 0,
     None, most(2.93, GiB), most(2.93, GiB) + most(2.30, GiB)),
    (TORCH_LEGACY, oom.PYTORCH_LEGACY, "OutOfMemoryError", most(4, GiB), least(11.93, GiB),
     least(515.38, MiB), None, most(10.67, GiB), most(10.92, GiB)),
])
def test_pytorchs_message_is_read_field_by_field_in_every_release_form(
        text: str, source: str, exception: Optional[str], asked: int, capacity: int, free: int,
        in_use: Optional[int], allocated: int, reserved: int) -> None:
    found = oom.read(TRACEBACK + text + "\n")
    assert found is not None
    assert (found.source, found.exception) == (source, exception)
    assert found.asked_bytes == asked
    assert found.capacity_bytes == capacity
    assert found.free_bytes == free
    assert found.in_use_bytes == in_use
    assert found.allocated_bytes == allocated
    assert found.reserved_bytes == reserved
    assert found.confirmed and not found.truncated


def test_other_processes_private_pools_and_a_memory_fraction_are_kept() -> None:
    container = oom.read(TORCH_2_14_CONTAINER)
    assert container is not None
    assert container.other_processes == ((2214506, most(78.87, GiB)),)
    assert container.private_pool_bytes == most(1.50, GiB)
    assert container.device == 0
    both = oom.read(TORCH_BYTES)
    assert both is not None and both.other_processes == ((597697, most(692, MiB)),)
    legacy = oom.read(TORCH_LEGACY)
    assert legacy is not None and legacy.device == 3
    assert legacy.allowed_bytes == least(11.93, GiB)
    fraction = oom.read(TORCH_2_4.replace("of which 588.19 MiB is free. ",
                                          "of which 588.19 MiB is free. 40.00 GiB allowed; "))
    assert fraction is not None and fraction.allowed_bytes == least(40, GiB)


def test_sizes_in_kib_and_bytes_are_read_with_their_rounding() -> None:
    text = TORCH_2_4.replace("1.90 GiB. GPU", "512.00 KiB. GPU").replace(
        "and 2.30 GiB is reserved", "and 1000 bytes is reserved")
    found = oom.read(text)
    assert found is not None
    assert found.asked_bytes == 512 * KiB + KiB // 200  # 512.00 KiB: at most 512.005 KiB
    assert found.reserved_bytes == most(43.08, GiB) + 1000  # bytes are exact


def test_the_last_report_counts_when_a_log_holds_two() -> None:
    first = TORCH_2_4.replace("1.90 GiB. GPU", "8.00 GiB. GPU")
    found = oom.read(first + "\nretrying with a smaller batch\n" + TRACEBACK + TORCH_2_4)
    assert found is not None and found.asked_bytes == most(1.90, GiB)


def test_a_kubelet_tail_keeps_the_message_at_the_end_of_a_long_log() -> None:
    log = "".join(f"step {i} loss 2.{i:04d}\n" for i in range(500)) + TRACEBACK + TORCH_2_4 + "\n"
    tail = kubelet_tail(log)
    assert len(tail.encode()) <= 2048 and not tail.startswith("step 0 ")
    found = oom.read(tail)
    assert found is not None and found.reserved_bytes == most(43.08, GiB) + most(2.30, GiB)
    assert not found.truncated


@pytest.mark.parametrize("cut_before", ["y. Tried", "GPU 0 has", "of which", "ding non-PyTorch",
                                        "ocated memory 43.08", "rved by PyTorch but"])
def test_a_message_whose_beginning_was_cut_off_is_still_recognised(cut_before: str) -> None:
    text = TORCH_2_4[TORCH_2_4.index(cut_before):]
    found = oom.read("\ufffd" + text)  # a cut UTF-8 sequence, as the kubelet's tail may leave
    assert found is not None and found.source == oom.PYTORCH and found.truncated
    assert (found.asked_bytes is None) == ("Tried to allocate" not in text)
    assert (found.capacity_bytes is None) == ("has a total capacity" not in text)
    assert (found.in_use_bytes is None) == ("this process has" not in text)
    if "Of the allocated memory" in text:
        assert found.allocated_bytes == most(43.08, GiB)


def test_a_4_kib_termination_message_that_cut_the_head_still_counts() -> None:
    message = ("x" * 5000 + "\n" + TRACEBACK + TORCH_2_2).encode()[-4096:].decode()
    found = oom.read(message)
    assert found is not None and found.exception == "torch.cuda.OutOfMemoryError"
    assert found.need_bytes() == most(23.60, GiB) + most(22, MiB)


def test_a_report_cut_after_the_gpu_number_still_says_what_was_asked() -> None:
    # pytorch/pytorch issue 126766 (torch 2.3.0): the message ends after "GPU".
    found = oom.read("OutOfMemoryError: CUDA out of memory. Tried to allocate 3725.29 GiB. GPU")
    assert found is not None and found.asked_bytes == most(3725.29, GiB)
    assert found.capacity_bytes is None and found.need_bytes() is None


def test_hami_cores_refusal_adds_the_limit_to_pytorchs_report() -> None:
    under_hami = TORCH_2_4.replace("47.54 GiB of which 588.19 MiB", "10.00 GiB of which 0 bytes")
    found = oom.read(HAMI_LINE + "\n" + HAMI_LINE + "\n" + TRACEBACK + under_hami)
    assert found is not None and found.source == oom.PYTORCH and found.confirmed
    assert (found.hami_requested_bytes, found.hami_limit_bytes) == (10758389760, 10737418240)
    assert found.capacity_bytes == least(10, GiB)


def test_a_hami_line_alone_is_recognised_but_not_confirmed() -> None:
    found = oom.read("epoch 3\n" + HAMI_LINE + "\nKilled by signal\n")
    assert found is not None and found.source == oom.HAMI and not found.confirmed
    assert found.device == 0 and found.need_bytes() == 10758389760
    old = oom.read("[4pdvGPU ERROR (pid:77 thread=1 allocator.c:49)]: Device 1 OOM 20 / 10")
    assert old is not None and old.device == 1 and not old.truncated
    cut = oom.read("ocator.c:52)]: Device 0 OOM 10758389760 / 10737418240\n")
    assert cut is not None and cut.truncated


def test_a_cuda_error_out_of_memory_is_an_oom_without_figures() -> None:
    found = oom.read(TRACEBACK + CUDA_ERROR)
    assert found is not None and found.source == oom.CUDA_ERROR
    assert found.exception == "RuntimeError" and found.need_bytes() is None
    newer = oom.read("torch.AcceleratorError: CUDA error: out of memory\n")
    assert newer is not None and newer.exception == "torch.AcceleratorError"
    cublas = oom.read("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                      "`cublasCreate(handle)`")
    assert cublas is not None and cublas.source == oom.CUDA_ERROR


def test_a_preemptive_fraction_rejection_says_what_was_requested() -> None:
    found = oom.read("torch.OutOfMemoryError: CUDA out of memory. Allocation was preemptively "
                     "rejected because it would exceed per_process_memory_fraction limit. "
                     "Requested size: 2.00 GiB")
    assert found is not None and found.source == oom.PYTORCH_FRACTION
    assert found.asked_bytes == most(2, GiB)


@pytest.mark.parametrize("text", [
    None,
    "",
    "Killed\n",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough "
    "memory: you tried to allocate 8589934592 bytes.",
    "MemoryError: Unable to allocate 8.00 GiB for an array with shape (1073741824,)",
    "HIP out of memory. Tried to allocate 512.00 MiB",
    "RuntimeError: CUDA error: an illegal memory access was encountered\n",
    "ValueError: batch size 0\n",
    "[HAMI-core Warn(1:140121313527616:libvgpu.c:80)]: init found device 0 with limit 10240 MiB\n",
])
def test_texts_without_a_cuda_oom_are_not_one(text: Optional[str]) -> None:
    assert oom.read(text) is None


def test_a_container_the_host_oom_killer_ended_is_never_a_gpu_oom() -> None:
    assert oom.read(TRACEBACK + TORCH_2_4, reason="OOMKilled") is None
    assert oom.read(TRACEBACK + TORCH_2_4, reason="Error") is not None


def test_virtual_address_exhaustion_is_not_a_gpu_oom() -> None:
    text = ("[ExpandableSegmentVA] Failed to reserve 160.00 GiB of virtual address space ... This "
            "is virtual-address-space (VSZ) exhaustion from expandable segments, not physical GPU "
            "OOM. Reduce it via PYTORCH_CUDA_ALLOC_CONF expandable_segments_reserve\n" + TORCH_2_4)
    assert oom.read(text) is None


def test_need_is_the_largest_evidence_and_counts_memory_outside_the_allocator() -> None:
    found = oom.read(TORCH_2_1)  # no process line: reserved + asked + the overhead given
    assert found is not None
    reserved = most(2.93, GiB) + most(2.30, GiB)
    assert found.need_bytes() == reserved + most(1.70, GiB)
    assert found.need_bytes(overhead_bytes=290 * MiB) == reserved + most(1.70, GiB) + 290 * MiB
    in_use = oom.read(TORCH_2_4)
    assert in_use is not None  # in use (46.94) + asked beats reserved (45.38) + asked
    assert in_use.need_bytes() == most(46.94, GiB) + most(1.90, GiB)
