"""FSDP2 jobs are traced as rank 0 of their world: each rank holds 1/N of the parameters, as
torch's own FSDP2 memory tracker (the independent oracle) counts them on the same model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed.conftest import live_at_last_step, script


def _oracle(world):
    done = subprocess.run([sys.executable, script("fsdp2_oracle.py"), "--portable",
                           "--world-size", str(world)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("world", [2, 8, 64])
def test_fsdp2_sharded_parameters_match_torchs_fsdp2_tracker(trace_launch, world):
    result, _ = trace_launch(["torchrun", "--nproc-per-node", str(world),
                              script("fsdp2_gpt.py"), "--portable"], mode="profile")
    assert result.status == "ok", result.reason + result.traceback
    assert result.trace.meta["distributed"]["world_size"] == world
    oracle = _oracle(world)
    live = live_at_last_step(result.trace)
    assert live["parameter"] == oracle["last_peak_by_kind"]["SHARDED_PARAM"]


def test_fsdp2_is_traced_in_profile_mode_with_the_reason(trace_launch):
    result, _ = trace_launch(["torchrun", "--nproc-per-node", "8", script("fsdp2_gpt.py")])
    assert result.status == "needs_real_values"
    assert "FSDP2 (fully_shard) is traced in profile mode" in result.reason
