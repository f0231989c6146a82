"""FSDP2 jobs are traced as rank 0 of their world: torch's own FSDP2 memory tracker (the
independent oracle), run over the same GPT-style model with the same fake process group, counts
the same per-rank peak of live tensors and the same 1/N of the parameters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed.conftest import live_at_last_step, peak_after_setup, script


def _oracle(world):
    done = subprocess.run([sys.executable, script("fsdp2_oracle.py"), "--portable",
                           "--world-size", str(world)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("world, mode", [(2, "fake"), (8, "fake"), (64, "fake"), (8, "profile")])
def test_fsdp2_rank_0_peak_matches_torchs_fsdp2_tracker(trace_launch, world, mode):
    result, _ = trace_launch(["torchrun", "--nproc-per-node", str(world),
                              script("fsdp2_gpt.py"), "--portable"], mode=mode)
    assert result.status == "ok", result.reason + result.traceback
    assert result.trace.meta["distributed"]["world_size"] == world
    oracle = _oracle(world)
    live = live_at_last_step(result.trace)
    assert live["parameter"] == oracle["last_peak_by_kind"]["SHARDED_PARAM"]
    assert live["optimizer_state"] <= oracle["last_peak_by_kind"]["OPT"]
    ours = peak_after_setup(result.trace)
    assert abs(ours - oracle["peak_bytes"]) <= 0.01 * oracle["peak_bytes"], (ours, oracle)


def test_fsdp2_with_activation_checkpointing_keeps_less_at_its_peak(trace_launch):
    def peak(*extra):
        result, _ = trace_launch(["torchrun", "--nproc-per-node", "8", script("fsdp2_gpt.py"),
                                  "--layers", "6", "--seq", "256", *extra])
        assert result.status == "ok", result.reason + result.traceback
        return peak_after_setup(result.trace)

    assert peak("--checkpoint") < peak()


def test_fsdp2_cpu_offload_is_a_gpu_job_whose_shards_stay_on_the_host(trace_launch):
    def traced(*extra):
        result, _ = trace_launch(["torchrun", "--nproc-per-node", "8", script("fsdp2_gpt.py"),
                                  "--portable", *extra])
        assert result.status == "ok", result.reason + result.traceback
        return result.trace

    on_gpu, offloaded = traced(), traced("--cpu-offload")
    assert not {"parameter", "gradient", "optimizer_state"} & set(live_at_last_step(offloaded))
    assert 0 < peak_after_setup(offloaded) < peak_after_setup(on_gpu)
