"""DDP jobs are traced as rank 0 of their world, with the reducer's gradient buckets on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.conftest import ON_2_3, live_at_last_step, peak_after_setup, script


@pytest.mark.parametrize("mode", ["fake", "profile"])
def test_ddp_bucket_bytes_equal_what_the_reducer_reports(trace_launch, tmp_path, mode):
    report = tmp_path / "ddp.json"
    result, _ = trace_launch(["torchrun", "--nproc-per-node", "8", script("ddp_train.py"),
                              "--report", str(report)], mode=mode)
    if ON_2_3 and mode == "fake":
        assert result.status == "needs_real_values", result.reason + result.traceback
        assert "DDP's gradient buckets cannot be traced in fake mode" in result.reason
        return
    assert result.status == "ok", result.reason + result.traceback
    reducer = json.loads(report.read_text())
    assert (reducer["world_size"], reducer["rank"]) == (8, 0)
    setup = result.trace.meta["distributed"]
    assert setup["ddp_bucket_bytes"] == reducer["bucket_sizes"]
    live = live_at_last_step(result.trace)
    assert live["communication"] == sum(reducer["bucket_sizes"])
    assert live["gradient"] == live["parameter"]  # the gradients are a second copy


@pytest.mark.parametrize("options", [["--static-graph"],
                                     ["--find-unused-parameters", "--unused-layer"],
                                     ["--static-graph", "--unused-layer"]])
def test_static_graph_and_unused_parameters_keep_the_buckets_the_reducer_reports(
        fake_launch, tmp_path, options):
    report = tmp_path / "ddp.json"
    result, _ = fake_launch(["torchrun", "--nproc-per-node", "8", script("ddp_train.py"),
                              "--report", str(report), *options])
    assert result.status == "ok", result.reason + result.traceback
    buckets = json.loads(report.read_text())["bucket_sizes"]
    assert result.trace.meta["distributed"]["ddp_bucket_bytes"] == buckets
    live = live_at_last_step(result.trace)
    # an unused layer's parameters have a place in the buckets too
    assert live["communication"] == sum(buckets) == live["parameter"]


def test_fp16_compression_holds_a_half_size_copy_of_each_bucket_while_it_is_reduced(
        fake_launch, tmp_path):
    report = tmp_path / "ddp.json"
    result, _ = fake_launch(["torchrun", "--nproc-per-node", "8", script("ddp_train.py"),
                              "--report", str(report), "--fp16-compress"])
    assert result.status == "ok", result.reason + result.traceback
    buckets = json.loads(report.read_text())["bucket_sizes"]
    events = result.trace.events
    copies = [e for e in events if e.op == "alloc" and e.category == "communication"
              and e.size in {b // 2 for b in buckets}]
    assert sorted(e.size for e in copies[-len(buckets):]) == sorted(b // 2 for b in buckets)
    freed = {e.id for e in events if e.op == "free"}
    assert all(e.id in freed for e in copies)  # transient: gone once the bucket is reduced
    assert live_at_last_step(result.trace)["communication"] == sum(buckets)


def test_activation_checkpointing_under_ddp_keeps_one_activation_less_per_layer(
        fake_launch, tmp_path):
    def peak(*options):
        result, _ = fake_launch(["torchrun", "--nproc-per-node", "8", script("ddp_train.py"),
                                  "--report", str(tmp_path / "ddp.json"), "--batch", "2048",
                                  *options])
        assert result.status == "ok", result.reason + result.traceback
        assert result.trace.meta["distributed"]["ddp_bucket_bytes"] == json.loads(
            (tmp_path / "ddp.json").read_text())["bucket_sizes"]
        return peak_after_setup(result.trace)

    # Each layer saves its input and its GELU's input; checkpointed, only the first.
    assert peak() - peak("--checkpoint") == 6 * 2048 * 512 * 4


def test_a_smaller_bucket_cap_makes_more_buckets_of_the_same_total(fake_launch, tmp_path):
    report = tmp_path / "ddp.json"
    result, _ = fake_launch(["torchrun", "--nproc-per-node", "2", script("ddp_train.py"),
                              "--bucket-cap-mb", "1.5", "--report", str(report)])
    assert result.status == "ok", result.reason + result.traceback
    buckets = json.loads(report.read_text())["bucket_sizes"]
    assert len(buckets) > 2
    assert result.trace.meta["distributed"]["ddp_bucket_bytes"] == buckets
    assert live_at_last_step(result.trace)["communication"] == sum(buckets)


def test_gradients_as_bucket_views_are_not_a_second_copy(fake_launch, tmp_path):
    report = tmp_path / "ddp.json"
    result, _ = fake_launch(["torchrun", "--nproc-per-node", "8", script("ddp_train.py"),
                              "--bucket-view", "--report", str(report)])
    assert result.status == "ok", result.reason + result.traceback
    live = live_at_last_step(result.trace)
    assert "communication" not in live
    assert live["gradient"] == sum(json.loads(report.read_text())["bucket_sizes"])


def test_a_script_that_initialises_itself_from_the_environment_is_rank_0(fake_launch, tmp_path):
    report = tmp_path / "ddp.json"
    result, _ = fake_launch(["python", script("ddp_train.py"), "--report", str(report)],
                             env={"WORLD_SIZE": "16"})
    assert result.status == "ok", result.reason + result.traceback
    assert json.loads(report.read_text())["world_size"] == 16
    assert result.trace.meta["distributed"]["world_size"] == 16


def test_xmem_estimate_runs_torchrun_commands_and_adds_nccl(tmp_path):
    """The issue's first failure: `xmem estimate -- torchrun ...` said 'script not found'."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run(
        [sys.executable, "-m", "xmem_admission.cli", "estimate", "--json", "--gpu", "H100-80GB",
         "--", "python", "-m", "torch.distributed.run", "--nproc_per_node=8",
         script("ddp_train.py")], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gpu = json.loads(proc.stdout)["gpus"][0]
    assert gpu["breakdown"]["communication"] > 0
    assert gpu["breakdown"]["nccl"] > 0
    assert gpu["total_bytes"] == sum(gpu["breakdown"].values())


def test_accelerate_launch_multi_gpu_is_traced_as_rank_0(fake_launch, tmp_path):
    report = tmp_path / "ddp.json"
    result, _ = fake_launch(["accelerate", "launch", "--multi_gpu", "--num_processes", "8",
                              script("ddp_train.py"), "--report", str(report)])
    assert result.status == "ok", result.reason + result.traceback
    reducer = json.loads(report.read_text())
    assert (reducer["world_size"], reducer["rank"]) == (8, 0)
    assert live_at_last_step(result.trace)["communication"] == sum(reducer["bucket_sizes"])
