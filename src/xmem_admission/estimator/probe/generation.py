"""Text generation in fake mode: every sampled token is a known stand-in, never an end token.

A generation loop (transformers' ``GenerationMixin._sample``, behind ``model.generate`` and
TRL's GRPO and online trainers) samples each next token from the model's scores and stops early
when every sequence has produced an end token. Fake execution has no scores, so it has no
sampled tokens: what a step of the loop does next, and what the script does with the text, are
values it lacks. The longest generation is the most memory (its KV cache and its outputs grow
with every token, up to ``max_new_tokens``). So in fake mode the scores the loop samples from
are given a known value that puts all the probability on one token, the stand-in: the
vocabulary's longest ordinary token (not special, not an end or padding token of the
generation). Every sequence then runs to its maximum length on known values, the completions are
known token ids, and the script can decode them: the text is the stand-in's text repeated, at
least as long as any completion of that many tokens (each token's text is at most the longest
one's). The trace notes the bound.

What the text then does:
- A reward *function* (TRL's ``reward_funcs`` as Python callables) reads it on the host; its
  values feed the advantages, whose sizes are fixed. Nothing about device memory changes.
- Text that holds a stand-in completion and is tokenized into tensors (a reward *model* scoring
  ``prompt + completion``, TRL's ``_calculate_rewards``) has a length that depends on the real
  tokens, and the stand-in's re-tokenization does not bound it (a real completion can
  re-tokenize to more tokens than it had): fake mode needs real values there, with that reason.

Patched where transformers decides: ``GenerationMixin.generate`` (which tokens end a
generation), ``LogitsProcessorList.__call__`` (the scores every sampling step reads, after the
processors), ``PreTrainedTokenizerBase.__init__`` (which tokenizers exist: the stand-in is
chosen from their vocabularies), ``decode`` and ``__call__`` (which texts hold stand-in
completions, and tensors made from them). A loop whose scores are not known this way still
never stops on an unknown value: ``StopCheck.__call__`` (transformers 5: generation/utils.py,
``bool(unfinished_sequences.max() == 0)``) and ``GenerationMixin._has_unfinished_sequences``
(4.x and 5: ``elif this_peer_finished``) answer "not finished" where the value is unknown.
``GenerationMixin._sample`` and that loop head also let ``generation_steps`` write the
sampling steps that repeat instead of tracing each one.

Python >= 3.9, standard library and torch only: the probe bundle.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from xmem_admission.estimator.probe import generation_steps
from xmem_admission.estimator.probe.distributed import _AfterImport
from xmem_admission.estimator.probe.outcomes import NeedsRealValues
from xmem_admission.estimator.probe.tracker import where_in_script
from xmem_admission.estimator.trace import NoteKind

_GENERATION = _AfterImport("transformers.generation.utils")
_LOGITS = _AfterImport("transformers.generation.logits_process")
_TOKENIZERS = _AfterImport("transformers.tokenization_utils_base")
NOTE = ("text generation: no sequence is taken to end before its maximum length (whether a "
        "sampled token ends it is a value fake mode does not have)")


class _State:
    """What one probe run knows about generation: the tokenizers made, the end tokens of the
    generations under way, the stand-in sampled, and the texts decoded from it."""

    def __init__(self) -> None:
        self.tokenizers: List[Any] = []  # weak references, in the order made
        self.ends: List[Set[int]] = []  # one set per generate() under way
        self.standin: Optional[int] = None
        self.steps = 0  # sampling steps of the latest generation
        self.texts: Set[str] = set()  # decoded texts that hold a stand-in completion
        self.chosen: Dict[Tuple[int, FrozenSet[int]], Optional[int]] = {}  # by vocab and ends
        self.loops: List[Any] = []  # one generation_steps.Loop (or None) per _sample under way
        self.rule: Any = None  # the steps' rule the latest generation followed (generation_steps)
        self.rule_prompt = 0  # and its prompt's length


def install(patches: Any, tracker: Any, fake: bool) -> None:
    """In fake mode, sample a known stand-in token and mark the texts decoded from it."""
    if not fake:
        return
    state = _State()
    for hook, patch in ((_GENERATION, _patch_generation), (_LOGITS, _patch_logits),
                        (_TOKENIZERS, _patch_tokenizers)):
        if hook.name in sys.modules:
            patch(patches, tracker, state, sys.modules[hook.name])
        else:
            hook.arm(patches, functools.partial(patch, patches, tracker, state))


# -- the generation loop ------------------------------------------------------------------------

def _token_ids(value: Any) -> Set[int]:
    """The ids in a config's ``eos_token_id``-like field: an int, a list, a tensor, or None."""
    if value is None:
        return set()
    if isinstance(value, torch.Tensor):
        with _disable_current_modes():
            value = value.tolist() if value.device.type != "meta" else []
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int)}
    return set()


