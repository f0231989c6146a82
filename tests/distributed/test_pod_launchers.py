"""In an estimation pod, a launcher's command is traced as rank 0 of its world by the launcher's
own interpreter (no workers are started), and a DeepSpeed launch it cannot trace (several nodes)
is reported as unsupported with the reason."""

from __future__ import annotations

import os
import sys

from tests.controller.test_probe_bundle import _run, built  # noqa: F401 - the bundle fixture
from tests.distributed.conftest import script


def test_an_estimation_pod_traces_torchrun_as_rank_0_of_its_world(built, tmp_path):  # noqa: F811
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run = _run(built, [torchrun, "--nnodes", "2", "--nproc-per-node", "4",
                       script("ddp_train.py"), "--report", str(tmp_path / "ddp.json")], tmp_path)
    assert run["code"] == 0, run["output"]
    result = run["result"]
    assert result is not None and result.status == "ok", run["output"]
    report = (tmp_path / "ddp.json").read_text()
    assert '"world_size": 8' in report and '"rank": 0' in report
    assert {g["gpu"] for g in result.gpus} == {"A100-80GB", "H100-80GB"}


def test_an_estimation_pod_reports_a_multi_node_deepspeed_launch_as_unsupported(
        built, tmp_path):  # noqa: F811
    run = _run(built, [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile",
                       "/job/hostfile", "--num_gpus", "2", "train.py"], tmp_path)
    assert run["code"] == 1, run["output"]
    assert run["result"] is not None and run["result"].status == "unsupported"
    assert "multi-node DeepSpeed launches (--hostfile /job/hostfile)" in run["result"].reason


def test_an_estimation_pod_refuses_a_launcher_of_a_non_python_program(built, tmp_path):  # noqa: F811
    run = _run(built, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--no-python", "sh", "train.sh"], tmp_path)
    assert run["code"] == 1, run["output"]
    assert run["result"] is not None and run["result"].status == "unsupported"
    assert "not a Python script" in run["result"].reason
