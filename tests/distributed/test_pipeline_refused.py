"""Ranks of a pipeline-parallel job hold different stages and different activations: the probe
says so and refuses the job, instead of tracing rank 0 as if it stood for every GPU."""

from __future__ import annotations

from tests.distributed.conftest import script


def test_a_pipeline_parallel_job_is_refused_because_its_ranks_differ(trace_launch):
    result, _ = trace_launch(["torchrun", "--nproc-per-node", "2", script("pipeline_train.py")])
    assert result.status == "unsupported", result.reason + result.traceback
    assert "pipeline-parallel" in result.reason and "different stage" in result.reason
    assert result.steps == 0
