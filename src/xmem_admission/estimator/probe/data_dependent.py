"""Ops whose output size depends on values fake mode may lack, and values it does not know.

A value the script asks for that fake execution does not know (the loss's) raises
``DataDependentValue``; ``virtual_cuda`` turns that into a placeholder for logging or a fallback
to profile mode for decisions. An op whose output size depends on values it lacks (``x[mask]``,
``nonzero``, ``unique``) is sized at its largest (``bounded``); one without a bound needs real
values (``NeedsRealValues``). ``_pack_padded_sequence`` takes its size from the lengths alone.

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from xmem_admission.estimator.probe import bounded
from xmem_admission.estimator.probe.locations import op_name, where_in_script
from xmem_admission.estimator.probe.outcomes import NeedsRealValues
from xmem_admission.estimator.probe.shadows import MISSING
from xmem_admission.estimator.trace import NoteKind, Trace

aten = torch.ops.aten
Shadow = Callable[[torch.Tensor], Optional[torch.Tensor]]


class DataDependentValue(Exception):
    """Internal: the script asked for a value fake execution does not know (the message says
    which value, and where it came from)."""


def sized_by_values(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                    inputs: List[torch.Tensor], shadow: Shadow,
                    record: Callable[[torch.Tensor], torch.Tensor],
                    describe: Callable[[torch.Tensor], str], trace: Trace) -> Any:
    """An op whose output size depends on values, not all of them known: sized from the known
    ones and bounded for the rest (``bounded``), the bound said in the trace; one without a bound
    needs real values. ``record`` records a kernel's scratch tensor as the op's output."""
    sized = bounded.run(func, args, kwargs, shadow, record)
    if sized is None:
        missing = [t for t in inputs if shadow(t) is None]
        raise NeedsRealValues(
            f"the size of {op_name(func)}'s output at {where_in_script()} depends on "
            f"{describe(missing[0]) if missing else 'its inputs'}, and has no bound "
            f"without it")
    if sized.bound:
        trace.note(
            NoteKind.BOUNDED, f"{op_name(func)} at {where_in_script()}: {sized.bound}",
            key=f"{op_name(func)} {where_in_script()}",
            extra_bytes=sized.bound_bytes)
    return sized.out


def pack_padded(args: Tuple[Any, ...], shadow: Shadow) -> Any:
    """``_pack_padded_sequence`` in fake mode: the packed size comes from the lengths (real, on
    the host), never from the data: run it for real on a one-wide stand-in of the data for
    ``batch_sizes``, and make the packed data shape-only (``MISSING``: the lengths are unknown)."""
    data, lengths, batch_first = args[0], shadow(args[1]), bool(args[2])
    if lengths is None:
        return MISSING
    with _disable_current_modes():
        stand_in = torch.zeros(tuple(data.shape[:2]) + (1,) * (data.dim() - 2))
        _, batch_sizes = aten._pack_padded_sequence.default(stand_in, lengths, batch_first)
        total = int(batch_sizes.sum())
    packed = data.new_empty((total,) + tuple(data.shape[2:]))
    return packed, batch_sizes
