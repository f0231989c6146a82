"""A Triton kernel the script launches itself is not run in fake mode (no driver on the virtual
GPU): the tensors it writes are what its caller allocated, traced as usual, and the trace names
the kernel. In profile mode Triton's interpreter runs it on the host, with the same trace."""

from __future__ import annotations

from tests.estimator.trace_counts import live_by_category_at
from tests.support.torch_envs import require_module


def test_a_script_launching_a_triton_kernel_is_traced_in_fake_mode(probe_run, script):
    require_module("triton")
    result, _ = probe_run([script("triton_kernel.py")])
    assert result.status == "ok", result.reason + result.traceback
    (note,) = [n for n in result.trace.notes() if n["kind"] == "modelled"]
    assert note["message"].startswith("Triton kernel scale_kernel: launched on tensors its "
                                      "caller allocated")
    assert note["count"] == 3
    # the kernel's output, made by torch.empty_like in forward: 64 x 256 fp32
    outputs = [e for e in result.trace.events if e.op == "alloc" and e.source == "aten.empty_like"]
    assert {e.size for e in outputs} == {64 * 256 * 4}
    assert live_by_category_at(result.trace, "step 2")["parameter"] == (256 * 256 + 256) * 4
    assert not result.trace.upper_bound


def test_a_triton_kernel_runs_on_the_host_in_profile_mode(probe_run, script):
    require_module("triton")
    result, output = probe_run([script("triton_kernel.py"), "--check"], mode="profile")
    assert result.status == "ok", result.reason + result.traceback
    assert output.count("kernel output right: True") == 3, output
    (note,) = [n for n in result.trace.notes() if n["kind"] == "modelled"]
    assert note["message"].startswith("Triton kernel scale_kernel: run by Triton's interpreter")
    outputs = [e for e in result.trace.events if e.op == "alloc" and e.source == "aten.empty_like"]
    assert {e.size for e in outputs} == {64 * 256 * 4}
    assert live_by_category_at(result.trace, "step 2")["parameter"] == (256 * 256 + 256) * 4


def test_a_kernel_the_interpreter_cannot_run_is_not_estimated_in_profile_mode(probe_run, script):
    require_module("triton")
    result, _ = probe_run([script("triton_kernel_float_arg.py")], mode="profile")
    assert result.status == "unsupported", result.reason + result.traceback
    assert "Triton kernel shift_kernel needs a real GPU (Triton's interpreter cannot run it" \
        in result.reason
