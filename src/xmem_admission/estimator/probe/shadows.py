"""Shadows: the real values behind fake tensors that the script computes from Python data.

In fake mode (shape-only execution under ``FakeTensorMode``) the tracker keeps real values for
small tensors that the script computes from Python data (optimizer step counters, RegNet's width
arithmetic, token ids, attention masks). Any op whose inputs all have shadows is replayed for real
on the shadows (``Shadows.propagate``), so ``.item()``/``.tolist()`` on them answer truthfully and
the model the probe traces is the model the script builds. A fake tensor without a shadow keeps
where it came from (``Shadows.note_origins``), for the words of a fallback's reason.

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from xmem_admission.estimator.probe.locations import op_name, where_in_script
from xmem_admission.estimator.probe.placement import HOST_FACTORY_NUMEL, is_fake

aten = torch.ops.aten
Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]

# Shadows: factory ops with no tensor input get a real value only when small (a step counter, a
# handful of widths, a batch's ``torch.ones(batch, seq)`` attention mask up to 64K tokens, which
# transformers 4.x inspects with ``torch.all(mask == 1)``), so building a 7B model never computes
# real weights (those start as ``empty``, which has no value). Ops on shadowed inputs are replayed
# for real up to DERIVED_NUMEL_LIMIT elements (token ids and masks of a batch fit).
SMALL_FACTORY_NUMEL = 1 << 16
DERIVED_NUMEL_LIMIT = 1 << 22

# Ops whose output is the input's value, kept for any size (the data the script brought in).
_LIFT_OPS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
# Uninitialised memory has no value worth shadowing (weights are created this way, then their
# init is neutralised in fake mode).
_NO_VALUE_PACKETS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
                     aten.new_empty_strided, aten.empty_permuted}

# Ops whose value is a constant of the input's shape (None: the fill is the second argument).
_CONSTANT_LIKE = {aten.ones_like: 1, aten.zeros_like: 0, aten.full_like: None}
# Ops whose result is zero when either input is zero, whatever the other holds (integers and
# booleans: no NaN times zero), and boolean ORs, all true when either input is.
_OR_PACKETS = {aten.bitwise_or, aten.logical_or}
_ABSORBING = {aten.bitwise_and, aten.logical_and, aten.mul} | _OR_PACKETS
# NaN/Inf checks and the answer they give on values fake mode does not know (see
# ``Shadows.propagate``); HF Trainer, for one, filters its logged loss this way every step.
_FINITE_CHECKS = {aten.isnan: False, aten.isinf: False, aten.isposinf: False,
                  aten.isneginf: False, aten.isfinite: True}

# What an op replayed on shadows gives when it has no value.
MISSING = object()
_MUTATED: Dict[Any, Tuple[int, ...]] = {}


def mutated_args(func: Any) -> Tuple[int, ...]:
    """The positions of the arguments an op writes into (its schema's ``a!`` aliases)."""
    cached = _MUTATED.get(func)
    if cached is None:
        cached = tuple(
            i for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _MUTATED[func] = cached
    return cached


class Shadows:
    """The real values behind fake tensors, and where the fake tensors without one came from."""

    def __init__(self, fake: bool, fake_mode: Any) -> None:
        self.fake = fake
        self.fake_mode = fake_mode
        # fake tensor -> its real value
        self.values = WeakIdKeyDictionary()
        # fake tensor without a value -> where it came from (for the fallback's reason)
        self.origins = WeakIdKeyDictionary()

    def of(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The real value behind ``tensor`` when it is known (always, outside fake mode).

        A wrapper subclass over fake tensors (FSDP2's and DTensor's sharded values) has none of
        its own: its op runs as ops on its inner tensors, which carry their values themselves.
        Taking the wrapper for its own value would run every op on it a second time."""
        if not self.fake:
            return tensor
        if is_fake(tensor):
            return self.values.get(tensor)
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            if any(is_fake(getattr(tensor, name)) for name in names):
                return None
        return tensor

    def propagate(self, func: Any, args: Args, kwargs: Kwargs, inputs: List[torch.Tensor],
                  out: Any) -> None:
        """After a fake op: its outputs' values, computed for real on its inputs' shadows."""
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        limit: Optional[int]
        if func in _LIFT_OPS:
            limit = None
        elif func.overloadpacket in _NO_VALUE_PACKETS:
            return
        elif not inputs:
            limit = SMALL_FACTORY_NUMEL
        else:
            limit = DERIVED_NUMEL_LIMIT
        if any(t.numel() > limit for t in outs) if limit is not None else False:
            self.forget_mutated(func, args)
            return
        real = self.run_real(func, args, kwargs, inputs, limit)
        if (real is MISSING and func.overloadpacket in _CONSTANT_LIKE and len(outs) == 1
                and outs[0].numel() <= SMALL_FACTORY_NUMEL):
            # its value is its fill, whatever the input's (a mask made with ones_like); made
            # like a value fake mode lacks, it is a factory of that shape, real only when small
            # as factories are (an optimizer's zeros_like of each parameter is model state: a
            # 0.85B model's Adam moments would be gigabytes of host memory)
            fill = _CONSTANT_LIKE[func.overloadpacket]
            with _disable_current_modes():
                real = torch.full(tuple(outs[0].shape), args[1] if fill is None else fill,
                                  dtype=outs[0].dtype)
        if real is MISSING and func.overloadpacket in _ABSORBING and len(outs) == 1:
            real = self._absorbed(inputs, outs[0], func.overloadpacket in _OR_PACKETS)
        if real is MISSING and func.overloadpacket in _FINITE_CHECKS and len(outs) == 1:
            # Values fake mode does not know are taken to be finite (as the patched GradScaler
            # does): a NaN/Inf check on them answers "no" instead of stopping the trace.
            with _disable_current_modes():
                real = torch.full(tuple(outs[0].shape), _FINITE_CHECKS[func.overloadpacket],
                                  dtype=torch.bool)
        if real is MISSING:
            self.forget_mutated(func, args)
            return
        real_outs = [t for t in tree_flatten(real)[0] if isinstance(t, torch.Tensor)]
        if len(real_outs) != len(outs):
            return
        for fake_t, real_t in zip(outs, real_outs):
            if is_fake(fake_t):
                self.values[fake_t] = real_t

    def _absorbed(self, inputs: List[torch.Tensor], out: torch.Tensor, either: bool) -> Any:
        """An AND (or an integer product) of two tensors, one known to be all zero, is zero
        whatever the other holds; an OR of booleans, one known all true, is all true (a
        generation loop's ``is_done | at_max_length`` and ``unfinished & ~is_done`` once every
        sequence reached its maximum length end the loop on a known value)."""
        if len(inputs) != 2 or out.dtype.is_floating_point or out.dtype.is_complex:
            return MISSING
        if either and out.dtype != torch.bool:
            return MISSING
        for t in inputs:
            known = self.of(t)
            if known is None:
                continue
            with _disable_current_modes():
                if either and bool(known.all()):
                    return torch.ones(tuple(out.shape), dtype=out.dtype)
                if not either and not bool(known.any()):
                    return torch.zeros(tuple(out.shape), dtype=out.dtype)
        return MISSING

    def run_real(self, func: Any, args: Args, kwargs: Kwargs, inputs: List[torch.Tensor],
                 limit: Optional[int]) -> Any:
        """The op run for real on its inputs' shadows (``MISSING``: one has none, or it fails;
        ``limit`` None with no tensor input: not a factory to run)."""
        reals = []
        for t in inputs:
            r = self.of(t)
            if r is None:
                return MISSING
            reals.append(r)
        if not inputs and limit is None:
            return MISSING

        def to_real(a: Any) -> Any:
            return self.of(a) if isinstance(a, torch.Tensor) else a

        try:
            with _disable_current_modes():
                return func(*tree_map(to_real, args), **tree_map(to_real, kwargs))
        except Exception:  # a shadow went stale; the fake result stands without a value
            return MISSING

    def from_real(self, real: Any) -> Any:
        """Fake tensors for the real ones in ``real``, each shadowed by its real value."""

        def convert(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            fake = self.fake_mode.from_tensor(t)
            self.values[fake] = t
            return fake

        with _disable_current_modes():
            return tree_map(convert, real)

    def forget_mutated(self, func: Any, args: Args) -> None:
        """An op wrote into its arguments without a real replay: their shadows are stale."""
        for index in mutated_args(func):
            if index < len(args) and isinstance(args[index], torch.Tensor):
                self.values.pop(args[index], None)

    def note_origins(self, func: Any, inputs: List[torch.Tensor], out: Any,
                     output_on_gpu: Callable[[List[torch.Tensor]], bool]) -> None:
        """Where the op's fake outputs without a shadow came from (``output_on_gpu``: the
        tracker's answer for the op's inputs)."""
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and is_fake(t)
                and t not in self.values]
        if not outs:
            return
        if output_on_gpu(inputs):
            origin = f"computed on the GPU by {op_name(func)} (a value of the model)"
        else:
            inherited = [self.origins[t] for t in inputs if t in self.origins]
            origin = inherited[0] if inherited else (
                f"made on the host by {op_name(func)} at {where_in_script()}"
                + (f" (a host block over {HOST_FACTORY_NUMEL:,} elements is shape-only)"
                   if not inputs else ""))
        for t in outs:
            self.origins[t] = origin

    def describe(self, tensor: torch.Tensor, is_cuda: Callable[[torch.Tensor], bool]) -> str:
        """Which value this is and where it came from, in words."""
        shape = "x".join(str(d) for d in tensor.shape) or "scalar"
        dtype = str(tensor.dtype).replace("torch.", "")
        origin = self.origins.get(tensor) if is_fake(tensor) else None
        if origin is None:
            origin = ("of the model's state (a parameter or a value computed from one)"
                      if is_cuda(tensor) else "whose value fake mode does not know")
        return f"the value of a {shape} {dtype} tensor {origin}"