def _end_tokens(model: Any, kwargs: Dict[str, Any]) -> Set[int]:
    ends: Set[int] = set()
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None),
                   getattr(model, "config", None)):
        for field in ("eos_token_id", "pad_token_id", "bos_token_id",
                      "decoder_start_token_id"):
            ends |= _token_ids(getattr(config, field, None))
    ends |= _token_ids(kwargs.get("eos_token_id")) | _token_ids(kwargs.get("pad_token_id"))
    return ends


def _patch_generation(patches: Any, tracker: Any, state: _State, module: Any) -> None:
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
    if mixin is None:
        return
    if "_has_unfinished_sequences" in vars(mixin):
        unfinished = bounded(True)(vars(mixin)["_has_unfinished_sequences"])

        def has_unfinished(self: Any, *args: Any, **kwargs: Any) -> Any:
            more = unfinished(self, *args, **kwargs)
            loop = state.loops[-1] if state.loops else None
            if loop is not None:  # a loop head: the sampling step before it has ended
                loop.head(bool(more))
            return more

        patches.set(mixin, "_has_unfinished_sequences", has_unfinished)
    if "_sample" in vars(mixin):
        real_sample = vars(mixin)["_sample"]

        def sample(self: Any, *args: Any, **kwargs: Any) -> Any:
            state.loops.append(generation_steps.loop_for(tracker, state, real_sample, self, args,
                                                         kwargs))
            try:
                return real_sample(self, *args, **kwargs)
            finally:
                state.loops.pop()

        patches.set(mixin, "_sample", sample)
    if "generate" in vars(mixin):
        real_generate = vars(mixin)["generate"]

        def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
            state.ends.append(_end_tokens(self, kwargs))
            state.steps = 0
            try:
                return real_generate(self, *args, **kwargs)
            finally:
                state.ends.pop()

        patches.set(mixin, "generate", generate)


