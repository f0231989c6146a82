"""Convolution workspaces from cuDNN's own heuristics in the estimate: each call carries the
workspaces PyTorch tries in order, the simulator takes the first that fits, cudnn.benchmark's
search holds its block, and the estimate says which cuDNN (or which rule) answered."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.estimator.trace_counts import traced
from xmem_admission.commands.estimate import conv_source_line
from xmem_admission.contract import cudnn, gpus
from xmem_admission.estimator import cudnn_heuristics as ch
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.conv_marks import ConvMark
from xmem_admission.estimator.estimate import estimate_trace
from xmem_admission.estimator.orchestrate import for_gpu
from xmem_admission.estimator.trace import Trace

MIB = 2**20
A100 = gpus.lookup("A100-40GB")
# a ResNet block's 3x3 convolution as the probe marks it, geometry and flags included
MARK = ("cudnn:fwd x=32,64,56,56 w=64,64,3,3 y=32,64,56,56 g=1 b=4 s=1,1 p=1,1 d=1,1 cl=0"
        " dt=float32 bm=0 det=0 tf32=1")
BACKWARD = MARK.replace("cudnn:fwd", "cudnn:bwd_data+bwd_filter")
OLD_MARK = "cudnn:fwd x=32,64,56,56 w=64,64,3,3 y=32,64,56,56 g=1 b=4"  # an older probe's mark: no geometry


def conv_allocs(trace: Trace):
    return [e for e in trace.events if e.op == "alloc" and e.phase.startswith("cudnn:")]


def test_a_call_carries_the_workspaces_torch_tries_in_cudnns_order(deviceless_cudnn):
    out = for_gpu(traced(MARK, BACKWARD), A100, env={})
    conv = ch.mark_calls(ConvMark.parse(MARK))[0][0]
    for alloc, call in zip(conv_allocs(out), list(cudnn.ConvCall)):
        expected = cudnn.tried_workspaces(ch.torch_workspaces(A100, conv, call,
                                                              library=deviceless_cudnn))
        assert alloc.phase == cudnn.plans_phase(f"cudnn:{call.value}", expected)
        assert alloc.size == expected[0] > 0
        assert expected[-1] == 0  # a plan that needs no workspace ends every list
    info = out.meta["conv_workspaces"]
    assert info["source"] == "cudnn-heuristics"
    assert info["cudnn"] == deviceless_cudnn.version_text
    assert info["planned_calls"] == 3 and info["rule_calls"] == 0
    resident, source = cudnn.heuristics_resident_bytes(A100.compute_capability)
    assert resident > 0 and "fitted" in source  # labelled as the fit it is
    assert info["resident_bytes"] == resident and info["resident_source"] == source
    held = [e for e in out.events if e.op == "alloc" and e.phase == cudnn.RESIDENT_PHASE]
    assert [e.size for e in held] == [resident]


def test_the_simulator_falls_through_to_the_first_plan_that_fits():
    def run(plans):
        t = Trace()
        t.alloc(1, 600 * MIB, category="activation", phase="forward")
        t.alloc(2, plans[0], category="workspace", phase=cudnn.plans_phase("cudnn:fwd", plans))
        t.free(2)
        return simulate(t, capacity_bytes=1024 * MIB)

    fits_second = run([900 * MIB, 300 * MIB, 0])
    assert fits_second.oom is None
    assert fits_second.peak_reserved_bytes == 900 * MIB  # 600 + the 300 MiB plan
    needs_none = run([900 * MIB, 500 * MIB, 0])
    assert needs_none.oom is None and needs_none.peak_reserved_bytes == 600 * MIB
    # no plan left: torch's "unable to find an engine", the job fails
    assert run([900 * MIB, 500 * MIB]).oom is not None


def test_only_plans_smaller_than_every_earlier_one_are_kept_up_to_the_first_zero():
    assert cudnn.tried_workspaces([5, 7, 5, 3, 4, 0, 2]) == [5, 3, 0]
    assert cudnn.later_plans(cudnn.plans_phase("cudnn:fwd", [5, 3, 0])) == [3, 0]
    assert cudnn.later_plans("cudnn:fwd") is None


def test_an_older_traces_mark_keeps_the_fitted_rule_and_says_so(deviceless_cudnn):
    out = for_gpu(traced(OLD_MARK), A100, env={})
    rule = cudnn.rule_for(A100.compute_capability)
    assert rule is not None
    phases = [(e.phase, e.size) for e in out.events if e.op == "alloc"
              and e.phase.startswith("cudnn")]
    assert phases[0] == (cudnn.RESIDENT_PHASE, rule.resident_bytes)
    assert phases[1][0] == "cudnn:fwd"
    info = out.meta["conv_workspaces"]
    assert info["source"] == "fitted-rule" and info["rule_calls"] == 1
    assert info["not_planned"] == {"a cudnn: mark without geometry and dtype (an older trace)": 1}


def _older_cudnn() -> str:
    # the torch environments of `make compat` (bench/coverage/compat.py) bring their own cuDNN; a
    # process holds one libcudnn.so.9 (the dynamic loader hands back the one already loaded),
    # so each is asked in a process of its own
    pattern = os.path.expanduser("~/.cache/xmem-admission/torch/*/lib/python*/site-packages/"
                                 "nvidia/cudnn/lib/libcudnn.so.9")
    for path in sorted(glob.glob(pattern)):
        version = subprocess.run(
            [sys.executable, "-c", "import sys; from xmem_admission.estimator import "
             "cudnn_heuristics as ch; print(ch.CudnnLibrary(sys.argv[1]).version)", path],
            capture_output=True, text=True, check=True).stdout.strip()
        if int(version) < ch.DEVICELESS_MIN_VERSION:
            return path
    pytest.skip("no cuDNN 9 older than 9.11 here (make compat's torch 2.4-2.10 environments)")


_OLDER = """
import json, sys
from xmem_admission.commands.estimate import conv_source_line
from xmem_admission.contract import gpus
from xmem_admission.estimator import cudnn_heuristics as ch
from xmem_admission.estimator.orchestrate import ConvPlanner, for_gpu
from xmem_admission.estimator.trace import Trace
gpu = gpus.lookup("A100-40GB")
t = Trace()
t.mark(sys.argv[2])
out = for_gpu(t, gpu, env={}, planner=ConvPlanner(gpu, {}, library=ch.CudnnLibrary(sys.argv[1])))
info = out.meta["conv_workspaces"]
print(json.dumps({"info": info, "line": conv_source_line(info),
                  "phases": [e.phase for e in out.events if e.op == "alloc"]}))
