"""A view of a GPU tensor allocates nothing, whatever size the traced torch's fake storage says.

torch 2.3's fake mode reports a view's extent as its storage's size (``blocks.
views_resize_storages``): BERT's embeddings, slicing their position and token-type buffers,
looked like two resized buffers there, each freed and made again as an activation of the
slice's size (the conformance corpus's accelerate script, `make compat`'s 2.3.1 rows)."""

from __future__ import annotations

from tests.estimator.trace_counts import live_by_category_at
from xmem_admission.estimator.trace import ALLOC

POSITIONS = 128


def test_slicing_a_models_buffers_keeps_them_model_state_and_allocates_nothing(probe_run, script):
    result, _ = probe_run([script("sliced_buffers.py"), "--positions", str(POSITIONS)], "fake")
    assert result.status == "ok", result.reason
    slices = [e for e in result.trace.events if e.op == ALLOC and e.source == "aten.slice"]
    assert slices == []
    hidden = 32
    weights = (100 + POSITIONS + 2) * hidden * 4 + (hidden * 3 + 3) * 4
    buffers = 2 * POSITIONS * 8  # position_ids and token_type_ids, int64
    assert live_by_category_at(result.trace, "step 2")["parameter"] == weights + buffers
