"""GPU blocks: each storage the job would put on the GPU, from its allocation to its free.

``Blocks`` maps storages to the GPU blocks they hold (host storages map to None), writes the
trace's ``alloc`` and ``free`` events, counts the bytes live, and gives a block its provisional
category by phase and its module (the module running, or in a backward the forward module that
made the autograd node running). It holds storages by weak reference only: when Python drops
the last reference, the weakref callback records the matching ``free`` at that exact point of
the program, which is when the CUDA caching allocator would get the block back.

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from xmem_admission.estimator.allocator.alloc_conf import ENV_META, VARIABLES
from xmem_admission.estimator.probe.autograd_nodes import AutogradNodes
from xmem_admission.estimator.probe.module_paths import ModuleTracker
from xmem_admission.estimator.probe.placement import local
from xmem_admission.estimator.trace import ALL_GATHER, ALLOC, RECOMPUTED, Alloc, Category, Trace

# Provisional categories by phase; refined when the block is freed (see ``Blocks.free``).
PHASE_CATEGORY = {
    "forward": Category.ACTIVATION.value,
    # between the model's forward and backward: the loss, whose inputs autograd keeps
    "loss": Category.ACTIVATION.value,
    "backward": Category.TEMPORARY.value,
    "optimizer": Category.OPTIMIZER_STATE.value,
}


class Block:
    """A GPU block: its trace id, size (-1 once freed), category, the phase that made it, the
    index of its ``alloc`` event (-1: none, a zero-byte block) and its module."""

    __slots__ = ("ident", "nbytes", "category", "phase", "phase_seq", "event", "module")

    def __init__(self, ident: int, nbytes: int, category: str, phase: str, phase_seq: int,
                 event: int, module: str) -> None:
        self.ident = ident
        self.nbytes = nbytes
        self.category = category
        self.phase = phase
        self.phase_seq = phase_seq
        self.event = event
        self.module = module


_VIEW_SIZES: List[bool] = []


def views_resize_storages() -> bool:
    """Does this torch's fake mode report a view's extent as its storage's size?

    torch 2.3's does: after ``base[:, :64]`` of a fake (1, 128) int64 tensor, ``base``'s and the
    view's ``untyped_storage().nbytes()`` read 512, not 1,024; another view sets it again
    (measured here with 2.3.1; 2.2.2, 2.8.0 and 2.14.1 keep 1,024). A view never allocates nor
    resizes on a GPU, and the size such a view reports is never above the storage's, so there a
    storage only counts as resized when it grows past its block (``torch.Tensor.resize_`` grows
    storages and never shrinks them; shrinking takes ``UntypedStorage.resize_``, which FSDP uses,
    and FSDP is traced with real values on 2.3: ``distributed._refuse_fake_on_2_3``). Asked of
    torch itself, once, so a vendor's build of any release is judged by what it does."""
    if not _VIEW_SIZES:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with _disable_current_modes(), FakeTensorMode():
            base = torch.empty(4, dtype=torch.uint8)
            view = base[:2]
            _VIEW_SIZES.append(view.untyped_storage().nbytes() != 4)
    return _VIEW_SIZES[0]


def source_name(func: Any) -> str:
    """An op's name for the trace: ``aten.mm``, ``c10d.allgather_``; a string as it is."""
    if isinstance(func, str):
        return func
    packet = getattr(func, "__name__", str(func)).split(".")[0]
    return f"{getattr(func, 'namespace', 'aten')}.{packet}"