def _patch_logits(patches: Any, tracker: Any, state: _State, module: Any) -> None:
    cls = getattr(module, "LogitsProcessorList", None)
    if cls is None or "__call__" not in vars(cls):
        return
    real_call = vars(cls)["__call__"]

    def call(self: Any, input_ids: Any, scores: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_call(self, input_ids, scores, *args, **kwargs)
        if not state.ends or not isinstance(out, torch.Tensor) or out.dim() == 0 \
                or tracker.shadow(out) is not None:
            return out
        vocab, ends = int(out.shape[-1]), frozenset().union(*state.ends)
        token = state.chosen.get((vocab, ends), -1)
        if token == -1:  # read the vocabularies once per generation's shape
            token = state.chosen[(vocab, ends)] = _standin(state, vocab, ends)
        if token is None:
            return out
        with _disable_current_modes():
            known = torch.full(tuple(out.shape), float("-inf"), dtype=out.dtype)
            known[..., token] = 0.0
        tracker._shadows[out] = known
        state.standin, state.steps = token, state.steps + 1
        tracker.trace.note(
            NoteKind.BOUNDED, f"text generation: every sampled token is taken to be token "
            f"{token}{_text_of(state, token)}, the vocabulary's longest ordinary one and never "
            f"an end token: every sequence runs to its maximum length (the sampled tokens are "
            f"values fake mode does not have)", key="generation")
        return out

    patches.set(cls, "__call__", call)


def _live_tokenizers(state: _State) -> Iterator[Any]:
    for ref in state.tokenizers:
        tokenizer = ref()
        if tokenizer is not None:
            yield tokenizer


def _standin(state: _State, vocab: int, ends: FrozenSet[int]) -> Optional[int]:
    """The token every sampling step takes: the longest ordinary token of the first tokenizer
    that fits the model's vocabulary, or without one the lowest id that ends nothing."""
    for tokenizer in _live_tokenizers(state):
        try:
            size = len(tokenizer)
            if size > vocab:
                continue
            special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
            ordinary = [(len(text), -index) for text, index in tokenizer.get_vocab().items()
                        if 0 <= index < vocab and index not in special and index not in ends]
        except Exception:  # a tokenizer without a vocabulary to read (a processor)
            continue
        if ordinary:
            return -int(max(ordinary)[1])
    return next((i for i in range(vocab) if i not in ends), None)


def _text_of(state: _State, token: int) -> str:
    for tokenizer in _live_tokenizers(state):
        try:
            return f" ({tokenizer.convert_ids_to_tokens(token)!r})"
        except Exception:
            continue
    return ""


# -- texts decoded from the stand-in ------------------------------------------------------------

def _sequences(ids: Any, tracker: Any) -> Optional[List[List[int]]]:
    """``decode``'s token ids as lists of ints, one per sequence, where they are known."""
    if isinstance(ids, torch.Tensor):
        real = tracker.shadow(ids)
        if real is None:
            return None
        with _disable_current_modes():
            ids = real.tolist()
    if isinstance(ids, int):
        return [[ids]]
    if not isinstance(ids, (list, tuple)):
        ids = getattr(ids, "tolist", lambda: None)()  # a numpy array
        if not isinstance(ids, list):
            return None
    if ids and isinstance(ids[0], (list, tuple)):
        return [list(seq) for seq in ids]
    return [list(ids)]


def _holds_completion(seq: List[int], token: int, steps: int) -> bool:
    run = 0
    for value in seq:
        run = run + 1 if value == token else 0
        if run >= steps:
            return True
    return False


def _texts_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts_in(item)


def _patch_tokenizers(patches: Any, tracker: Any, state: _State, module: Any) -> None:
    base = getattr(module, "PreTrainedTokenizerBase", None)
    if base is None:
        return
    methods = vars(base)
    if "__init__" in methods:
        real_init = methods["__init__"]

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            real_init(self, *args, **kwargs)
            if not any(ref() is self for ref in state.tokenizers):
                state.tokenizers.append(weakref.ref(self))

        patches.set(base, "__init__", init)
    if "decode" in methods:
        real_decode = methods["decode"]

        def decode(self: Any, token_ids: Any, *args: Any, **kwargs: Any) -> Any:
            text = real_decode(self, token_ids, *args, **kwargs)
            if state.standin is None:
                return text
            sequences = _sequences(token_ids, tracker)
            texts = text if isinstance(text, list) else [text]
            if sequences is not None and len(sequences) == len(texts):
                for seq, one in zip(sequences, texts):
                    if one and _holds_completion(seq, state.standin, max(1, state.steps)):
                        state.texts.add(one)
            return text

        patches.set(base, "decode", decode)
    if "__call__" in methods:
        real_tokenize = methods["__call__"]

        def tokenize(self: Any, *args: Any, **kwargs: Any) -> Any:
            if state.texts and kwargs.get("return_tensors") is not None:
                _refuse_standin_tensors(state, args, kwargs)
            return real_tokenize(self, *args, **kwargs)

        patches.set(base, "__call__", tokenize)


def _refuse_standin_tensors(state: _State, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        for text in _texts_in(value):
            if any(standin in text for standin in state.texts):
                raise NeedsRealValues(
                    f"the script tokenizes generated text into tensors at {where_in_script()} "
                    f"(a reward model scoring completions): their length depends on the "
                    f"sampled tokens, which fake mode does not have, and the stand-in text "
                    f"does not bound it")
