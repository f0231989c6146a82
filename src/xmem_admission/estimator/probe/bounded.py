"""Ops whose output size depends on values: sized from the values where the probe has them,
else at the largest size they can have.

In fake mode a boolean-mask index (``x[mask]``), ``nonzero``, ``masked_select`` or ``unique``
cannot size its output: the count it depends on is a value, and fake execution has shapes only.
Where the mask's value is known (a shadow: masks made from token ids and labels, which are host
data), the op is sized exactly from it. Otherwise the output is made as large as it can be, every
element selected (``nonzero``: one row per element; ``unique``: every element distinct), and the
call is a *bound*: the estimate is an upper bound there, and the trace says so
(``Trace.note(NoteKind.BOUNDED, ...)``). An op whose largest size has no limit in its inputs
(``repeat_interleave`` with tensor repeats, ``bincount``) cannot be bounded: ``run`` answers
``None`` and the probe needs real values (``auto`` falls back to profile mode).

What the CUDA kernels allocate besides the output:

- ``index`` with a boolean or byte mask (aten/src/ATen/native/TensorAdvancedIndexing.cpp,
  ``index``; aten/src/ATen/native/IndexingUtils.h, ``expandTensors``): each mask becomes
  ``mask.nonzero()``, a ``count x mask.dim()`` int64 tensor whose columns are the long indices,
  alive for the call; ``index_put_`` (``index_put_with_sort_cuda_``/``index_put_`` through
  ``expandTensors`` too) and ``masked_select`` (aten/src/ATen/native/cuda/IndexKernel.cpp,
  ``masked_select_out_cuda_impl``: ``index`` of the expanded self by the expanded mask) the same;
- ``nonzero`` (aten/src/ATen/native/cuda/Nonzero.cu, ``nonzero_out_cuda``): the count is
  reduced on the device and copied to the host before ``out`` is resized to
  ``count x dim``: the output is exact, and its cub scratch (a few hundred bytes) sits in the
  small pool;
- ``unique`` (aten/src/ATen/native/cuda/Unique.cu, ``unique_cuda_template``): values, inverse
  and counts are the outputs; the sort's scratch is not replayed.

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

aten = torch.ops.aten
Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]
# The real value behind a fake tensor where the probe has it (``AllocationTracker.shadow``).
Real = Callable[[torch.Tensor], Optional[torch.Tensor]]
# Records a kernel's scratch tensor as allocated now (``AllocationTracker._recorded``).
Record = Callable[[torch.Tensor], torch.Tensor]

_MASK_DTYPES = (torch.bool, torch.uint8)


class Sized:
    """An op's output, and what its size stands on: ``bound`` is empty where every count was
    known, else it says which counts were taken at their largest; ``bound_bytes`` is the size of
    the outputs made at a bound (what the bound can cost at most, were every count zero)."""

    __slots__ = ("out", "bound", "bound_bytes")

    def __init__(self, out: Any, bound: str = "", bound_bytes: int = 0) -> None:
        self.out = out
        self.bound = bound
        self.bound_bytes = bound_bytes


class _Counts:
    """The counts one call depends on: from values where known, else their bounds."""

    def __init__(self, real: Real) -> None:
        self.real = real
        self.bounded: List[str] = []

    def true_count(self, mask: torch.Tensor, shape: Optional[Sequence[int]] = None) -> int:
        """How many elements ``mask`` (broadcast to ``shape``) selects, or all of them."""
        numel = _numel(shape) if shape is not None else mask.numel()
        value = self.real(mask)
        if value is None:
            self.bounded.append(f"a {_shape(mask)} mask taken as selecting every element")
            return numel
        with _disable_current_modes():
            if shape is not None:
                value = value.expand(tuple(shape))
            return int(value.count_nonzero())

    def distinct(self, tensor: torch.Tensor, dim: Optional[int], consecutive: bool) -> int:
        """How many distinct values (or slices along ``dim``) ``tensor`` has, or all of them."""
        value = self.real(tensor)
        if value is None:
            self.bounded.append(f"every element of a {_shape(tensor)} tensor taken as distinct")
            return tensor.numel() if dim is None else int(tensor.shape[dim])
        with _disable_current_modes():
            if consecutive:
                out = torch.unique_consecutive(value, dim=dim)
            else:
                out = torch.unique(value, dim=dim)
            return int(out.numel() if dim is None else out.shape[dim])

    def total(self, repeats: torch.Tensor) -> Optional[int]:
        """The sum of ``repeats``: no bound exists without its value."""
        value = self.real(repeats)
        if value is None:
            return None
        with _disable_current_modes():
            return int(value.sum())


def run(func: Any, args: Args, kwargs: Kwargs, real: Real, record: Record) -> Optional[Sized]:
    """Call ``func``, an op fake execution could not size, with its sizes known or bounded.
    ``None``: not an op sized here, or one without a bound (the probe needs real values)."""
    sizer = _SIZERS.get(func.overloadpacket)
    if sizer is None:
        return None
    counts = _Counts(real)
    out = sizer(func, _bind(func, args, kwargs), counts, record)
    if out is None:
        return None
    if not counts.bounded:
        return Sized(out)
    made = sum(t.numel() * t.element_size() for t in _tensors(out))
    return Sized(out, "; ".join(counts.bounded), made)


def _bind(func: Any, args: Args, kwargs: Kwargs) -> Dict[str, Any]:
    """The call's arguments by the schema's names, defaults filled in."""
    bound: Dict[str, Any] = {}
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args):
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _long_indices(indices: Sequence[Optional[torch.Tensor]], counts: _Counts, record: Record,
                  held: List[torch.Tensor],
                  count: Optional[Callable[[torch.Tensor], int]] = None
                  ) -> List[Optional[torch.Tensor]]:
    """``indices`` with each mask replaced by the long indices ``expandTensors`` makes of it:
    the columns of a ``count x mask.dim()`` int64 scratch tensor (recorded, kept in ``held``
    for the call)."""
    out: List[Optional[torch.Tensor]] = []
    for index in indices:
        if index is None or index.dtype not in _MASK_DTYPES:
            out.append(index)
            continue
        selected = count(index) if count is not None else counts.true_count(index)
        scratch = record(index.new_empty((selected, index.dim()), dtype=torch.long))
        held.append(scratch)
        out.extend(scratch.select(1, column) for column in range(index.dim()))
    return out


def _index(func: Any, call: Dict[str, Any], counts: _Counts, record: Record) -> Any:
    held: List[torch.Tensor] = []
    indices = _long_indices(call["indices"], counts, record, held)
    return func(call["self"], indices)


def _index_put(func: Any, call: Dict[str, Any], counts: _Counts, record: Record) -> Any:
    values = call["values"]

    def count(mask: torch.Tensor) -> int:
        if counts.real(mask) is not None or values.numel() <= 1:
            return counts.true_count(mask)
        # the values' leading size is the count (they are assigned one per selected element);
        # the scratch is sized from it: no bound is taken
        return int(values.shape[0])

    held: List[torch.Tensor] = []
    indices = _long_indices(call["indices"], counts, record, held, count)
    rest = [call[name] for name in ("accumulate", "unsafe") if name in call]
    return func(call["self"], indices, values, *rest)


def _masked_select(func: Any, call: Dict[str, Any], counts: _Counts, record: Record) -> Any:
    source, mask = call["self"], call["mask"]
    shape = torch.broadcast_shapes(tuple(source.shape), tuple(mask.shape))
    selected = counts.true_count(mask, shape)
    scratch = record(mask.new_empty((selected, len(shape)), dtype=torch.long))
    out = source.new_empty((selected,))
    del scratch
    return out


def _nonzero(func: Any, call: Dict[str, Any], counts: _Counts, record: Record) -> Any:
    source = call["self"]
    return source.new_empty((counts.true_count(source), source.dim()), dtype=torch.long)


def _unique(func: Any, call: Dict[str, Any], counts: _Counts, record: Record) -> Any:
    """``_unique``, ``_unique2``, ``unique_dim``, ``unique_consecutive``: values, then the
    inverse and the counts where the op returns them (empty where not asked)."""
    source = call["self"]
    name = func.overloadpacket.__name__
    dim = call.get("dim")
    if dim is not None:
        dim = int(dim) % max(source.dim(), 1)
    distinct = counts.distinct(source, dim, consecutive=name == "unique_consecutive")
    if dim is None:
        values = source.new_empty((distinct,))
    else:
        shape = list(source.shape)
        shape[dim] = distinct
        values = source.new_empty(tuple(shape))
    outputs = [values]
    if name != "_unique" or call.get("return_inverse"):
        inverse_shape = (tuple(source.shape) if dim is None else (int(source.shape[dim]),))
        outputs.append(source.new_empty(inverse_shape if call.get("return_inverse") else (0,),
                                        dtype=torch.long))
    if name != "_unique":
        outputs.append(source.new_empty((distinct,) if call.get("return_counts") else (0,),
                                        dtype=torch.long))
    return tuple(outputs)


def _repeat_interleave(func: Any, call: Dict[str, Any], counts: _Counts,
                       record: Record) -> Any:
    repeats = call.get("repeats", call.get("self"))
    if not isinstance(repeats, torch.Tensor):
        return None
    total = call.get("output_size")
    if total is None:
        total = counts.total(repeats)
    if total is None:
        return None
    return func(*[call[a.name] for a in func._schema.arguments
                  if a.name in call and a.name != "output_size"], output_size=int(total))


_SIZERS: Dict[Any, Callable[[Any, Dict[str, Any], _Counts, Record], Any]] = {
    aten.index: _index,
    aten.index_put: _index_put,
    aten.index_put_: _index_put,
    aten._index_put_impl_: _index_put,
    aten.masked_select: _masked_select,
    aten.nonzero: _nonzero,
    aten._unique: _unique,
    aten._unique2: _unique,
    aten.unique_dim: _unique,
    aten.unique_consecutive: _unique,
    aten.repeat_interleave: _repeat_interleave,
}


def _tensors(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def _shape(tensor: torch.Tensor) -> str:
    return "x".join(str(d) for d in tensor.shape) or "scalar"