class Blocks:
    """The GPU blocks by storage, the bytes they hold, and their events in the trace.

    ``phase`` and ``phase_seq`` are the tracker's (``AllocationTracker.enter_phase`` sets both):
    a block freed at any point (a weakref callback) is judged by the phase it is freed in.
    ``source`` is the op whose outputs are being recorded (``AllocationTracker`` sets it).
    """

    def __init__(self, trace: Trace, modules: ModuleTracker, nodes: AutogradNodes) -> None:
        self.trace = trace
        # storage -> Block for GPU storages; host storages map to None. Weak keys only.
        self.storages = WeakIdKeyDictionary()
        # block id -> the weakref whose callback frees it
        self.refs: Dict[int, Any] = {}
        self.next_id = 1
        self.phase = "setup"
        self.phase_seq = 0
        self.source: Any = ""
        self.live_bytes = 0
        self.peak_live_bytes = 0
        # GPU blocks made by forward passes since the last optimizer step (the probe's guard).
        self.forward_allocations = 0
        self._modules = modules
        self._nodes = nodes
        self._source_names: Dict[Any, str] = {}
        # fake storage -> the address its data_ptr() reports (see ``address``)
        self._addresses = WeakIdKeyDictionary()
        self._next_address = 1 << 32

    def new(self, st: Any, device_flag: Optional[str], inherited: str = "") -> None:
        """A new GPU block for storage ``st``, made now (``device_flag``: the tracker's; a block
        made outside every phase is an input when the virtual device put it on the GPU).
        ``inherited``: its module when no module runs."""
        nbytes = st.nbytes()
        if nbytes == 0:
            # A zero-byte request never reaches cudaMalloc nor a block: the caching allocator
            # returns a null pointer for size 0 (CUDACachingAllocator.cpp, NativeCachingAllocator
            # ::malloc: `if (size == 0) return nullptr`-style early exit in allocate()). It is
            # still a tensor of the GPU (a freed ZeRO-3 parameter's empty data): a block that
            # holds nothing and has no event (``event`` -1), as a storage resized to 0 keeps.
            self.storages[st] = Block(0, -1, "", self.phase, self.phase_seq, -1, "")
            return
        ident = self.next_id
        self.next_id += 1
        if ident == 1:  # the job's caching allocator starts: the settings it reads (alloc_conf)
            self.trace.meta[ENV_META] = {k: os.environ[k] for k in VARIABLES if k in os.environ}
        phase = self.phase
        category = PHASE_CATEGORY.get(phase)
        if phase == "forward":
            self.forward_allocations += 1
        if category is None:
            category = Category.INPUT.value if device_flag == "cuda" else Category.OTHER.value
        modules = self._modules
        if phase == "backward":
            module = (modules.path + RECOMPUTED if modules.stack else self._nodes.module)
        else:
            module = modules.path or inherited
        func = self.source
        source = self._source_names.get(func) if func is not None else ""
        if source is None:
            source = self._source_names[func] = source_name(func)
        block = Block(ident, nbytes, category, phase, self.phase_seq, len(self.trace.events),
                      module)
        self.trace.events.append(Alloc(ALLOC, ident, nbytes, 0, category, phase, module,
                                       source))
        self.storages[st] = block
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
        # The weakref object must outlive the storage for its callback to run: keep it here.
        self.refs[ident] = weakref.ref(st, FreeCallback(self, block))

    def free(self, block: Block) -> None:
        """The block goes back to the allocator now (once: a freed block keeps nbytes -1)."""
        if block.nbytes < 0:
            return
        if block.phase == self.phase and block.phase_seq == self.phase_seq and block.category in (
            Category.ACTIVATION.value, Category.OPTIMIZER_STATE.value
        ):
            # Freed within the same forward (or optimizer step) that made it: a temporary.
            self.recategorize(block, Category.TEMPORARY.value)
        self.trace.free(block.ident)
        self.live_bytes -= block.nbytes
        block.nbytes = -1

    def resized(self, st: Any, block: Block, device_flag: Optional[str]) -> None:
        """``st`` no longer has ``block``'s size: resize_ on a CUDA storage allocates a new
        block and frees the old one."""
        self.free(block)
        if st.nbytes() > 0:
            self.new(st, device_flag)

    def storage_resized(self, st: Any, device_flag: Optional[str]) -> None:
        """``UntypedStorage.resize_`` outside the dispatcher (FSDP's ``free_storage`` of an
        unsharded parameter, resize to 0, and its regrowth before the next all-gather): the
        block is freed, and a regrown storage is a new block."""
        try:
            block = self.storages.get(st)
        except (RuntimeError, NotImplementedError):
            return
        if block is not None and st.nbytes() != max(block.nbytes, 0):
            previous, self.source = self.source, ALL_GATHER
            try:
                self.resized(st, block, device_flag)
            finally:
                self.source = previous

    def recategorize(self, block: Block, category: str) -> None:
        """Rewrite the category of the allocation event that made ``block``."""
        event = self.trace.events[block.event]
        assert event.op == ALLOC, f"event {block.event} is {event.op}, not the block's allocation"
        self.trace.events[block.event] = event._replace(category=category)

    def tag(self, tensor: Optional[torch.Tensor], category: Category,
            module: Optional[str] = None) -> None:
        """Give the GPU block behind ``tensor`` an explicit category (parameter, gradient...)
        and, when given, the module it belongs to."""
        if tensor is None:
            return
        try:
            block = self.storages.get(local(tensor).untyped_storage())
        except (RuntimeError, NotImplementedError):
            return
        if block is None or block.event < 0:
            return
        if module is not None and block.module != module:
            block.module = module
            event = self.trace.events[block.event]
            if event.op == ALLOC:
                self.trace.events[block.event] = event._replace(module=module)
        if block.category == category.value:
            return
        block.category = category.value
        self.recategorize(block, category.value)

    def address(self, storage: Any) -> int:
        """A stable, distinct stand-in address for a fake storage (512-byte aligned, as the
        caching allocator's blocks are: CUDACachingAllocator.cpp, kMinBlockSize = 512)."""
        base = self._addresses.get(storage)
        if base is None:
            base = self._next_address
            self._next_address += (storage.nbytes() // 512 + 1) * 512
            self._addresses[storage] = base
        return int(base)


class FreeCallback:
    """Weakref callback that records the free; holds the blocks weakly too."""

    __slots__ = ("blocks", "block")

    def __init__(self, blocks: Blocks, block: Block) -> None:
        self.blocks = weakref.ref(blocks)
        self.block = block

    def __call__(self, _ref: Any) -> None:
        blocks = self.blocks()
        if blocks is not None:
            blocks.refs.pop(self.block.ident, None)
            blocks.free(self.block)


class NullTrace(Trace):
    """A trace that drops frees (the tracker's once it stops recording)."""

    def free(self, id: int) -> None:  # noqa: A002
        pass
