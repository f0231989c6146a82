"""cuDNN convolution workspaces: marked by the probe, sized per GPU architecture, transient, and
never an OOM when they do not fit (PyTorch runs a plan that needs less)."""

from __future__ import annotations

from tests.estimator.trace_counts import traced
from xmem_admission.contract import cudnn, gpus
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.orchestrate import conv_workspaces, for_gpu
from xmem_admission.estimator.trace import Trace

MIB = 2**20
A100 = gpus.lookup("A100-40GB")
# a 32x64x56x56 fp32 input (24.5 MiB) to a 3x3 conv with 128 outputs at stride 2 (12.25 MiB)
FWD = "cudnn:fwd x=32,64,56,56 w=128,64,3,3 y=32,128,28,28 g=1 b=4"
BWD = "cudnn:bwd_data+bwd_filter x=32,64,56,56 w=128,64,3,3 y=32,128,28,28 g=1 b=4"
INPUT_BYTES = 32 * 64 * 56 * 56 * 4


def rule(fwd=1.0, data=0.5, filt=0.25, resident_mib=0):
    return cudnn.ConvWorkspaceRule({cudnn.ConvCall.FORWARD: fwd,
                                    cudnn.ConvCall.BACKWARD_DATA: data,
                                    cudnn.ConvCall.BACKWARD_FILTER: filt},
                                   resident_mib * MIB, "test")


