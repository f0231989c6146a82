"""Text generation in fake mode: every sequence runs to its maximum length.

A generation loop (transformers' ``GenerationMixin._sample``, behind ``model.generate`` and
TRL's GRPO and online trainers) stops early when every sequence has produced its end token: a
decision on the values of the sampled tokens, which fake execution does not have. Taking no
sequence to end early is the largest the generation can be (its KV cache and its outputs grow
with every token, up to ``max_new_tokens``): the loop's stopping check answers "not finished"
where the value is unknown, and the trace notes the bound. The loop still ends at the maximum
length, on a known value (the maximum-length criterion marks every sequence done, and an AND with
that is known: ``tracker._absorbed``).

Patched where transformers decides: ``StopCheck.__call__`` (transformers 5:
generation/utils.py, ``bool(unfinished_sequences.max() == 0)``) and
``GenerationMixin._has_unfinished_sequences`` (4.x and 5: ``elif this_peer_finished``).

Python >= 3.9, standard library and torch only: the probe bundle.
"""

from __future__ import annotations

import sys
from typing import Any

from xmem_admission.estimator.probe.distributed import _AfterImport
from xmem_admission.estimator.probe.outcomes import NeedsRealValues
from xmem_admission.estimator.trace import NoteKind

_GENERATION = _AfterImport("transformers.generation.utils")
NOTE = ("text generation: no sequence is taken to end before its maximum length (whether a "
        "sampled token ends it is a value fake mode does not have)")


def install(patches: Any, tracker: Any, fake: bool) -> None:
    """In fake mode, answer transformers' stopping checks as "not finished" where unknown."""
    if not fake:
        return
    if _GENERATION.name in sys.modules:
        _patch(patches, tracker, sys.modules[_GENERATION.name])
    else:
        _GENERATION.arm(patches, lambda module: _patch(patches, tracker, module))


def _patch(patches: Any, tracker: Any, module: Any) -> None:
    def bounded(answer: bool) -> Any:
        def call(real: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                try:
                    return real(*args, **kwargs)
                except NeedsRealValues:
                    tracker.trace.note(NoteKind.BOUNDED, NOTE, key="generation")
                    return answer

            return wrapper

        return call

    stop_check = getattr(module, "StopCheck", None)
    if stop_check is not None and "__call__" in vars(stop_check):
        patches.set(stop_check, "__call__", bounded(False)(vars(stop_check)["__call__"]))
    mixin = getattr(module, "GenerationMixin", None)
    if mixin is not None and "_has_unfinished_sequences" in vars(mixin):
        patches.set(mixin, "_has_unfinished_sequences",
                    bounded(True)(vars(mixin)["_has_unfinished_sequences"]))
