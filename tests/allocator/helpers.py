"""Shared helpers for the allocator tests: sizes, a fresh allocator, and a snapshot recorder.

The recorder runs the simulator the way PyTorch's ``_record_memory_history`` observes the real
allocator (segment_alloc before the alloc it serves, free_requested then free_completed,
segment_free for every release, oom with the device's free bytes) and dumps a snapshot in
PyTorch's format, so replays can be tested on histories that contain releases, retries and
out-of-memory errors, which the three real snapshots do not.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from xmem_admission.contract.errors import SimulatedOutOfMemory
from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig, parse_alloc_conf
from xmem_admission.estimator.allocator.blocks import Block
from xmem_admission.estimator.allocator.caching import CachingAllocator

KiB = 1024
MiB = 1024 * 1024
GiB = 1024 * MiB

SNAPSHOT_DIR = os.path.join(os.path.dirname(__file__), "..", "data", "snapshots")


def make(conf: str = "", **kwargs: Any) -> CachingAllocator:
    """A fresh simulated allocator configured by a PYTORCH_CUDA_ALLOC_CONF string."""
    return CachingAllocator(parse_alloc_conf(conf), **kwargs)


class Recorder:
    """Drives a CachingAllocator and records what PyTorch's memory history would."""

    def __init__(self, config: AllocatorConfig, capacity_bytes: Optional[int] = None):
        self.alloc = CachingAllocator(config, capacity_bytes=capacity_bytes)
        self.config = config
        self.events: List[Dict[str, Any]] = []
        self.alloc.on_segment_alloc = lambda a, s, st: self._event("segment_alloc", a, s, st)
        self.alloc.on_segment_free = lambda a, s, st: self._event("segment_free", a, s, st)

    def _event(self, action: str, addr: int, size: int, stream: int) -> None:
        # PyTorch's _memorySnapshot names the address field "device_free" for oom entries.
        where = "device_free" if action == "oom" else "addr"
        self.events.append({"action": action, where: addr, "size": size, "stream": stream,
                            "time_us": len(self.events), "frames": []})

    def malloc(self, size: int, stream: int = 0) -> Optional[Block]:
        try:
            block = self.alloc.malloc(size, stream)
        except SimulatedOutOfMemory:
            free = (self.alloc.capacity_bytes or 0) - self.alloc.reserved_bytes
            self._event("oom", free, self.alloc.round_size(size), stream)
            return None
        self._event("alloc", block.addr, size, stream)
        return block

    def free(self, block: Block) -> None:
        self._event("free_requested", block.addr, block.requested, block.pool.stream)
        self._event("free_completed", block.addr, block.requested, block.pool.stream)
        self.alloc.free(block)

    def empty_cache(self) -> None:
        self.alloc.empty_cache()

    def snapshot(self, keep_last: Optional[int] = None) -> Dict[str, Any]:
        """The snapshot PyTorch would dump now; ``keep_last`` models a short ring buffer."""
        segments = []
        for seg in self.alloc.segments():
            blocks = [{"address": b["address"], "size": b["size"],
                       "requested_size": b["requested_size"], "state": b["state"],
                       "frames": []} for b in seg["blocks"]]
            segments.append({"device": 0, "address": seg["address"],
                             "total_size": seg["total_size"], "stream": seg["stream"],
                             "segment_type": seg["segment_type"], "is_expandable": False,
                             "blocks": blocks})
        events = self.events if keep_last is None else self.events[-keep_last:]
        mss = self.config.max_split_size
        return {  # the keys and values torch/csrc/cuda/Module.cpp _memorySnapshot writes
            "segments": segments,
            "device_traces": [list(events)],
            "allocator_settings": {
                "PYTORCH_CUDA_ALLOC_CONF": self.config.source,
                "max_split_size": mss if self.config.max_split_size_limited else -1,
                "garbage_collection_threshold": self.config.garbage_collection_threshold,
                "expandable_segments": self.config.expandable_segments,
                "pinned_num_register_threads": 1,
                "release_lock_on_cudamalloc": False,
                "pinned_use_cuda_host_register": False,
                "roundup_power2_divisions": {
                    str(1 << i): d for i, d in enumerate(self.config.roundup_power2_divisions)},
            },
        }