def test_each_call_asks_for_its_fraction_of_the_largest_tensor_it_touches():
    assert conv_workspaces(FWD, rule()) == [("fwd", INPUT_BYTES)]
    assert conv_workspaces(BWD, rule()) == [("bwd_data", INPUT_BYTES // 2),
                                            ("bwd_filter", INPUT_BYTES // 4)]


def test_a_sum_basis_counts_input_output_and_weight():
    summed = cudnn.ConvWorkspaceRule({call: 1.0 for call in cudnn.ConvCall}, 0, "test",
                                     cudnn.ConvBasis.SUM)
    output, weight = 32 * 128 * 28 * 28 * 4, 128 * 64 * 3 * 3 * 4
    assert conv_workspaces(FWD, summed) == [("fwd", INPUT_BYTES + output + weight)]


def test_workspaces_are_freed_right_after_their_call_in_backward_order():
    out = for_gpu(traced(FWD, BWD), A100, env={}, conv_rule=rule())
    ids = {e.id for e in out.events if e.op == "alloc" and e.phase.startswith("cudnn:")}
    ops = [(e.op, getattr(e, "size", None), getattr(e, "phase", None)) for e in out.events
           if e.op in ("alloc", "free") and e.id in ids]
    assert ops == [("alloc", INPUT_BYTES, "cudnn:fwd"), ("free", None, None),
                   ("alloc", INPUT_BYTES // 2, "cudnn:bwd_data"), ("free", None, None),
                   ("alloc", INPUT_BYTES // 4, "cudnn:bwd_filter"), ("free", None, None)]
    # the freed workspace stays cached: reserved grows by it, allocated does not keep it
    sim = simulate(out)
    assert sim.peak_reserved_bytes >= 64 * MIB + INPUT_BYTES
    none = rule(fwd=0.0, data=0.0, filt=0.0)
    assert simulate(for_gpu(traced(FWD, BWD), A100, env={}, conv_rule=none)
                    ).peak_reserved_bytes < sim.peak_reserved_bytes


def test_the_resident_bytes_come_once_at_the_first_convolution():
    out = for_gpu(traced(FWD, BWD, FWD), A100, env={}, conv_rule=rule(resident_mib=300))
    resident = [e for e in out.events if e.op == "alloc" and e.phase == cudnn.RESIDENT_PHASE]
    assert [e.size for e in resident] == [300 * MIB]


def test_cudnn_conv_wscap_dbg_caps_every_workspace_in_mib():
    out = for_gpu(traced(FWD, BWD), A100, env={"CUDNN_CONV_WSCAP_DBG": "8"}, conv_rule=rule())
    sizes = [e.size for e in out.events if e.op == "alloc" and e.phase.startswith("cudnn:")]
    assert sizes == [8 * MIB, 8 * MIB, 6422528]


def test_a_workspace_that_does_not_fit_runs_a_smaller_plan_instead_of_an_oom():
    big = rule(fwd=100.0)
    out = for_gpu(traced(FWD), A100, env={}, conv_rule=big)
    sim = simulate(out, capacity_bytes=1024 * MIB)
    assert sim.oom is None
    assert sim.peak_reserved_bytes < 1024 * MIB
    # an ordinary tensor of that size is an OOM
    t = Trace()
    t.alloc(1, 2048 * MIB, category="activation", phase="forward")
    assert simulate(t, capacity_bytes=1024 * MIB).oom is not None


def test_the_a100s_architecture_has_a_fitted_rule_with_its_source():
    fitted = cudnn.rule_for(A100.compute_capability)
    assert fitted is not None and "bench/fits/fit_conv_workspace.py" in fitted.source
    assert cudnn.rule_for(gpus.lookup("A100-80GB").compute_capability) is fitted
    out = for_gpu(traced(FWD), A100, env={})
    assert [e.phase for e in out.events if e.op == "alloc" and e.category == "workspace"
            and e.phase.startswith("cudnn")] == [cudnn.RESIDENT_PHASE, "cudnn:fwd"]


def test_an_architecture_without_a_fitted_rule_gets_no_convolution_workspace():
    rtx4060 = gpus.lookup("RTX-4060")
    assert cudnn.rule_for(rtx4060.compute_capability) is None
    out = for_gpu(traced(FWD, BWD), rtx4060, env={})
    assert not [e for e in out.events if e.op == "alloc" and e.phase.startswith("cudnn")]


def test_the_probe_marks_every_convolution_with_its_shapes(probe_run, script):
    result, _ = probe_run([script("tiny_cnn.py")], mode="fake", steps=1)
    assert result.status == "ok", result.reason
    marks = [e.label for e in result.trace.events if e.op == "mark"
             and e.label.startswith("cudnn:")]
    flags = "cl=0 dt=float32 bm=0 det=0 tf32=1"  # torch.backends.cudnn's defaults
    assert marks == [
        f"cudnn:fwd x=4,3,32,32 w=8,3,3,3 y=4,8,32,32 g=1 b=4 s=1,1 p=1,1 d=1,1 {flags}",
        f"cudnn:fwd x=4,8,32,32 w=16,8,3,3 y=4,16,16,16 g=1 b=4 s=2,2 p=1,1 d=1,1 {flags}",
        "cudnn:bwd_data+bwd_filter x=4,8,32,32 w=16,8,3,3 y=4,16,16,16 g=1 b=4 s=2,2 p=1,1"
        f" d=1,1 {flags}",
        # the input batch needs no gradient: only the weight's
        f"cudnn:bwd_filter x=4,3,32,32 w=8,3,3,3 y=4,8,32,32 g=1 b=4 s=1,1 p=1,1 d=1,1 {flags}",
    ]


def test_the_fitted_a100_rule_asks_every_call_for_the_same_share_of_its_operands():
    fitted = cudnn.rule_for(A100.compute_capability)
    assert fitted is not None
    sizes = {size for _, size in conv_workspaces(FWD, fitted) + conv_workspaces(BWD, fitted)}
    assert len(sizes) == 1 and sizes.pop() > INPUT_BYTES


def test_the_fit_searches_one_fraction_for_every_call_unless_asked_per_call():
    from bench.fits import fit_conv_workspace as fit

    one = fit.fraction_grid(per_call=False)
    assert all(forward == backward for forward, backward in one)
    assert len(one) == len(fit.FRACTIONS)
    per_call = fit.fraction_grid(per_call=True)
    assert (0.2, 1.5) in per_call and len(per_call) == len(fit.PER_CALL_FRACTIONS) ** 2
