"""Fake-mode generation without dispatching every sampling step: the steps' allocations are
produced from the traced ones.

Every sampling step of transformers' ``_sample`` loop (``generation/utils.py``) runs the model
on one new token: with the stand-in token (``generation``), every completion runs to its
maximum length, and each step's trace differs from the one before only where the KV cache, the
ids and the attention mask grow. Tracing every step costs the same each time (about 2,000
trace events of a 16-layer model, ``bench/speed/generation_steps.py``), so a 512-token
completion is 512 model forwards in fake mode.

So the loop is traced for real until its steps repeat, and the rest are written from the rule
they follow:

1. The loop head (``_has_unfinished_sequences``, called once per iteration) splits the trace
   into steps. A step's events are read as a *shape*: each allocation's stream, category,
   phase, module and op; each free as "the allocation at position q of the step d steps back";
   each mark's text. Sizes and the numbers in marks are the step's *numbers*.
2. Once enough regular steps are traced (``WINDOW``: twice the longest period looked for), the
   smallest period p is sought such that steps i and i + p have the same shape and every
   number grows by the same amount from i to i + p as from i + p to i + 2p wherever the window
   holds three steps of a residue (affine per residue: the KV cache's growth, and the padded
   copy of the attention mask that memory-efficient attention makes unless the keys are a
   multiple of 8, ``probe/attention.py``, which makes one step in 8 different). A residue
   with two steps in the window gives its growth unchecked; the traced steps after the jump
   check it. Frees reach at most ``MAX_LAG`` steps back, and nothing a step makes lives
   longer.
3. The loop then jumps a whole number of periods: the skipped steps' events are written from
   the rule (new ids, the sizes extrapolated), and the loop is given the state it would have:
   the ids, attention mask, position ids and each cache layer's keys and values grow in place
   (``set_`` to a larger fake storage; known values are extended by the step their last
   columns take: none for the stand-in token and the mask, one for positions), and every live
   block of the last traced steps takes the identity of its
   counterpart in the last written steps, so later frees name the right ids.
4. The remaining steps (p to 2p - 1, so every position of the period once) run for real and
   are checked against the rule; a difference ends this trace rather than keep an
   extrapolation that was wrong, and the job is traced again with every step traced
   (``outcomes.ShortcutFailed``: ``xmem estimate`` and the estimation pod start it anew).
5. A later generation whose first regular steps (one period and one more) are the steps the
   previous generation's rule was read from, size for size (the same prompt length, model and
   batch: TRL generates once per optimizer step; the allocations' labels may differ, as a
   generation before the first optimizer step is traced in other phases, and each position
   then takes this generation's own), jumps on that rule without a window of its own.
   Those steps were every position of the period once, and the rule was checked at every
   position in the generation it was read from, so the jump leaves 1 to p steps to trace and
   check (the state it grew, the end of the loop), where this generation ends within the keys
   at which the rule was checked at every position; one that reaches more keys (a longer
   prompt) leaves p to 2p - 1, as a window's rule does.

Anything the rule does not cover traces every step, as without this module: a cache other than
``DynamicCache`` of ``DynamicLayer``s, a logits processor or stopping criterion not known to
be stateless, a streamer, ``synced_gpus``, steps that never repeat within the window.
``XMEM_TRACE_EVERY_GENERATION_STEP=1`` turns the module off (the tests compare both traces).

Python >= 3.9, standard library and torch only: the probe bundle.
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import sys
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from xmem_admission.estimator.probe.outcomes import Refused, ShortcutFailed
from xmem_admission.estimator.trace import (
    ALLOC,
    FREE,
    Alloc,
    EmptyCache,
    Free,
    Mark,
    NoteKind,
    gc_paused,
)

OFF = "XMEM_TRACE_EVERY_GENERATION_STEP"
# The longest period looked for: memory-efficient attention's mask padding repeats every 8
# keys (probe/attention.py, the aligned_tensor<8> copy), the longest period seen in these loops.
PERIOD = 8
WINDOW = 2 * PERIOD  # regular steps traced before a period is accepted
MAX_LAG = 3  # steps back a free may reach
# Logits processors and stopping criteria that keep no state between steps (transformers
# generation/logits_process.py and stopping_criteria.py: each __call__ reads only its
# arguments and its constructor's settings).
STATELESS = frozenset({
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper",
    "RepetitionPenaltyLogitsProcessor", "InfNanRemoveLogitsProcessor",
    "SuppressTokensLogitsProcessor", "MaxLengthCriteria", "EosTokenCriteria"})
_NUMBER = re.compile(r"(\d+)")

Shape = Tuple[Any, ...]


def enabled() -> bool:
    return os.environ.get(OFF, "") not in ("1", "true", "yes")


class _Step:
    """One sampling step's events as a shape and its numbers, and the ids it allocated."""

    __slots__ = ("shape", "numbers", "ids", "refs")

    def __init__(self) -> None:
        self.shape: List[Shape] = []
        self.numbers: List[int] = []
        self.ids: List[int] = []
        self.refs: List[Tuple[int, int]] = []  # (step, position) of each free, in order


