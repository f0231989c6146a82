"""An estimation pod as the controller builds it, run from real images: the init container from
the project's image writes the probe bundle into an emptyDir, and the training container, from
a training image with its own Python and torch, runs the workload's command under the probe as
UID 65532 with every capability dropped and a read-only root file system, leaving the result in
its termination message file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pytest

from localkube.podman_pod import ContainerRun, run_pod
from tests.controller.support import GPUS, code_map, make_policy, training_job
from xmem_admission.cluster.controller import podspec, records
from xmem_admission.contract import termination

# The two ends of the supported range on the Pythons the Makefile's TORCH_ENDS pairs them with.
TRAINING = [("2.2.2", "3.9"), ("2.15.0", "3.13")]


def _estimation_pod(project_image: str, image: str, **workload: Any) -> Dict[str, Any]:
    job = training_job("train", image=image, **workload)
    job["metadata"]["uid"] = "job-uid"
    spec = job["spec"]["template"]["spec"]
    container = spec["containers"][0]
    # A read-only root, with the scratch space such a workload mounts for itself: torch 2.15
    # cannot even import torch._dynamo without a writable temporary directory (its cache).
    container["securityContext"] = {"readOnlyRootFilesystem": True}
    spec["volumes"].append({"name": "scratch", "emptyDir": {}})
    container["volumeMounts"].append({"name": "scratch", "mountPath": "/tmp"})
    gme = records.new(job, "b" * 32, list(GPUS), image)
    gme["metadata"]["uid"] = "gme-uid"
    template = job["spec"]["template"]
    policy = make_policy(estimation={"resources": {"cpu": "1", "memory": "3Gi"},
                                     "activeDeadlineSeconds": 600})
    return podspec.build(gme, job, template, container, policy.defaults, project_image)


def _run(pod: Dict[str, Any], workdir: Path) -> ContainerRun:
    runs = run_pod(pod, workdir, {"code": code_map()["data"]})
    assert [r.name for r in runs] == [podspec.INIT_NAME, podspec.IMAGE_ENV_NAME, "train"], runs
    assert runs[0].exit_code == runs[1].exit_code == 0, (runs[0].logs, runs[1].logs)
    # the training image sets no PYTHONPATH of its own: recorded as such
    written = workdir / "volumes" / podspec.PROBE_VOLUME / "image-env.json"
    assert written.read_text() == '{"PYTHONPATH": null}'
    return runs[2]


@pytest.mark.parametrize("torch_version,python", TRAINING)
def test_the_probe_estimates_the_workload_inside_the_users_image(
        project_image: str, training_image: Any, tmp_path: Path, torch_version: str,
        python: str) -> None:
    pod = _estimation_pod(project_image, training_image(torch_version, python))
    main = pod["spec"]["containers"][0]
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == podspec.NON_ROOT

    run = _run(pod, tmp_path)
    assert run.exit_code == 0, run.logs[-3000:]
    result = termination.decode(run.message)
    assert result.ok, (result.status, result.reason, result.traceback)
    assert result.steps == 3
    assert [g["gpu"] for g in result.gpus] == list(GPUS)
    for gpu in result.gpus:
        assert 0 < gpu["peak_reserved_bytes"] <= gpu["recommended_request_bytes"]
        assert gpu["fits"] is True


def test_a_failing_training_script_is_reported_in_the_termination_message(
        project_image: str, training_image: Any, tmp_path: Path) -> None:
    torch_version, python = TRAINING[-1]
    pod = _estimation_pod(project_image, training_image(torch_version, python),
                          script="fails_before_step.py", args=())
    run = _run(pod, tmp_path)
    assert run.exit_code != 0
    result = termination.decode(run.message)
    assert result.status == "script_error"
    assert "no training shards under /data" in result.reason
    assert "fails_before_step.py" in result.traceback
