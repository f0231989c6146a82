"""Every way a script puts its model and data on the GPU is traced as GPU memory, and a model
left on the host is refused instead of being reported as fitting."""

from __future__ import annotations

import pytest

from tests.estimator.trace_counts import live_by_category_at
from tests.support.torch_envs import require_torch_save

IDIOMS = ["to_string", "to_device_keyword", "to_device_index", "to_other_tensor", "cuda_index",
          "factory_device", "set_default_device", "device_context", "to_empty",
          "load_state_dict_assign", "load_callable", "local_rank", "legacy_type", "pool",
          "loader_workers"]
HIDDEN = 64


def model_bytes(hidden: int) -> int:
    """fc1 (H x 4H + 4H), LayerNorm (2 x 4H), fc2 (4H x 10 + 10), fp32: from the model's shape."""
    return 4 * (hidden * 4 * hidden + 4 * hidden + 2 * 4 * hidden + 4 * hidden * 10 + 10)


@pytest.mark.parametrize("mode", ["fake", "profile"])
@pytest.mark.parametrize("idiom", IDIOMS)
def test_each_placement_idiom_puts_parameters_gradients_and_state_on_the_gpu(
        probe_run, script, idiom, mode):
    if idiom in ("load_state_dict_assign", "load_callable"):
        require_torch_save()  # the script writes the checkpoint it loads
    result, out = probe_run([script("placement.py"), "--idiom", idiom, "--hidden", str(HIDDEN)],
                            mode, steps=2)
    assert result.status == "ok", result.reason
    live = live_by_category_at(result.trace, "step 1")
    params = model_bytes(HIDDEN)
    assert live["parameter"] == params
    assert live["gradient"] == params
    assert live["optimizer_state"] == 2 * params  # AdamW: exp_avg and exp_avg_sq
    assert "x on cuda:0 weight on cuda:0" in out


@pytest.mark.parametrize("mode", ["fake", "profile"])
def test_a_model_never_moved_to_the_gpu_is_refused_naming_it(probe_run, script, mode):
    result, _ = probe_run([script("placement.py"), "--idiom", "to_device_keyword",
                           "--host-only"], mode, steps=2)
    assert result.status == "not_on_gpu"
    assert result.reason.startswith("AdamW.step() updates 6 parameter tensors")
    assert "of the model (Net): fc1.weight, fc1.bias, norm.weight, ..." in result.reason
    assert "no parameter is on the GPU at all" in result.reason
    assert "no .to()/.cuda() call ever moved that module" in result.reason


@pytest.mark.parametrize("mode", ["fake", "profile"])
def test_a_module_left_on_the_host_beside_gpu_activations_is_refused_naming_the_call(
        probe_run, script, mode):
    result, _ = probe_run([script("placement.py"), "--idiom", "to_string", "--leave-on-host",
                           "fc2"], mode, steps=2)
    assert result.status == "not_on_gpu"
    assert "2 parameter tensors (0.0 MiB) of fc2 (Linear): fc2.weight, fc2.bias" in result.reason
    assert "while the step's activations are on the GPU" in result.reason
    assert "placement.py:" in result.reason
    assert 'getattr(model, args.leave_on_host).to("cpu")), left it on the host' in result.reason


def test_xmem_estimate_exits_2_instead_of_saying_a_host_model_fits(script):
    from tests.estimator.test_estimate_cli import xmem

    proc = xmem("estimate", "--gpu", "A100-80GB", "--", "python", script("placement.py"),
                "--idiom", "to_string", "--host-only")
    assert proc.returncode == 2, proc.stdout
    assert "not estimated: AdamW.step() updates 6 parameter tensors" in proc.stderr
    assert "fits" not in proc.stdout
