"""Ranks of a pipeline-parallel job hold different stages and different activations: the probe
says so and refuses the job, instead of tracing rank 0 as if it stood for every GPU."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.distributed.conftest import script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_pipeline_parallel_job_is_refused_because_its_ranks_differ(trace_launch):
    result, _ = trace_launch(["torchrun", "--nproc-per-node", "2", script("pipeline_train.py")])
    assert result.status == "unsupported", result.reason + result.traceback
    assert "pipeline-parallel" in result.reason and "different stage" in result.reason
    assert result.steps == 0


def test_xmem_estimate_reports_a_pipeline_job_as_not_estimated(tmp_path):
    """Through the CLI the probe runs as ``python -m ...runner``: the refusal raised from the
    probe's other modules must still be the one the runner catches (it once died with a
    traceback there)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "xmem_admission.cli", "estimate", "--gpu", "A100-40GB", "--",
         "torchrun", "--nproc-per-node", "2", script("pipeline_train.py")], cwd=ROOT,
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "not estimated: pipeline-parallel jobs" in proc.stderr
    assert "Traceback" not in proc.stderr
