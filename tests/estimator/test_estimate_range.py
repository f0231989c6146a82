"""An estimate that knows how sure it is: each GPU's estimate carries the range its peak may take
(the convolutions' cuDNN plans the GPU picks among, sizes taken at their bound), names what
makes it wide, sizes the request on its high end and calls a job out of memory only where its
low end does not fit."""

from __future__ import annotations

import math

from tests.estimator.trace_counts import traced
from xmem_admission.contract import cudnn, gpus
from xmem_admission.estimator import cudnn_heuristics as ch
from xmem_admission.estimator.conv_marks import ConvMark
from xmem_admission.estimator.estimate import (
    DOES_NOT_FIT,
    FITS,
    MAY_NOT_FIT,
    allocator_room,
    estimate_trace,
)
from xmem_admission.estimator.orchestrate import HIGH, LOW, for_gpu
from xmem_admission.estimator.trace import NoteKind, Trace

MIB = 2**20
A100 = gpus.lookup("A100-40GB")
# a ResNet block's 3x3 convolution as the probe marks it, forward and backward
MARK = ("cudnn:fwd x=32,64,56,56 w=64,64,3,3 y=32,64,56,56 g=1 b=4 s=1,1 p=1,1 d=1,1 cl=0"
        " dt=float32 bm=0 det=0 tf32=1")
BACKWARD = MARK.replace("cudnn:fwd", "cudnn:bwd_data+bwd_filter")


def a_transformer_step() -> Trace:
    """Parameters, a GEMM's activations and gradients, cuBLAS's workspaces: no convolution."""
    t = Trace()
    t.alloc(1, 256 * MIB, category="parameter", phase="setup")
    t.mark("step 0")
    t.mark("cublas:main")
    t.alloc(2, 512 * MIB, category="activation", phase="forward")
    t.mark("cublas:autograd")
    t.alloc(3, 256 * MIB, category="gradient", phase="backward")
    t.free(2)
    t.mark("step 1")
    return t


def test_a_cnns_estimate_has_a_wide_range_naming_its_convolution_workspaces(deviceless_cudnn):
    est = estimate_trace(traced(MARK, BACKWARD), [A100])[0]
    assert est.low_bytes < est.total_bytes < est.high_bytes
    [why] = [w for w in est.uncertain if w["what"] == "convolution workspaces"]
    assert est.low_bytes <= why["low_bytes"] < why["high_bytes"] <= est.high_bytes
    assert "3 convolution call(s)" in why["detail"]
    assert f"cuDNN {deviceless_cudnn.version_text}" in why["detail"]
    assert est.fit == FITS and est.fits


def test_the_high_end_runs_each_convolution_at_the_largest_workspace_cudnn_ranks(
        deviceless_cudnn):
    conv = ch.mark_calls(ConvMark.parse(MARK))[0][0]
    ends = {end: [e for e in for_gpu(traced(MARK, BACKWARD), A100, env={}, end=end).events
                  if e.op == "alloc" and e.phase.startswith("cudnn:")]
            for end in (LOW, HIGH)}
    for call, high in zip(list(cudnn.ConvCall), ends[HIGH]):
        ranked = ch.torch_workspaces(A100, conv, call, library=deviceless_cudnn,
                                     until_no_workspace=True)
        assert high.size == max(ranked)
        # and falls back to the point's plans where the allocator cannot give it
        tried = cudnn.tried_workspaces([max(ranked)] + cudnn.tried_workspaces(ranked))
        assert cudnn.later_plans(high.phase) == tried[1:]
    # every call here has a plan needing no workspace: the low end allocates none
    assert ends[LOW] == []


def test_a_transformers_range_is_narrow_and_it_pays_only_the_margin():
    # CUDA 13 (the trace names none): the H200's runtime figure is the largest of its rows
    # (240 MiB, bf16), the fp32 rows took 224: the low end is 16 MiB under, the high end is
    # the point
    est = estimate_trace(a_transformer_step(), [A100], margin=0.05)[0]
    assert est.high_bytes == est.total_bytes
    assert est.total_bytes - est.low_bytes == 16 * MIB
    [why] = est.uncertain
    assert why["what"] == "memory outside the allocator" and "224-240 MiB" in why["detail"]
    assert est.recommended_request_bytes == math.ceil(est.total_bytes * 1.05)


def _on_the_papers_cuda(t: Trace) -> Trace:
    t.meta["cuda"] = "12.4"
    return t


def test_a_cnns_request_covers_what_the_papers_convolution_jobs_needed_outside_the_allocator(
        deviceless_cudnn):
    # on the RTX 3060 the paper's convolution jobs needed up to 472 MiB more than the runtime
    # figure beyond their simulated high end; its jobs without convolutions never did
    rtx3060 = gpus.lookup("RTX-3060")
    cnn = estimate_trace(_on_the_papers_cuda(traced(MARK, BACKWARD)), [rtx3060])[0]
    [conv] = [w for w in cnn.uncertain if w["what"] == "convolution workspaces"]
    [outside] = [w for w in cnn.uncertain if w["what"] == "memory outside the allocator"]
    assert cnn.high_bytes == conv["high_bytes"] + 472 * MIB
    assert outside["high_bytes"] - cnn.overhead_bytes == 472 * MIB
    assert "MnasNet SGD b323" in outside["detail"]
    plain = estimate_trace(_on_the_papers_cuda(a_transformer_step()), [rtx3060])[0]
    assert plain.high_bytes == plain.total_bytes
    assert plain.recommended_request_bytes == math.ceil(plain.total_bytes * 1.05)


def test_the_request_is_the_high_end_plus_the_margin_on_the_point(deviceless_cudnn):
    est = estimate_trace(traced(MARK, BACKWARD), [A100], margin=0.05)[0]
    assert est.recommended_request_bytes == (math.ceil(est.total_bytes * 1.05)
                                             + est.high_bytes - est.total_bytes)
    assert est.recommended_request_bytes > est.high_bytes


def test_a_bounded_size_makes_the_point_the_high_end_and_its_low_end_unknown():
    t = a_transformer_step()
    t.note(NoteKind.BOUNDED, "nonzero: taken at its largest (every element)")
    est = estimate_trace(t, [A100])[0]
    assert est.high_bytes == est.total_bytes
    [why] = [w for w in est.uncertain if w["what"].startswith("upper bound")]
    assert why["what"] == "upper bound (bounded)" and why["low_bytes"] is None
    assert "nonzero" in why["detail"] and "low end is not known" in why["detail"]


def _too_big_for(gpu: gpus.GPU, bounded: bool) -> Trace:
    """A step whose activations take more than the allocator may reserve on ``gpu``."""
    t = a_transformer_step()
    t.alloc(99, allocator_room(t, for_gpu(t, gpu), gpu) + 64 * MIB, category="activation",
            phase="forward")
    if bounded:
        t.note(NoteKind.BOUNDED, "masked_select: taken at its largest")
    return t


def test_a_job_whose_low_end_does_not_fit_is_called_out_of_memory():
    est = estimate_trace(_too_big_for(A100, bounded=False), [A100])[0]
    assert est.fit == DOES_NOT_FIT and not est.fits and est.oom is not None


def test_a_job_whose_only_known_end_does_not_fit_may_not_fit():
    # an upper bound that does not fit: its low end is not known, so it is not called OOM
    est = estimate_trace(_too_big_for(A100, bounded=True), [A100])[0]
    assert est.oom is not None
    assert est.fit == MAY_NOT_FIT and est.fits