def _read_step(events: Sequence[Any], index: int, where: Dict[int, Tuple[int, int]]) -> _Step:
    step = _Step()
    for event in events:
        if event.op == ALLOC:
            where[event.id] = (index, len(step.ids))
            step.ids.append(event.id)
            step.shape.append((ALLOC, event.stream, event.category, event.phase, event.module,
                               event.source))
            step.numbers.append(event.size)
        elif event.op == FREE:
            made = where.get(event.id)
            if made is None:  # made before the loop: not a step's
                step.shape.append((FREE, None, event.id))
                step.refs.append((-1, -1))
            else:
                step.shape.append((FREE, index - made[0], made[1]))
                step.refs.append(made)
        elif event.op == "mark":
            parts = _NUMBER.split(event.label)
            step.shape.append(("mark", tuple(parts[0::2])))
            step.numbers.extend(int(n) for n in parts[1::2])
        else:
            step.shape.append(tuple(event))
    return step


class _Rule:
    """Steps from ``start`` on repeat with period ``period``: step j has the shape of the last
    traced step b of its residue and numbers(b) + (j - b) / period * growth(b). ``shift``: the
    rule of another generation, whose step j + shift is this one's step j (its prompt was
    ``shift`` tokens shorter: a step's allocations follow the keys cached, prompt and
    completion together)."""

    def __init__(self, steps: Dict[int, _Step], start: int, last: int, period: int,
                 shift: int = 0) -> None:
        self.steps, self.start, self.last, self.period = steps, start, last, period
        self.shift = shift
        # the last step, in this rule's numbering (its number of keys), up to which the steps
        # traced after a jump covered every position of the period and matched the rule
        self.checked = 0

    def base(self, j: int) -> int:
        return self.last - ((self.last - j) % self.period)

    def shape(self, j: int) -> List[Shape]:
        return self.steps[self.base(j + self.shift)].shape

    def numbers(self, j: int) -> List[int]:
        j += self.shift
        b, p = self.base(j), self.period
        now, before = self.steps[b].numbers, self.steps[b - p].numbers
        periods = (j - b) // p
        return [n + periods * (n - m) for n, m in zip(now, before)]


def find_rule(steps: Dict[int, _Step], start: int, last: int) -> Optional[_Rule]:
    """The smallest period p <= PERIOD under which the regular steps start..last repeat (same
    shapes p apart, numbers growing by the same amount each period), or None."""
    for p in range(1, PERIOD + 1):
        if last - start + 1 < 2 * p:
            break
        if all(steps[i].shape == steps[i + p].shape for i in range(start, last - p + 1)) and all(
                [c - b for b, c in zip(steps[i + p].numbers, steps[i + 2 * p].numbers)]
                == [b - a for a, b in zip(steps[i].numbers, steps[i + p].numbers)]
                for i in range(start, last - 2 * p + 1)):
            return _Rule(steps, start, last, p)
    return None


