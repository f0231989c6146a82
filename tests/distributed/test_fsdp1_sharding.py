"""FSDP1 jobs are traced as rank 0 of their world: FULL_SHARD keeps 1/N of the parameters,
gradients and optimizer state between steps, NO_SHARD keeps all of them."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import live_at_last_step, script

MODEL_BYTES = 6 * (512 * 512 + 512) * 4  # fsdp1_train.py's six fp32 Linear(512, 512)


@pytest.mark.parametrize("strategy, shards", [("FULL_SHARD", 8), ("NO_SHARD", 1)])
def test_fsdp1_keeps_its_share_of_the_model_states(trace_launch, strategy, shards):
    result, _ = trace_launch(["torchrun", "--nproc-per-node", "8", script("fsdp1_train.py"),
                              "--strategy", strategy])
    assert result.status == "ok", result.reason + result.traceback
    live = live_at_last_step(result.trace)
    assert live["parameter"] == MODEL_BYTES // shards
    assert live["optimizer_state"] == 2 * MODEL_BYTES // shards  # AdamW's two moments
