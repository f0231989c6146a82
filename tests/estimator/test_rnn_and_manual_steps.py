"""RNN language models (LSTM, GRU, packed sequences) trace in both modes, and a hand-written SGD
update after a backward pass counts as a training step (gradient accumulation included)."""

from __future__ import annotations

import pytest

from tests.estimator.trace_counts import live_by_category_at

VOCAB, HIDDEN, LAYERS = 1000, 64, 2


def rnn_parameter_bytes(cell: str) -> int:
    """Embedding, the recurrent layers (4 gates for an LSTM, 3 for a GRU; two weight matrices
    and two biases per layer) and the decoder, fp32: from the model's definition."""
    gates = {"LSTM": 4, "GRU": 3}[cell]
    per_layer = gates * HIDDEN * (HIDDEN + HIDDEN) + 2 * gates * HIDDEN
    return 4 * (VOCAB * HIDDEN + LAYERS * per_layer + HIDDEN * VOCAB + VOCAB)


def backward_passes_before(trace, label: str) -> int:
    """How many backward passes began before the mark ``label``."""
    count, previous = 0, None
    for e in trace.events:
        if e.op == "mark" and e.label == label:
            return count
        if e.op == "alloc":
            if e.phase == "backward" and previous != "backward":
                count += 1
            previous = e.phase
    raise AssertionError(f"no mark {label!r}")


@pytest.mark.parametrize("mode", ["fake", "profile"])
@pytest.mark.parametrize("cell,packed", [("LSTM", False), ("GRU", False), ("LSTM", True)])
def test_an_rnn_language_model_with_a_hand_written_update_is_traced(
        probe_run, script, mode, cell, packed):
    args = [script("rnn_lm.py"), "--cell", cell] + (["--packed"] if packed else [])
    result, out = probe_run(args, mode, steps=3)
    assert (result.status, result.steps) == ("ok", 3), result.reason + result.traceback
    live = live_by_category_at(result.trace, "step 2")
    params = rnn_parameter_bytes(cell)
    assert live["parameter"] == params
    assert live["gradient"] == params  # zero_grad() comes after the mark: the grads are live
    assert "optimizer_state" not in live  # plain SGD keeps nothing
    # the script stops where its fourth batch begins: three updates made, no fourth
    assert "batch 2 loss" in out and "batch 3 loss" not in out


@pytest.mark.parametrize("mode", ["fake", "profile"])
def test_gradient_accumulation_without_an_optimizer_is_one_step_per_update(
        probe_run, script, mode):
    result, _ = probe_run([script("rnn_lm.py"), "--accumulate", "2"], mode, steps=2)
    assert (result.status, result.steps) == ("ok", 2), result.reason
    assert backward_passes_before(result.trace, "step 1") == 2
    assert backward_passes_before(result.trace, "step 2") == 4
