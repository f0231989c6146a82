"""The project's image as the chart runs it: the Deployment's pod template from deploy/, with
the image built from the Dockerfile, and the estimation pod's init container from the
controller's own pod builder."""

from __future__ import annotations

import copy
import filecmp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import yaml

from localkube.podman_pod import podman, run_pod
from localkube.tools import ROOT
from tests.controller.support import code_map, make_policy, training_job
from tests.images.conftest import ProjectImage
from xmem_admission.cluster.controller import podspec, records

CHART_USER = 65532  # the chart's runAsUser/runAsGroup and the Dockerfile's USER


def _deployment_pod(name: str, image: str, args: List[str]) -> Dict[str, Any]:
    """The pod that the chart's Deployment `name` makes, with the image and args replaced."""
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/xmem-admission.yaml").read_text()) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment"
                      and d["metadata"]["name"].endswith(name))
    spec = copy.deepcopy(deployment["spec"]["template"]["spec"])
    for container in spec["containers"]:
        container.update(image=image, args=args)
    return {"metadata": {"name": f"{name}-pod", "namespace": "xmem-system"}, "spec": spec}


def _files(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def test_the_controller_deployment_runs_xmem_help_as_the_chart_user_on_a_read_only_root(
        project_image: str, tmp_path: Path) -> None:
    pod = _deployment_pod("controller", project_image, ["--help"])
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == CHART_USER
    [run] = run_pod(pod, tmp_path)
    assert run.exit_code == 0, run.logs
    assert "serve" in run.logs and "controller" in run.logs


def test_the_image_runs_as_the_chart_user_without_being_told(project_image: str) -> None:
    result = podman("run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024",
                    "--ulimit", "nproc=1024:1024", "--entrypoint",
                    '["python", "-c", "import os; print(os.getuid(), os.getgid())"]',
                    project_image)
    assert result.stdout.split() == [str(CHART_USER), str(CHART_USER)]


def test_the_image_has_no_torch_and_cannot_write_its_root(project_image: str,
                                                          tmp_path: Path) -> None:
    script = ("import importlib.util, pathlib\n"
              "print('torch', importlib.util.find_spec('torch') is not None)\n"
              "try:\n    pathlib.Path('/opt/venv/x').write_text('x')\nexcept OSError as e:\n"
              "    print('write', e.errno)\n")
    pod = _deployment_pod("webhook", project_image, [])
    pod["spec"]["volumes"] = [v for v in pod["spec"]["volumes"] if "emptyDir" in v]
    container = pod["spec"]["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] == "tmp"]
    container.update(command=["python", "-c", script], args=[])
    [run] = run_pod(pod, tmp_path)
    assert run.exit_code == 0, run.logs
    assert run.logs.split() == ["torch", "False", "write", "30"]  # EROFS


def test_the_estimation_pods_init_container_writes_the_bundle_the_sources_write(
        project_build: ProjectImage, tmp_path: Path) -> None:
    project_image = project_build.reference
    job = training_job("train")
    job["metadata"]["uid"] = "job-uid"
    gme = records.new(job, "a" * 32, ["A100-80GB"], project_image)
    gme["metadata"]["uid"] = "gme-uid"
    template = job["spec"]["template"]
    pod = podspec.build(gme, job, template, template["spec"]["containers"][0],
                        make_policy().defaults, project_image)
    # only the probe's init container: what it leaves is checked here
    pod["spec"]["containers"] = []
    pod["spec"]["initContainers"] = [c for c in pod["spec"]["initContainers"]
                                     if c["name"] == podspec.INIT_NAME]
    [init] = run_pod(pod, tmp_path / "pod", {"code": code_map()["data"]})
    assert init.name == podspec.INIT_NAME and init.exit_code == 0, init.logs
    written = tmp_path / "pod" / "volumes" / podspec.PROBE_VOLUME
    assert (written / "sitecustomize.py").stat().st_uid == CHART_USER

    expected = tmp_path / "expected"
    subprocess.run([sys.executable, "-m", "xmem_admission.bundle", str(expected)], check=True,
                   capture_output=True, cwd=tmp_path,
                   env=dict(os.environ, PYTHONPATH=str(project_build.context / "src")))
    assert _files(written) == _files(expected)
    _, mismatch, errors = filecmp.cmpfiles(written, expected, _files(expected), shallow=False)
    assert mismatch == [] and errors == []
