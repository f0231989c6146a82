"""Which side of the virtual GPU a tensor is on, and which ops compute on real host data.

The tracker knows the GPU's tensors by their storages (``AllocationTracker.is_cuda``); this
module holds what it decides with: what a fake tensor is, which tensor holds a wrapper's memory,
a fake tensor's device as fake mode reports it, and, in fake mode, which ops compute on host data
for real (``host_data``).

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

aten = torch.ops.aten

# Host data in fake mode (see ``host_data``): factories that make an order or a range are real
# at any size (a sampler's randperm over every index of a dataset); other host factories up to
# HOST_FACTORY_NUMEL elements (64 MiB of fp32; a label vector of a dataset of millions fits);
# bulk beyond (a synthetic batch of 256 images of 224x224x3 is 38.5M elements) is shape-only.
_INDEX_FACTORIES = {aten.randperm, aten.arange}
HOST_FACTORY_NUMEL = 1 << 24

# A device flag for C++ code that makes GPU buffers and host bookkeeping from factories with the
# same (host) device: floating-point factories are GPU memory, integer ones are host data. DDP's
# reducer allocates its gradient buckets with the parameters' options and its bucket indices as
# kInt host tensors (reducer.cpp, ``initialize_buckets`` and ``sync_bucket_indices``).
FLOATING_ON_GPU = "floating-on-gpu"

# Outputs that live on the host whatever the inputs' device: a PackedSequence's batch_sizes
# (PackedSequence.py: "batch_sizes should always be on CPU"; _pack_padded_sequence makes it there).
HOST_OUTPUTS: Dict[Any, Tuple[int, ...]] = {aten._pack_padded_sequence.default: (1,)}

_META = torch.device("meta")


def is_fake(t: Any) -> bool:
    """A FakeTensor (checked by name: the class lives in a private torch module)."""
    return type(t).__name__ == "FakeTensor"


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds the memory: a DTensor's local shard (FSDP2's sharded parameters and
    gradients are DTensors, wrapper subclasses without storage of their own)."""
    held = getattr(t, "_local_tensor", None)
    return held if isinstance(held, torch.Tensor) else t


def fake_device(t: Any) -> Optional[torch.device]:
    """A fake tensor's answer to ``prim.device``, as fake mode gives it (fake_tensor.py,
    ``_device_handler``: "meta" inside a kernel, else the fake device); None for any other
    tensor, or a torch whose fake tensors keep these elsewhere (then fake mode answers)."""
    mode = getattr(t, "fake_mode", None)
    device = getattr(t, "fake_device", None)
    if mode is None or not isinstance(device, torch.device):
        return None
    return _META if getattr(mode, "in_kernel_invocation", False) else device


def host_data(func: Any, args: Tuple[Any, ...], inputs: List[torch.Tensor],
              kwargs: Dict[str, Any], device_flag: Optional[str], default_cuda: bool) -> bool:
    """Does this op compute on the host from real values only (fake mode runs it for real)?

    ``device_flag`` and ``default_cuda`` are the tracker's (the side the virtual device chose
    for the memory made now, and whether the default device is the GPU). Ops on real host
    tensors are; so are host factories (no tensor input) that make an order or a range
    (``randperm``, ``arange``: a sampler's shuffle of any dataset) or at most HOST_FACTORY_NUMEL
    elements. A larger random or constant block (a synthetic batch of millions of rows) stays
    shape-only: its values are bulk data, not decisions.
    """
    if device_flag in ("cuda", "meta"):
        return False
    if device_flag == FLOATING_ON_GPU and not inputs:
        dtype = kwargs.get("dtype")
        return dtype is not None and not dtype.is_floating_point
    if inputs:
        for t in inputs:
            if is_fake(local(t)):
                return False
        return True
    device = kwargs.get("device")
    if device is not None and getattr(device, "type", device) == "meta":
        return False  # shape-only memory (torch.device("meta") as the default device)
    if device_flag != "host" and default_cuda:
        return False
    if func.overloadpacket in _INDEX_FACTORIES:
        return True
    try:
        with _disable_current_modes():
            shape = func(*args, **dict(kwargs, device=torch.device("meta")))
    except Exception:  # not a factory that takes a device: decide by running it
        return True
    return not isinstance(shape, torch.Tensor) or shape.numel() <= HOST_FACTORY_NUMEL