def _tensors_in(value: Any, depth: int = 0) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 2:
        return []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    return []


class Loop:
    """One ``_sample`` call: its steps, and the jump once they repeat."""

    def __init__(self, tracker: Any, state: Any, frame_code: Any, prompt: int,
                 total: int, cache: Any) -> None:
        self.tracker, self.state, self.code = tracker, state, frame_code
        self.prompt, self.total, self.cache = prompt, total, cache
        self.heads: List[int] = []  # trace length at each loop head
        self.where: Dict[int, Tuple[int, int]] = {}
        self.steps: Dict[int, _Step] = {}
        self.rule: Optional[_Rule] = None
        self.jumped_to = 0  # the first step traced after the jump
        self.traced = 0  # the last step traced before it
        self.done = False
        self.writing = False  # the trace or the loop's state has been changed by a jump

    # -- at every loop head -----------------------------------------------------------------
    def head(self, more: bool) -> None:
        """Read the step that just ended; check it, or jump once the steps repeat. An error of
        this module's own (not the refusal) never reaches the script, whose ``except Exception``
        around ``generate`` could take it for its own: before anything is written the loop goes
        on tracing every step; once the trace or the loop's state was changed, this trace ends
        and the job is traced again with every step traced (``ShortcutFailed``)."""
        try:
            self._head(more)
        except Refused:
            raise
        except Exception as exc:  # noqa: BLE001 - see the docstring
            if not self.writing:
                self.done = True
                return
            raise ShortcutFailed(f"text generation: writing sampling steps from the traced ones "
                                 f"failed ({type(exc).__name__}: {exc})", {OFF: "1"}) from exc

    def _head(self, more: bool) -> None:
        events = self.tracker.trace.events
        self.heads.append(len(events))
        index = len(self.heads) - 1  # the step that just ended (0: none yet)
        if index == 0 or self.done:
            return
        step = _read_step(events[self.heads[-2]:self.heads[-1]], index, self.where)
        self.steps[index] = step
        if self.rule is not None:
            self._check(index, step)
            if not more:  # every step after the jump matched: the next generation may reuse it
                if index - self.jumped_to + 1 >= self.rule.period:
                    self.rule.checked = max(self.rule.checked, index + self.rule.shift)
                self.state.rule, self.state.rule_prompt = self.rule, self.prompt
            return
        if more:
            self._maybe_jump(index)

    def _check(self, index: int, step: _Step) -> None:
        """A step traced after the jump must be what the rule says it is."""
        rule = self.rule
        assert rule is not None
        if step.shape != rule.shape(index) or step.numbers != rule.numbers(index):
            raise ShortcutFailed(
                f"text generation: sampling step {index} of {self.total} differs from the rule "
                f"steps {rule.start} to {rule.last} follow (period {rule.period}), from which "
                f"steps {self.traced + 1} to {self.jumped_to - 1} were written", {OFF: "1"})

    # -- the jump ---------------------------------------------------------------------------
    def _regular_start(self, last: int) -> int:
        start = 2  # step 1 samples from the prompt's forward: no model call of its own
        for i in range(2, last + 1):
            if any(made < 2 for made, _ in self.steps[i].refs):  # step 1's or the prompt's
                start = i + 1
        return start

    def _reused(self, start: int, last: int) -> Optional[_Rule]:
        """The previous generation's rule, where this one's regular steps so far (a period and
        one more) are what it gives for the same number of keys (the same model and batch; a
        prompt d tokens longer starts d steps further on). It then needs no window of its
        own. The allocations' labels (category, phase, module) may differ: a generation before
        the first optimizer step is traced in the ``forward`` and ``loss`` phases, a later one
        as ``after_step``, with other categories. The rule then writes, at each position of
        the period, the labels this generation's own step at that position has."""
        previous: Optional[_Rule] = getattr(self.state, "rule", None)
        if previous is None or previous.start != start or last != start + previous.period:
            return None
        shift = previous.shift + self.prompt - self.state.rule_prompt
        rule = _Rule(previous.steps, previous.start, previous.last, previous.period, shift)
        shapes: Dict[int, List[Shape]] = {}  # the rule's step -> this generation's shape
        for j in range(start, last + 1):
            mine, theirs = self.steps[j].shape, rule.shape(j)
            if len(mine) != len(theirs) or self.steps[j].numbers != rule.numbers(j) or any(
                    a != b and not (a[0] == ALLOC == b[0] and a[1] == b[1] and a[5:] == b[5:])
                    for a, b in zip(theirs, mine)):
                return None
            if shapes.setdefault(rule.base(j + shift), mine) != mine:
                return None  # this generation's labels do not repeat with the period
        steps = dict(previous.steps)
        for base, shape in shapes.items():
            if shape != steps[base].shape:
                relabelled = steps[base] = _Step()
                relabelled.numbers, relabelled.ids = previous.steps[base].numbers, []
                relabelled.shape = shape
        reused = _Rule(steps, previous.start, previous.last, previous.period, shift)
        reused.checked = previous.checked
        return reused

    def _maybe_jump(self, last: int) -> None:
        start = self._regular_start(last)
        if last - start + 1 < WINDOW:
            rule = self._reused(start, last)
            if rule is not None:
                self._jump(rule, last, reused=True)
            return
        if any(lag > MAX_LAG for i in range(start, last + 1)
               for lag in (i - made for made, _ in self.steps[i].refs)):
            self.done = True
            return
        rule = find_rule(self.steps, start, last)
        if rule is None:
            if last - start + 1 >= 4 * PERIOD:
                self.done = True  # no period within reach: every step is traced
            return
        self._jump(rule, last)

    def _jump(self, rule: _Rule, last: int, reused: bool = False) -> None:
        remaining = self.total - last  # steps still to sample
        # A rule read from this generation's window leaves p..2p-1 steps to trace: each position
        # of the period is traced once after the written steps and checked against the rule
        # (``_check``), so a size the rule got wrong at any position refuses the job instead of
        # passing as written. A reused rule was checked so at every position in the generation
        # it was read from, and this generation's own steps before the jump (a period and one
        # more) are every position again: it leaves 1..p, which check the state the jump grew,
        # where this generation ends within the keys at which every position was checked. One
        # that goes further (a longer prompt) leaves p..2p-1: a position's steps may change past
        # the keys seen, and only its own step there would show it.
        left = 1 if reused and self.total + rule.shift <= rule.checked else rule.period
        jump = ((remaining - left) // rule.period) * rule.period
        if jump < MAX_LAG:
            self.done = True
            return
        plan = self._plan(rule, last, jump)
        if plan is None:
            self.done = True
            return
        # No collection while the steps are written: a million new events would start several
        # (2.5 -> 0.6 s for 490 steps of the 0.83B Llama), and a cycle's storage collected
        # there would put its free among the written events.
        with gc_paused():
            self._write(rule, last, jump, plan, reused)

    def _sample_frame(self) -> Any:
        frame: Any = sys._getframe(1)
        while frame is not None and frame.f_code is not self.code:
            frame = frame.f_back
        return frame

    def _plan(self, rule: _Rule, last: int, jump: int) -> Optional[Dict[str, Any]]:
        """What the jump changes, checked before anything is written: None when the loop's live
        state is not all accounted for."""
        tracker, blocks = self.tracker, self.tracker.blocks
        frame = self._sample_frame()
        if frame is None:
            return None
        # Only the two names read below. Before Python 3.13, ``frame.f_locals`` is a snapshot
        # dict kept on the frame, holding every local of ``_sample`` as it is now (the step's
        # logits, scores, tokens) until ``_sample`` returns: those tensors would not be freed
        # when the next step rebinds them, and the traced steps after the jump would differ
        # from the rule. Clearing the snapshot drops those references; the frame's own locals
        # are untouched (a later read fills it again).
        snapshot = frame.f_locals
        names = {key: snapshot.get(key) for key in ("input_ids", "model_kwargs")}
        if sys.version_info < (3, 13):
            snapshot.clear()
        del snapshot
        # The live blocks the loop made: each must be one the rule frees within MAX_LAG steps.
        live: Dict[int, Tuple[Any, Any]] = {}
        for storage, block in list(blocks.storages.items()):
            if block is not None and block.nbytes >= 0 and block.ident in self.where:
                live[block.ident] = (storage, block)
        survivors = []
        for ident, (storage, block) in live.items():
            made, position = self.where[ident]
            if made < 2 or last - made >= MAX_LAG:
                return None  # made before the regular steps, or kept longer than a step frees
            target = made + jump
            size = rule.numbers(target)[self._number_index(rule, target, position)]
            survivors.append((ident, storage, block, target, position, size))
        for j in range(last + 1, last + MAX_LAG + 1):  # what the written steps free of the traced
            for entry in rule.shape(j):
                if entry[0] == FREE and entry[1] is not None and j - entry[1] <= last and \
                        self.steps[j - entry[1]].ids[entry[2]] not in live:
                    return None
        # The state the loop reads after the jump: it must grow to the written size.
        state: List[torch.Tensor] = _tensors_in(names.get("input_ids"))
        kwargs = names.get("model_kwargs")
        if isinstance(kwargs, dict):
            state += [t for key, v in kwargs.items() if key != "past_key_values"
                      for t in _tensors_in(v)]
        for layer in getattr(self.cache, "layers", ()):
            state += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                      if isinstance(t, torch.Tensor)]
        by_storage = {id(s[1]): s for s in survivors}
        grows = []
        for tensor in state:
            try:
                found = by_storage.get(id(tensor.untyped_storage()))
            except (RuntimeError, NotImplementedError):
                return None
            if found is None:
                continue  # made before the loop and never replaced: the same at every step
            ident, storage, block, target, position, size = found
            if size == block.nbytes:
                continue
            shape = self._grown_shape(tensor, block.nbytes, size, rule, target - jump, position)
            if shape is None:
                return None
            values = tracker.shadow(tensor)
            if values is not None:
                values = _extended(values, shape)
                if values is None:
                    return None
            grows.append((tensor, shape, values))
        return {"survivors": survivors, "grows": grows}

    def _number_index(self, rule: _Rule, step: int, position: int) -> int:
        """Where the size of allocation ``position`` sits among a step's numbers."""
        seen, index = 0, 0
        for entry in rule.shape(step):
            if entry[0] == ALLOC:
                if seen == position:
                    return index
                seen += 1
                index += 1
            elif entry[0] == "mark":
                index += len(entry[1]) - 1
        raise AssertionError(f"no allocation {position} in step {step}")

    def _grown_shape(self, tensor: torch.Tensor, before: int, after: int, rule: _Rule,
                     made: int, position: int) -> Optional[Tuple[int, ...]]:
        """The shape of a state tensor that grows from ``before`` to ``after`` bytes: one
        dimension grows by one slice a step (the slice is the step's growth)."""
        if tensor.storage_offset() != 0 or not tensor.is_contiguous() or \
                tensor.numel() * tensor.element_size() != before:
            return None
        p = rule.period
        per_period = rule.numbers(made + p)[self._number_index(rule, made + p, position)] - before
        dims = [d for d, n in enumerate(tensor.shape)
                if n > 0 and before % n == 0 and per_period == p * (before // n)]
        if len(dims) != 1:
            return None
        slice_bytes = before // tensor.shape[dims[0]]
        if (after - before) % slice_bytes:
            return None
        shape = list(tensor.shape)
        shape[dims[0]] += (after - before) // slice_bytes
        return tuple(shape)

    def _write(self, rule: _Rule, last: int, jump: int, plan: Dict[str, Any],
               reused: bool) -> None:
        self.writing = True
        tracker, blocks = self.tracker, self.tracker.blocks
        events = tracker.trace.events
        ids: Dict[int, List[int]] = {}
        made_at: Dict[int, int] = {}  # id -> its Alloc's index in the trace

        # Each position of the period compiled once: (kind, what the event needs).
        compiled: Dict[int, List[Tuple[int, Any]]] = {}
        for j in range(last + 1, min(last + jump, last + rule.period) + 1):
            ops: List[Tuple[int, Any]] = []
            for entry in rule.shape(j):
                if entry[0] == ALLOC:
                    ops.append((0, (entry[1:], entry[3] == "forward")))
                elif entry[0] == FREE:
                    ops.append((1, (entry[1], entry[2])))
                elif entry[0] == "mark":
                    ops.append((2, entry[1]))
                else:
                    ops.append((3, None))
            compiled[j % rule.period] = ops
        sizes: Dict[int, int] = {}
        real = {s[0]: int(s[2].nbytes) for s in plan["survivors"]}
        traced_ids = {step: self.steps[step].ids for step in range(last - MAX_LAG + 1, last + 1)
                      if step in self.steps}
        append, make, where = events.append, tuple.__new__, self.where
        next_id, live, peak, forward = (blocks.next_id, blocks.live_bytes, blocks.peak_live_bytes,
                                        blocks.forward_allocations)
        kept_from = last + jump - MAX_LAG  # allocations the traced steps after the jump free
        for j in range(last + 1, last + jump + 1):
            numbers = iter(rule.numbers(j))
            mine: List[int] = []
            ids[j] = mine
            for kind, what in compiled[j % rule.period]:
                if kind == 0:
                    tail, is_forward = what
                    size = next(numbers)
                    if j > kept_from:
                        where[next_id] = (j, len(mine))
                        made_at[next_id] = len(events)
                    append(make(Alloc, (ALLOC, next_id, size) + tail))
                    mine.append(next_id)
                    sizes[next_id] = size
                    next_id += 1
                    live += size
                    if live > peak:
                        peak = live
                    if is_forward:
                        forward += 1
                elif kind == 1:
                    step = j - what[0]
                    freed = (ids[step] if step > last else traced_ids[step])[what[1]]
                    append(make(Free, (FREE, freed)))
                    size = sizes.pop(freed, -1)
                    live -= size if size >= 0 else real[freed]
                elif kind == 2:
                    label = "".join(part + (str(next(numbers)) if k < len(what) - 1 else "")
                                    for k, part in enumerate(what))
                    append(Mark("mark", label))
                else:
                    append(EmptyCache("empty_cache"))
        blocks.next_id, blocks.live_bytes, blocks.peak_live_bytes = next_id, live, peak
        blocks.forward_allocations = forward
        # The loop's live blocks take the identity of their counterparts `jump` steps on.
        for ident, _storage, block, target, position, size in plan["survivors"]:
            new = ids[target][position]
            blocks.refs[new] = blocks.refs.pop(ident, None)
            block.ident, block.nbytes, block.event = new, size, made_at[new]
        for tensor, shape, values in plan["grows"]:
            self._grow(tensor, shape, values)
        self.state.steps += jump
        if reused:
            tracker.trace.note(
                NoteKind.MODELLED, f"text generation: sampling steps {last + 1} to {last + jump} "
                f"of {self.total} written from an earlier generation's rule (period "
                f"{rule.period}): steps {rule.start} to {last} were traced and are what it gives "
                f"for their number of keys; the steps after them are traced and match it",
                key="generation-steps-reused")
        else:
            tracker.trace.note(
                NoteKind.MODELLED, f"text generation: sampling steps {last + 1} to {last + jump} "
                f"of {self.total} written from the traced ones: from step {rule.start} on, the "
                f"steps repeat every {rule.period} with sizes growing by the same bytes each "
                f"period (traced steps {rule.start} to {rule.last}); the steps after them are "
                f"traced and match that rule", key="generation-steps")
        self.rule = rule
        self.jumped_to = last + jump + 1
        self.traced = last
        self.heads.extend([len(events)] * jump)

    def _grow(self, tensor: torch.Tensor, shape: Tuple[int, ...], values: Any) -> None:
        """Give a state tensor the written size in place: a fake storage of that size, tracked
        under the tensor's (relabelled) block; the old storage leaves the tracker."""
        tracker, blocks = self.tracker, self.tracker.blocks
        old = tensor.untyped_storage()
        block = blocks.storages[old]
        # The old storage leaves first: its weakref goes (so its death frees nothing; its
        # callback, which frees the block, moves to the new storage) and it maps to a copy of
        # the block, already freed.
        callback = blocks.refs.pop(block.ident).__callback__
        freed = copy.copy(block)
        freed.nbytes, freed.event = -1, -1
        blocks.storages[old] = freed
        with _disable_current_modes():
            grown = tensor.new_empty(shape)
            storage = grown.untyped_storage()
            # set_ from the tensor, not its storage: fake mode's dispatch cache would keep a
            # storage argument (and so the block) alive (torch/_subclasses/fake_tensor.py,
            # _DispatchCacheKey holds the op's arguments; measured with torch 2.15)
            tensor.set_(grown)
        blocks.storages[storage] = block
        blocks.refs[block.ident] = weakref.ref(storage, callback)
        if values is not None:
            tracker._shadows[tensor] = values


def _extended(values: torch.Tensor, shape: Tuple[int, ...]) -> Optional[torch.Tensor]:
    """Known values grown to ``shape`` along the one dimension that differs, each new slice the
    last one plus the step between the last slices, where the last three slices take equal
    steps (the stand-in token and a mask's ones repeat; position ids grow by one a step).
    Boolean values repeat their last slice, where the last two are equal."""
    dims = [d for d, (a, b) in enumerate(zip(values.shape, shape)) if a != b]
    if len(dims) != 1:
        return None
    d = dims[0]
    length, more = values.shape[d], shape[d] - values.shape[d]
    with _disable_current_modes():
        last = values.narrow(d, length - 1, 1)
        if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
            if length < 2 or not bool((values.narrow(d, length - 2, 1) == last).all()):
                return None
            step = torch.zeros_like(last)
        else:
            if length < 3:
                return None
            step = last - values.narrow(d, length - 2, 1)
            if not bool((values.narrow(d, length - 2, 1) - values.narrow(d, length - 3, 1)
                         == step).all()):
                return None
        counts = torch.arange(1, more + 1, dtype=values.dtype).reshape(
            [more if k == d else 1 for k in range(values.dim())])
        return torch.cat([values, last + step * counts], dim=d)


# -- when a loop may jump ---------------------------------------------------------------------

def loop_for(tracker: Any, state: Any, real_sample: Any, model: Any, args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Optional[Loop]:
    """A ``Loop`` for this ``_sample`` call when every part of it is one the rule covers."""
    if not enabled():
        return None
    try:
        bound = inspect.signature(real_sample).bind(model, *args, **kwargs)
    except TypeError:
        return None
    values = bound.arguments
    extra = values.get("model_kwargs") or {}
    if values.get("synced_gpus") or values.get("streamer") is not None:
        return None
    for name in ("logits_processor", "stopping_criteria"):
        if any(type(item).__name__ not in STATELESS
               or not type(item).__module__.startswith("transformers.generation.")
               for item in values.get(name) or ()):
            return None
    config = values.get("generation_config")
    if getattr(config, "is_assistant", False):
        return None
    cache = extra.get("past_key_values")
    if type(cache).__name__ != "DynamicCache" or getattr(cache, "offloading", False) or any(
            type(layer).__name__ != "DynamicLayer" for layer in getattr(cache, "layers", [None])):
        return None
    input_ids = values.get("input_ids")
    max_length = getattr(values.get("stopping_criteria"), "max_length", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or \
            not isinstance(max_length, int):
        return None
    total = max_length - int(input_ids.shape[-1])
    if total <= WINDOW + 4:
        return None
    return Loop(tracker, state, real_sample.__code__, int(input_ids.shape[-1]), total, cache)
