"""A ``torch.compile``d model is traced as eager code, and the trace says so: an upper bound
of what Inductor allocates. A mode that captures CUDA graphs is refused with the reason."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("how, name", [("default", "torch.compile(Sequential)"),
                                       ("method", "torch.compile(Module._call_impl)"),
                                       ("decorator", "torch.compile(loss_of)"),
                                       ("max-autotune-no-cudagraphs",
                                        "torch.compile(Sequential)")])
def test_a_compiled_model_is_traced_eagerly_and_the_estimate_says_it_is_an_upper_bound(
        probe_run, script, how, name):
    result, _ = probe_run([script("compiled_modes.py"), how])
    assert result.status == "ok", result.reason
    (note,) = [n for n in result.trace.notes() if n["kind"] == "compiled_eagerly"]
    assert note["message"].startswith(name), note["message"]
    assert "compiled_modes.py" in note["message"] and "traced as eager code" in note["message"]
    assert result.trace.upper_bound


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_a_mode_that_captures_cuda_graphs_is_refused_with_the_mode(probe_run, script, mode):
    result, _ = probe_run([script("compiled_modes.py"), mode])
    assert result.status == "unsupported"
    assert f"mode={mode!r}" in result.reason and "CUDA graphs" in result.reason


def test_an_uncompiled_model_is_not_an_upper_bound(probe_run, script):
    result, _ = probe_run([script("tiny_mlp.py")])
    assert result.status == "ok", result.reason
    assert result.trace.notes() == [] and not result.trace.upper_bound


def test_a_compiled_function_the_step_never_calls_says_nothing(probe_run, script):
    # libraries decorate helpers with torch.compile when imported (DeepSpeed, bitsandbytes'
    # CPU kernels): only what runs is traced, so only that is noted
    result, _ = probe_run([script("compiled_modes.py"), "unused"])
    assert result.status == "ok", result.reason
    assert result.trace.notes() == [] and not result.trace.upper_bound
