"""Text generation in fake mode runs every sequence to its maximum length: whether a sampled
token ends a sequence early is a value fake mode lacks, and the longest generation is the most
memory; the trace says it is a bound, and the loop ends at the maximum length."""

from __future__ import annotations

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
    assert note["message"].startswith("text generation: no sequence is taken to end before")
    assert result.trace.upper_bound
