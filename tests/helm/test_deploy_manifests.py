"""deploy/: the plain manifests are exactly what the chart renders, and each backend's example
is valid and does what its comments say when it goes through the webhook: the Job is held,
and once released with an estimate its pod gets that backend's form of the request."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

from tests.helm.chart import ROOT, run, tool
from tests.helm.test_chart_renders import CUSTOM_KINDS
from tests.support.builders import review
from tests.support.harness import LocalWebhook
from tests.support.schemas import validate_builtin, validate_custom
from xmem_admission.cluster import labels
from xmem_admission.cluster.policy.model import Policy

DEPLOY = ROOT / "deploy"
EXAMPLES = sorted((DEPLOY / "examples").glob("*.yaml"))
GiB = 1 << 30


def _load(path: Path) -> List[Dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _validate(obj: Dict[str, Any]) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CUSTOM_KINDS:
        validate_custom(obj, CUSTOM_KINDS[key])
    else:
        validate_builtin(obj)


def test_plain_manifests_are_what_the_chart_renders(tmp_path: Path) -> None:
    helm = tool("helm")
    run(["env", f"HELM={helm}", "bash", str(DEPLOY / "render.sh"), str(tmp_path)])
    for name in ("xmem-admission.yaml", "xmem-admission-self-signed.yaml"):
        assert (tmp_path / name).read_text() == (DEPLOY / name).read_text(), (
            f"deploy/{name} is stale: run deploy/render.sh")


@pytest.mark.parametrize("name", ["xmem-admission.yaml", "xmem-admission-self-signed.yaml"])
def test_plain_manifests_start_with_their_namespace_and_are_all_valid(name: str) -> None:
    objects = _load(DEPLOY / name)
    assert objects[0] == {"apiVersion": "v1", "kind": "Namespace",
                          "metadata": {"name": "xmem-system"}}
    for obj in objects:
        _validate(obj)


EXPECTED_FORM = {
    # backend: (container resources that must appear, that must be gone, pod annotations)
    "HAMi": ({"nvidia.com/gpu", "nvidia.com/gpumem"}, set(), set()),
    "MIGMixed": (set(), {"nvidia.com/gpu"}, set()),
    "KAI": (set(), {"nvidia.com/gpu"}, {"gpu-memory"}),
    "GPUShare": ({"aliyun.com/gpu-mem"}, {"nvidia.com/gpu"}, set()),
    "Volcano": ({"volcano.sh/vgpu-number", "volcano.sh/vgpu-memory"}, {"nvidia.com/gpu"}, set()),
    "Annotation": ({"nvidia.com/gpu"}, set(), {labels.REQUEST_BYTES}),
}


def test_applying_an_example_leaves_the_charts_policy_alone() -> None:
    chart_policy = yaml.safe_load((ROOT / "helm" / "xmem-admission" / "values.yaml")
                                  .read_text())["policy"]["name"]
    names = [next(o for o in _load(p) if o["kind"] == "GPUAdmissionPolicy")["metadata"]["name"]
             for p in EXAMPLES]
    assert chart_policy not in names
    assert len(set(names)) == len(names), "two examples would replace each other's policy"
    for path, name in zip(EXAMPLES, names):  # each says how to run with it instead
        assert f"--set policy.create=false --set policy.name={name}" in path.read_text(), path


def test_there_is_an_example_for_every_backend() -> None:
    backends = set()
    for path in EXAMPLES:
        policy = next(o for o in _load(path) if o["kind"] == "GPUAdmissionPolicy")
        backends |= {t["backend"] for t in policy["spec"]["targets"]}
    assert {"HAMi", "MIGMixed", "KAI", "GPUShare", "Volcano", "Annotation"} <= backends


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_job_is_held_then_its_pod_gets_the_backends_request(path: Path) -> None:
    objects = _load(path)
    for obj in objects:
        _validate(obj)
    policy_obj = next(o for o in objects if o["kind"] == "GPUAdmissionPolicy")
    policy = Policy.from_object(policy_obj)
    target = policy_obj["spec"]["targets"][0]
    job = next(o for o in objects if o["kind"] == "Job")
    webhook = LocalWebhook(policy)

    # 1. Job CREATE: no estimate yet, so the webhook holds it.
    held = webhook.send(review(copy.deepcopy(job)), "mutate", "object")
    assert held.allowed
    held_job = held.patched()
    assert held_job["spec"]["suspend"] is True
    validate_builtin(held_job)

    # 2. The controller releases it: the request in the pod template, unsuspended.
    template = copy.deepcopy(held_job["spec"]["template"])
    annotations = template["metadata"].setdefault("annotations", {})
    annotations[labels.REQUEST_BYTES] = str(20 * GiB)
    annotations[labels.GPU_MODEL] = target["gpu"]

    # 3. The Job controller creates the pod from the template: the webhook rewrites it.
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": dict(template["metadata"], name=f"{job['metadata']['name']}-x7k2p",
                            namespace=job["metadata"]["namespace"],
                            ownerReferences=[{"apiVersion": "batch/v1", "kind": "Job",
                                              "name": job["metadata"]["name"], "uid": "u-1",
                                              "controller": True}]),
           "spec": template["spec"]}
    assert labels.is_opted_in(pod["metadata"].get("labels")), \
        "the opt-in label must reach the pod, or the object entry never sees it"
    answer = webhook.send(review(pod), "mutate", "object")
    assert answer.allowed, answer.status
    created = answer.patched()
    validate_builtin(created)
    present, gone, pod_annotations = EXPECTED_FORM[target["backend"]]
    limits = created["spec"]["containers"][0]["resources"]["limits"]
    assert present <= set(limits), limits
    assert not gone & set(limits), limits
    assert pod_annotations <= set(created["metadata"].get("annotations", {}))
    if target["backend"] == "MIGMixed":
        assert any(k.startswith("nvidia.com/mig-") for k in limits), limits
    # Reinvocation changes nothing: the request is already in the backend's form.
    assert webhook.send(review(created), "mutate", "object").ops == []
