"""The autograd node running a backward op, and the engine's in-place gradient accumulation.

In a backward, each op runs under an autograd node: the tracker names the forward module that
made the node (``ModuleTracker.module_of_node``) and notes the first GPU block made under it,
which tells autograd's own sum of two gradients of one input from a formula's (``accumulates``).

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from xmem_admission.estimator.probe.module_paths import NO_SEQUENCE, ModuleTracker

aten = torch.ops.aten

# The autograd node being evaluated on this thread: None outside backward (and always, on a
# torch without the binding). Looked up once: the tracker asks at every op of a backward.
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class AutogradNodes:
    """The autograd node whose ops run now, the first block id made under it, and its module."""

    __slots__ = ("key", "first_block", "module", "_modules")

    def __init__(self, modules: ModuleTracker) -> None:
        self.key: Optional[Tuple[int, int]] = None
        self.first_block = 0
        # the forward module that made the node ("" outside backward)
        self.module = ""
        self._modules = modules

    def note(self, next_block: int) -> None:
        """Track which autograd node runs (``next_block``: the id the next block will get)."""
        node = _current_autograd_node()
        if node is None:
            self.key = None
            self.module = ""
            return
        sequence_nr = getattr(node, "_sequence_nr", None)
        number = sequence_nr() if sequence_nr is not None else NO_SEQUENCE
        key = (id(node), number)
        if key != self.key:  # the first op under this node: the node starts here
            self.key = key
            self.first_block = next_block
            self.module = self._modules.module_of_node(number)

    def accumulates(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                    storages: Any) -> bool:
        """Is this ``add`` autograd summing two gradients of one input (a residual, a tied weight)?
        (``storages``: the tracker's blocks by storage.)

        The engine's ``InputBuffer::accumulate`` (torch/csrc/autograd/input_buffer.cpp) computes
        ``old + new`` and, when its buffer holds the last reference to a dense ``old``, does it
        in place (``old.add_(new)``, ``can_accumulate_inplace``, PyTorch >= 2.1). It never does
        while a dispatch mode is active (``at::isTensorSubclassLike`` answers true then), so
        under this tracker, in fake and profile mode alike, every residual junction and tied
        weight would record a gradient-sized block that the job's GPU run does not allocate.
        The engine's add comes with no alpha, outside grad mode, under the node that produced
        ``new``, while ``old`` was made before that node started (a formula's own ``a + b``
        adds temporaries of its node, and stays out of place).
        """
        if func is not aten.add.Tensor or kwargs or len(args) != 2 or torch.is_grad_enabled():
            return False
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old is new:
            return False
        if self.key is None:
            return False
        # A view keeps its base's storage referenced (storage use_count > 1): out of place, as
        # for a tied weight whose first gradient comes through ``t()``.
        if (old.shape != new.shape or old.dtype != new.dtype or old.storage_offset() != 0
                or not dense(old) or old._is_view()):
            return False
        try:
            old_storage, new_storage = old.untyped_storage(), new.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return False
        block = storages.get(old_storage)
        return (block is not None and block.ident < self.first_block
                and old_storage.nbytes() == old.numel() * old.element_size()
                and new_storage is not old_storage)


def dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense, as ``can_accumulate_inplace`` requires: the dims sorted by
    stride (those of size < 2 last, as they constrain nothing) must pack the elements with no
    gap or overlap; the rule of c10's ``_compute_non_overlapping_and_dense``
    (``c10/core/Contiguity.h``; ``TensorImpl::compute_non_overlapping_and_dense`` before).
    A transposed gradient (a rotary embedding's q/k) is dense, so it accumulates in place."""
    sizes: List[int] = [int(n) for n in t.shape]
    strides: List[int] = [int(n) for n in t.stride()]
    if len(sizes) == 1:
        return sizes[0] < 2 or strides[0] == 1
    order = sorted(range(len(sizes)), key=lambda d: (sizes[d] < 2, strides[d] if sizes[d] >= 2
                                                     else 0))
    expected = 1
    for d in order:
        if sizes[d] < 2:
            return True
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True

