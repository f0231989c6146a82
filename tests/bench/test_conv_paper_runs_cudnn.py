"""The paper bench sizes convolution workspaces as the runs' own torch would: their cuDNN 9.1.0
cannot plan without a GPU, so the fitted rule answers (none on the paper's RTX GPUs), whatever
cuDNN traced the row here."""

from __future__ import annotations

from bench.yardsticks.paper import benchmark
from tests.estimator.trace_counts import traced
from xmem_admission.contract import gpus
from xmem_admission.estimator.estimate import estimate_trace

MARK = ("cudnn:fwd x=32,64,56,56 w=64,64,3,3 y=32,64,56,56 g=1 b=4 s=1,1 p=1,1 d=1,1 cl=0"
        " dt=float32 bm=0 det=0 tf32=1")


def test_a_paper_row_is_simulated_with_the_runs_cudnn_and_takes_the_rule(deviceless_cudnn):
    trace = traced(MARK, MARK.replace("cudnn:fwd", "cudnn:bwd_data+bwd_filter"))
    trace.meta["cudnn"] = deviceless_cudnn.version  # traced here, with a cuDNN that plans
    rtx3060 = gpus.lookup("RTX-3060")
    planned = estimate_trace(trace, [rtx3060], margin=0.0)[0].conv_workspaces
    assert planned["source"] == "cudnn-heuristics"
    paper = estimate_trace(benchmark.as_paper_runs(trace), [rtx3060], margin=0.0)[0]
    assert paper.conv_workspaces["source"] != "cudnn-heuristics"
    assert paper.conv_workspaces["cudnn"] == "9.1.0"
    assert "cannot plan without a GPU" in paper.conv_workspaces["heuristics_unavailable"]


def test_a_paper_row_leaves_the_allocator_what_cuda_12_leaves_it_whatever_torch_traced_it():
    # Traced here by a torch built for CUDA 13 (its larger context and runtime figures), but
    # the runs had CUDA 12.4: the simulation's capacity and the total are CUDA 12's.
    trace = traced(MARK)
    trace.meta.update(cuda="13.0", torch="2.14.1+cu130")
    rtx3060 = gpus.lookup("RTX-3060")
    here = estimate_trace(trace, [rtx3060], margin=0.0)[0]
    paper = estimate_trace(benchmark.as_paper_runs(trace), [rtx3060], margin=0.0)[0]
    assert here.overhead["cuda_major"] == 13 and paper.overhead["cuda_major"] == 12
    assert paper.overhead_bytes < here.overhead_bytes
    assert paper.overhead["runtime"]["basis"] == "fitted"
