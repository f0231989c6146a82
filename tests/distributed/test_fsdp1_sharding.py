"""FSDP1 jobs are traced as rank 0 of their world: FULL_SHARD keeps 1/N of the parameters,
gradients and optimizer state between steps, NO_SHARD keeps all of them."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import ON_2_3, live_at_last_step, peak_after_setup, script

MODEL_BYTES = 6 * (512 * 512 + 512) * 4  # fsdp1_train.py's six fp32 Linear(512, 512)


@pytest.mark.parametrize("strategy, shards", [("FULL_SHARD", 8), ("NO_SHARD", 1)])
def test_fsdp1_keeps_its_share_of_the_model_states(fake_launch, strategy, shards):
    result, _ = fake_launch(["torchrun", "--nproc-per-node", "8", script("fsdp1_train.py"),
                              "--strategy", strategy])
    assert result.status == "ok", result.reason + result.traceback
    live = live_at_last_step(result.trace)
    assert live["parameter"] == MODEL_BYTES // shards
    assert live["optimizer_state"] == 2 * MODEL_BYTES // shards  # AdamW's two moments


UNIT_BYTES = (512 * 512 + 512) * 4  # one Linear(512, 512): an FSDP unit under --wrap-layers


def _traced(fake_launch, *options):
    result, _ = fake_launch(["torchrun", "--nproc-per-node", "8", script("fsdp1_train.py"),
                              "--wrap-layers", *options])
    assert result.status == "ok", result.reason + result.traceback
    return result.trace


def test_shard_grad_op_keeps_the_gathered_layers_from_forward_to_backward(fake_launch):
    full = peak_after_setup(_traced(fake_launch, "--strategy", "FULL_SHARD"))
    grad_op = _traced(fake_launch, "--strategy", "SHARD_GRAD_OP")
    # FULL_SHARD frees each layer's gathered parameters after its forward and gathers them
    # again in backward, at most two at a time; SHARD_GRAD_OP keeps all six until backward.
    assert peak_after_setup(grad_op) - full > 3 * UNIT_BYTES
    live = live_at_last_step(grad_op)  # between steps both keep 1/8 of everything
    assert live["parameter"] == MODEL_BYTES // 8
    assert live["optimizer_state"] == 2 * MODEL_BYTES // 8


def test_mixed_precision_gathers_bf16_and_keeps_fp32_shards(fake_launch):
    fp32 = peak_after_setup(_traced(fake_launch))
    mixed = _traced(fake_launch, "--mixed-precision")
    assert peak_after_setup(mixed) < fp32
    live = live_at_last_step(mixed)
    assert live["parameter"] == MODEL_BYTES // 8
    assert live["optimizer_state"] == 2 * MODEL_BYTES // 8


def test_cpu_offload_is_a_gpu_job_whose_model_states_stay_on_the_host(fake_launch):
    on_gpu = peak_after_setup(_traced(fake_launch))
    offloaded = _traced(fake_launch, "--cpu-offload")
    live = live_at_last_step(offloaded)
    assert not {"parameter", "gradient", "optimizer_state"} & set(live)
    assert 0 < peak_after_setup(offloaded) < on_gpu  # the gathered layers and activations


def test_activation_checkpointing_keeps_one_activation_less_per_block(fake_launch):
    plain = peak_after_setup(_traced(fake_launch, "--batch", "2048"))
    checkpointed = peak_after_setup(_traced(fake_launch, "--batch", "2048", "--checkpoint"))
    # Each block saves its Linear's input and its GELU's input; checkpointed, only the first.
    assert plain - checkpointed == 6 * 2048 * 512 * 4


def test_an_fsdp1_job_in_fake_mode_is_traced_or_asks_for_real_values_with_torch_2_3(trace_launch):
    result, _ = trace_launch(["torchrun", "--nproc-per-node", "8", script("fsdp1_train.py"),
                              "--strategy", "FULL_SHARD"], mode="fake")
    if ON_2_3:  # probe.distributed._refuse_fake_on_2_3: auto mode then traces it in profile mode
        assert result.status == "needs_real_values", result.reason + result.traceback
        assert "cannot be traced in fake mode with torch 2.3" in result.reason
    else:
        assert result.status == "ok", result.reason + result.traceback
