"""bench/convolution/conv_workspaces.py: the convolution shapes are rebuilt exactly from the probe's marks
(stride and padding included), the comparison with the workspace rule counts what it says, and
bad input is a clear error."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "convolution" / "conv_workspaces.py"
_spec = importlib.util.spec_from_file_location("conv_workspaces", SCRIPT)
cw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cw)


def shape(x, w, y, b=4):
    return {"x": x, "w": w, "y": y, "g": 1, "b": b}


@pytest.mark.parametrize("x, w, y, stride, padding", [
    ([30, 46, 21, 21], [58, 46, 3, 3], [30, 58, 11, 11], [2, 2], [1, 1]),
    ([8, 3, 32, 32], [16, 3, 3, 3], [8, 16, 32, 32], [1, 1], [1, 1]),
    ([34, 204, 11, 11], [235, 204, 1, 1], [34, 235, 6, 6], [2, 2], [0, 0]),
    ([2, 3, 224, 224], [64, 3, 7, 7], [2, 64, 112, 112], [2, 2], [3, 3]),  # a ResNet stem
])
def test_stride_and_padding_give_the_shape_s_output_and_torch_agrees(x, w, y, stride, padding):
    assert cw.geometry(shape(x, w, y)) == (stride, padding)
    out = torch.nn.functional.conv2d(torch.zeros([2] + x[1:]), torch.zeros(w),
                                     stride=stride, padding=padding)
    assert list(out.shape[1:]) == y[1:]


def test_a_shape_no_convolution_makes_is_refused():
    with pytest.raises(ValueError, match="no stride and padding"):
        cw.geometry(shape([1, 3, 8, 8], [4, 3, 3, 3], [1, 4, 20, 20]))


def test_measuring_on_the_cpu_runs_every_call_and_records_nothing():
    held = cw.measure_shape(torch, shape([2, 3, 9, 9], [4, 3, 3, 3], [2, 4, 5, 5]), "cpu")
    assert held == {"fwd": [None, None], "bwd_data": [None, None], "bwd_filter": [None, None]}


def test_shapes_are_the_distinct_convolutions_of_the_traces_without_the_summary_pass(tmp_path):
    def trace(name, marks):
        events = [["mark", m] for m in marks] + [["alloc", 1, 512, 0, "activation", "forward"]]
        (tmp_path / f"{name}.json").write_text(json.dumps({"trace": {"events": events}}))

    trace("row-a", ["cudnn:fwd x=2,3,8,8 w=4,3,3,3 y=2,4,8,8 g=1 b=4",  # torchsummary's pass
                    "cudnn:fwd x=16,3,8,8 w=4,3,3,3 y=16,4,8,8 g=1 b=4",
                    "cudnn:bwd_data+bwd_filter x=16,3,8,8 w=4,3,3,3 y=16,4,8,8 g=1 b=4"])
    trace("row-b", ["cudnn:fwd x=16,3,8,8 w=4,3,3,3 y=16,4,8,8 g=1 b=4",
                    "cudnn:fwd x=16,4,8,8 w=4,4,3,3 y=16,4,8,8 g=1 b=4",
                    "cudnn:fwd x=512,64,64,64 w=64,64,3,3 y=512,64,64,64 g=1 b=4"])  # too big
    shapes = cw.make_shapes(tmp_path, count=10, max_basis=2**20)
    assert [(s["x"], s["row"]) for s in shapes] == [([16, 3, 8, 8], "row-a"),
                                                    ([16, 4, 8, 8], "row-b")]


def measured(ws, capability=(8, 0)):
    rows = []
    for i, (x, y, w) in enumerate([(1000, 1000, 48), (4000, 2000, 96)]):
        basis = (x + y + w)
        rows.append({"schema": cw.SCHEMA, "gpu_name": "A GPU", "cudnn_version": 91000,
                     "compute_capability": list(capability), "index": i,
                     "shape": shape([1, x // 4, 1, 1], [w // 4, 1, 1, 1], [1, y // 4, 1, 1]),
                     "held_bytes": {c: [int(ws[c] * basis)] * 2 for c in cw.CALLS}})
    return rows


def test_the_comparison_counts_shapes_the_rule_puts_below_the_measurement():
    # The compute capability 8.0 rule: 1.5 x (input + output + weight) for every call.
    table, summary = cw.compare(measured({"fwd": 2.0, "bwd_data": 1.0, "bwd_filter": 0.0}))
    calls = summary["calls"]
    assert calls["fwd"]["rule_under"] == 2 and calls["bwd_data"]["rule_under"] == 0
    assert calls["bwd_filter"]["zero"] == 2
    assert calls["fwd"]["median_ratio"] == pytest.approx(2.0, rel=1e-3)
    assert "| fwd | 2.000 |" in table and "| 100% |" in table


def test_an_architecture_without_a_rule_gets_the_ratios_and_says_so():
    table, summary = cw.compare(measured({"fwd": 0.5, "bwd_data": 0.5, "bwd_filter": 0.5},
                                         capability=(9, 0)))
    assert summary["calls"]["fwd"]["rule_under"] is None
    assert "no rule" in table and "none for this architecture" in table


@pytest.mark.parametrize("line, message", [
    ('{"x": [1, 2, 3], "w": [1, 1, 1, 1], "y": [1, 1, 1, 1], "b": 4}', "'x' must be four"),
    ('{"x": [1, 1, 1, 1], "w": [1, 1, 1, 1], "y": [1, 1, 1, 1], "b": 8}', "'b' must be 2"),
])
def test_a_bad_shapes_file_is_a_clear_error_with_the_line(tmp_path, line, message):
    bad = tmp_path / "shapes.jsonl"
    bad.write_text("\n" + line + "\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--shapes", str(bad),
                           "--out", str(tmp_path / "out.jsonl")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"{bad}:2: {message}" in proc.stderr


def test_measuring_without_a_gpu_says_so():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--measure", "--limit", "1", "--out",
                           "/dev/null"], capture_output=True, text=True)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr


def test_the_comparison_holds_the_measurement_against_cudnns_own_first_plan(deviceless_cudnn):
    from xmem_admission.contract.cudnn import ConvCall
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator import cudnn_heuristics as ch

    the_shape = shape([30, 46, 21, 21], [58, 46, 3, 3], [30, 58, 11, 11])
    conv = ch.Convolution(batch=30, in_channels=46, height=21, width=21, out_channels=58,
                          kernel=(3, 3), stride=(2, 2), padding=(1, 1))
    first = {call: ch.torch_workspaces(lookup("H200"), conv, ConvCall(call),
                                       library=deviceless_cudnn)[0] for call in cw.CALLS}
    held = {"fwd": -(-first["fwd"] // 512) * 512,  # what the allocator counts for it
            "bwd_data": 2 * first["bwd_data"] + 4096, "bwd_filter": 0}
    row = {"schema": cw.SCHEMA, "gpu_name": "NVIDIA H200", "cudnn_version": 92400,
           "compute_capability": [9, 0], "allow_tf32": True, "cudnn_benchmark": False,
           "index": 0, "shape": the_shape, "held_bytes": {c: [held[c]] * 2 for c in cw.CALLS}}
    table, summary = cw.compare([row])
    calls = summary["heuristics"]["calls"]
    assert summary["heuristics"]["gpu"] == "H200"
    assert calls["fwd"]["equal"] == 1 and calls["fwd"]["below"] == 0
    assert calls["bwd_data"]["equal"] == 0 and calls["bwd_data"]["below"] == 1
    assert "cuDNN's heuristics for the catalogue's H200" in table


def test_a_benchmarking_run_or_an_unknown_gpu_gets_no_heuristics_comparison():
    rows = measured({"fwd": 1.0, "bwd_data": 1.0, "bwd_filter": 1.0})
    assert "heuristics" not in cw.compare(rows)[1]  # "A GPU" is no catalogue entry
    rows = [dict(r, gpu_name="NVIDIA H200", cudnn_benchmark=True) for r in rows]
    assert "heuristics" not in cw.compare(rows)[1]


def test_a_workspace_in_a_fresh_segment_is_measured_as_the_whole_block():
    # 16,365,568 bytes (over 10 MiB) get a 16 MiB segment; 411,648 bytes would be left, not more
    # than 1 MiB, so the large pool does not split it: the call holds 16,777,216 bytes.
    the_shape = shape([8, 3, 56, 56], [111, 3, 3, 3], [8, 111, 56, 56])
    held = cw.held_by_measurement(the_shape, {"fwd": 16365568, "bwd_data": 0,
                                              "bwd_filter": 3 * 2**20 + 100})
    assert held["fwd"] == [16 * 2**20, 16 * 2**20]
    assert held["bwd_data"] == [0, 0]
    # below 10 MiB: a 20 MiB segment, split; the request rounded to 512 bytes
    assert held["bwd_filter"] == [3 * 2**20 + 512] * 2


def test_the_comparison_finds_the_later_plan_the_device_ran(deviceless_cudnn):
    from xmem_admission.contract.cudnn import ConvCall
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator import cudnn_heuristics as ch

    the_shape = shape([8, 120, 64, 64], [179, 120, 3, 3], [8, 179, 64, 64])
    conv = cw.convolution(dict(the_shape, s=[1, 1], p=[1, 1]))
    plans = {call: ch.torch_workspaces(lookup("H200"), conv, ConvCall(call),
                                       library=deviceless_cudnn) for call in cw.CALLS}
    later = next(i for i, w in enumerate(plans["bwd_filter"])
                 if w != plans["bwd_filter"][0] and w > 0)
    chosen = {"fwd": plans["fwd"][0], "bwd_data": plans["bwd_data"][0],
              "bwd_filter": plans["bwd_filter"][later]}
    held = cw.held_by_measurement(the_shape, chosen)
    row = {"schema": cw.SCHEMA, "gpu_name": "NVIDIA H200", "cudnn_version": 92400,
           "compute_capability": [9, 0], "allow_tf32": True, "cudnn_benchmark": False,
           "index": 0, "shape": dict(the_shape, s=[1, 1], p=[1, 1]),
           "held_bytes": dict(held, bwd_data=[held["bwd_data"][0] + 7 * 2**20] * 2)}
    calls = cw.compare([row], deviceless_cudnn)[1]["heuristics"]["calls"]
    assert calls["fwd"]["equal"] == 1
    assert calls["bwd_data"]["none"] == 1
    assert calls["bwd_filter"]["later"] == 1 and calls["bwd_filter"]["later_places"][0] <= later
