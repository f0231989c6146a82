"""Trace format v2: every allocation names the nn.Module that made it and the op."""

from __future__ import annotations

import json

import pytest

from xmem_admission.contract.errors import TraceError
from xmem_admission.estimator.trace import ALLOC, RECOMPUTED, Trace


def allocs(trace, phase=None):
    return [e for e in trace.events if e.op == ALLOC and (phase is None or e.phase == phase)]


def test_forward_allocations_name_the_module_running_and_the_op(probe_run, script):
    result, _ = probe_run([script("tiny_mlp.py"), "--batch", "16", "--hidden", "64"], "fake")
    forward = allocs(result.trace, "forward")
    # Sequential(Linear, GELU, Dropout, Linear): the first Linear's output is made by addmm
    first = [e for e in forward if e.module == "Sequential.0"]
    assert first and {e.source for e in first} == {"aten.addmm"}
    assert first[0].size == 16 * 4 * 64 * 4
    assert any(e.module == "Sequential.1" and e.source == "aten.gelu" for e in forward)


def test_backward_allocations_belong_to_the_forward_module_whose_node_makes_them(
        probe_run, script):
    result, _ = probe_run([script("tiny_mlp.py"), "--batch", "16", "--hidden", "64"], "fake")
    backward = allocs(result.trace, "backward")
    modules = {e.module for e in backward}
    assert "(backward)" not in modules
    # the first Linear's weight gradient (256 x 64 fp32) is made by its own node's mm
    grads = [e for e in backward if e.category == "gradient" and e.module == "Sequential.0"]
    assert {e.size for e in grads} == {256 * 64 * 4, 256 * 4}
    assert any(e.module == "Sequential.1" and e.source == "aten.gelu_backward"
               for e in backward)


def test_parameters_and_optimizer_state_carry_their_modules(probe_run, script):
    result, _ = probe_run([script("tiny_mlp.py"), "--batch", "16", "--hidden", "64"], "fake")
    params = {e.module for e in allocs(result.trace) if e.category == "parameter"}
    assert params == {"Sequential.0", "Sequential.3"}
    state = [e for e in allocs(result.trace, "optimizer") if e.category == "optimizer_state"]
    # AdamW's exp_avg and exp_avg_sq of the first weight: the same module as the weight
    assert sum(1 for e in state if e.module == "Sequential.0" and e.size == 256 * 64 * 4) == 2


def test_checkpoint_recomputation_is_labelled_as_such(probe_run, script):
    result, _ = probe_run([script("amp_checkpoint.py"), "--grad-ckpt"], "fake")
    recomputed = [e for e in allocs(result.trace, "backward") if e.module.endswith(RECOMPUTED)]
    assert recomputed, "no allocation was labelled as checkpoint recomputation"
    assert {e.module for e in recomputed} <= {f"Sequential.{i}.net{suffix}{RECOMPUTED}"
                                              for i in (0, 1) for suffix in ("", ".0", ".1",
                                                                             ".2")}


def test_a_version_2_trace_round_trips_with_modules_and_ops(tmp_path):
    trace = Trace(meta={"tool": "test"})
    trace.alloc(1, 4096, 0, "activation", "forward", "GPT.blocks.0.mlp", "aten.mm")
    trace.alloc(2, 512, 0, "activation", "forward", "GPT.blocks.0.mlp", "aten.mm")
    trace.mark("step 1")
    trace.free(1)
    path = tmp_path / "t.json"
    trace.dump(str(path))
    data = json.loads(path.read_text())
    assert data["version"] == 2 and len(data["sites"]) == 1
    loaded = Trace.load(str(path))
    assert loaded.events == trace.events
    assert loaded.events[0].module == "GPT.blocks.0.mlp" and loaded.events[0].source == "aten.mm"


def test_a_version_1_trace_still_loads_without_modules(tmp_path):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"format": "xmem-trace", "version": 1, "meta": {},
                                "events": [["alloc", 1, 4096, 0, "activation", "forward"],
                                           ["free", 1]]}))
    loaded = Trace.load(str(path))
    assert loaded.events[0].category == "activation" and loaded.events[0].module == ""


def test_a_version_2_allocation_naming_a_missing_site_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "xmem-trace", "version": 2, "meta": {},
                                "sites": [["activation", "forward", "M", "aten.mm"]],
                                "events": [["alloc", 1, 4096, 0, 3]]}))
    with pytest.raises(TraceError, match="event 0: site must index 'sites'"):
        Trace.load(str(path))
