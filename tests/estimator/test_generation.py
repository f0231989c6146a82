"""Text generation in fake mode: every sampled token is a known stand-in, the vocabulary's
longest ordinary token, never an end token. Every sequence runs to its maximum length (the most
memory: whether a sampled token ends a sequence is a value fake mode lacks), the trace says it
is a bound, and the script can decode the completions: a reward function reads text at least as
long as any completion of that many tokens. Text tokenized into tensors (a reward model scoring
completions) has a length fake mode cannot bound: it needs real values, with that reason."""

from __future__ import annotations

import re

from tests.support.torch_envs import require_module


def test_a_step_that_generates_text_is_traced_with_every_sequence_at_its_maximum_length(
        probe_run, script):
    require_module("transformers")
    result, output = probe_run([script("generates.py")])
    assert result.status == "ok", result.reason + result.traceback
    assert result.steps == 3
    # 16 prompt tokens and the 8 new ones, every time
    assert output.count("generated (4, 24)") == 3, output
    (note,) = [n for n in result.trace.notes() if n["kind"] == "bounded"]
    assert note["message"].startswith("text generation: every sampled token is taken to be token")
    assert "never an end token" in note["message"]
    assert result.trace.upper_bound


def test_completions_decode_to_text_a_reward_function_scores_in_fake_mode(probe_run, script):
    require_module("transformers")
    result, output = probe_run([script("generates_and_scores.py")])
    assert result.status == "ok", result.reason + result.traceback
    assert result.steps == 3
    longest = int(re.search(r"longest token characters (\d+)", output).group(1))
    lengths = [[int(n) for n in found.split(", ")]
               for found in re.findall(r"completion characters \[([\d, ]+)\]", output)]
    assert len(lengths) == 3, output
    # 8 new tokens each, every one the longest token's text
    assert all(n >= 8 * longest for step in lengths for n in step), (longest, lengths)
    (note,) = [n for n in result.trace.notes() if n["kind"] == "bounded"]
    assert "the vocabulary's longest ordinary one" in note["message"]


def test_a_reward_model_scoring_generated_text_needs_real_values(probe_run, script):
    require_module("transformers")
    result, _ = probe_run([script("generates_and_scores.py"), "--reward-model"])
    assert result.status == "needs_real_values", result.reason + result.traceback
    assert "tokenizes generated text into tensors" in result.reason
    assert "generates_and_scores.py" in result.reason