"""


def test_a_cudnn_older_than_9_11_leaves_the_fitted_rule_and_is_named():
    path = _older_cudnn()
    done = subprocess.run([sys.executable, "-c", _OLDER, path, MARK], capture_output=True,
                          text=True, check=True)
    answer = json.loads(done.stdout)
    info = answer["info"]
    assert info["source"] == "fitted-rule"
    assert tuple(int(p) for p in info["cudnn"].split(".")) < (9, 11, 0)
    assert "cannot plan without a GPU" in info["heuristics_unavailable"]
    assert answer["phases"] == [cudnn.RESIDENT_PHASE, "cudnn:fwd"]
    assert "the fitted rule" in answer["line"] and info["cudnn"] in answer["line"]


def test_benchmark_holds_the_search_block_once_per_shape_then_empties_the_cache(
        deviceless_cudnn):
    bench_mark = MARK.replace("bm=0", "bm=1")
    out = for_gpu(traced(bench_mark, bench_mark), A100, env={})
    ops = [(e.op, getattr(e, "phase", "").split(" ")[0]) for e in out.events
           if e.op == "empty_cache" or (e.op == "alloc" and e.phase.startswith("cudnn"))]
    assert ops == [("alloc", cudnn.RESIDENT_PHASE), ("alloc", "cudnn:benchmark-fwd"),
                   ("empty_cache", ""),
                   ("alloc", "cudnn:fwd"), ("alloc", "cudnn:fwd")]
    search = conv_allocs(out)[0]
    conv = ch.mark_calls(ConvMark.parse(bench_mark))[0][0]
    timed = ch.torch_workspaces(A100, conv, cudnn.ConvCall.FORWARD, benchmark=True,
                                library=deviceless_cudnn)
    assert search.size == max(timed)


def test_the_estimate_names_the_cudnn_that_sized_its_workspaces(deviceless_cudnn):
    result = estimate_trace(traced(MARK), [A100], env={})[0]
    assert result.conv_workspaces is not None
    assert result.to_dict()["conv_workspaces"]["source"] == "cudnn-heuristics"
    line = conv_source_line(result.conv_workspaces)
    assert f"cuDNN {deviceless_cudnn.version_text}'s own heuristics" in line
    plain = estimate_trace(traced(), [A100], env={})[0]
    assert plain.conv_workspaces is None


def test_cudnn_conv_wscap_dbg_leaves_only_plans_within_the_cap(deviceless_cudnn):
    out = for_gpu(traced(MARK), A100, env={"CUDNN_CONV_WSCAP_DBG": "1"})
    allocs = conv_allocs(out)
    assert all(size <= MIB for size in cudnn.later_plans(allocs[0].phase) or [])
    assert not allocs or allocs[0].size <= MIB


def test_planning_stops_at_the_first_plan_torch_runs_without_a_workspace(deviceless_cudnn):
    conv = ch.mark_calls(ConvMark.parse(MARK))[0][0]
    for call in cudnn.ConvCall:
        every = ch.torch_workspaces(A100, conv, call, library=deviceless_cudnn)
        short = ch.torch_workspaces(A100, conv, call, library=deviceless_cudnn,
                                    until_no_workspace=True)
        assert short == every[:every.index(0) + 1]
        assert cudnn.tried_workspaces(short) == cudnn.tried_workspaces(every)


def test_a_trace_from_a_torch_whose_cudnn_cannot_plan_takes_the_rule_wherever_it_is_simulated(
        deviceless_cudnn):
    # A trace made beside torch 2.2's cuDNN 8.9.2: the estimation pod there takes the rule, so
    # `xmem estimate --python` does too, though this process's cuDNN plans deviceless.
    old = traced(MARK)
    old.meta["cudnn"] = 8902
    info = for_gpu(old, A100, env={}).meta["conv_workspaces"]
    assert info["source"] == "fitted-rule" and info["rule_calls"] == 1
    assert info["cudnn"] == "8.9.2"
    assert "the traced torch's cuDNN 8.9.2 cannot plan without a GPU" in \
        info["heuristics_unavailable"]
    recent = traced(MARK)
    recent.meta["cudnn"] = deviceless_cudnn.version
    assert for_gpu(recent, A100, env={}).meta["conv_workspaces"]["source"] == "cudnn-heuristics"


def test_the_probe_records_its_torchs_cudnn_in_the_trace(probe_run, script):
    import torch

    result, _ = probe_run([script("tiny_cnn.py")], "fake")
    assert result.status == "ok", result.reason
    assert result.trace.meta["cudnn"] == torch.backends.cudnn.version()
