"""Host-side data pipelines run in fake mode: shuffles of any size, in-memory datasets, workers,
collate functions and tokenisation never force the fallback; a decision that does names the
value and where it came from."""

from __future__ import annotations

import pytest

from tests.estimator.trace_counts import live_by_category_at


def pipeline(probe_run, script, *args: str, steps: int = 3):
    return probe_run([script("data_pipeline.py"), *args], "fake", steps=steps)


@pytest.mark.parametrize("kind,extra", [
    ("shuffle", ["--samples", "1000000"]),
    ("mnist", ["--samples", "60000"]),
    ("tokens", []),
])
def test_a_host_data_pipeline_stays_in_fake_mode(probe_run, script, kind, extra):
    result, out = pipeline(probe_run, script, "--kind", kind, *extra)
    assert (result.status, result.mode, result.steps) == ("ok", "fake", 3), result.reason
    assert "step 1 loss 0.000" in out  # the loss is the model's: printed as 0 in fake mode
    # SGD with momentum: one buffer per parameter, live from the first step on
    live = live_by_category_at(result.trace, "step 2")
    assert live["optimizer_state"] == live["parameter"] > 0


def test_a_batch_from_host_data_reaches_the_gpu_at_its_size(probe_run, script):
    result, _ = pipeline(probe_run, script, "--kind", "shuffle", "--samples", "70000",
                         "--batch", "48")
    assert result.status == "ok", result.reason
    first_step = []
    for e in result.trace.events:
        if e.op == "mark" and e.label == "step 1":
            break
        if e.op == "alloc":
            first_step.append(e.size)
    # a 48 x 32 fp32 batch, then (in the loss) 48 int64 labels, copied to the GPU
    x, y = first_step.index(48 * 32 * 4), first_step.index(48 * 8)
    assert x < y


def test_a_decision_on_bulk_host_data_names_the_value_and_where_it_was_made(probe_run, script):
    # 20M labels: over the size up to which host blocks are real, so their values are unknown
    result, _ = pipeline(probe_run, script, "--kind", "decide_on_data", "--samples", "20000000")
    assert result.status == "needs_real_values"
    assert "decision at " in result.reason and "data_pipeline.py:" in result.reason
    assert "(if label < 0:" in result.reason
    assert "made on the host by aten.randint at" in result.reason
    assert "(self.labels = torch.randint(0, 10, (n,)))" in result.reason


def test_a_decision_on_the_loss_names_the_model_op_that_computed_it(probe_run, script):
    result, _ = pipeline(probe_run, script, "--kind", "decide_on_data", "--samples", "1000")
    assert result.status == "needs_real_values"
    assert "loss.item() < best" in result.reason
    assert result.reason.endswith("on the value of a scalar float32 tensor computed on the GPU "
                                  "by aten.nll_loss_forward (a value of the model)")
