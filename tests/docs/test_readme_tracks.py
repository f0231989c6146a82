"""The README's cluster track works as written, as far as it runs without a cluster: the sample
Job it applies is a valid Job that reads the ConfigMap the README creates, and the chart's own
policy holds it in the labelled namespace, then sizes its pod with HAMi's request."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Dict

import yaml

from tests.support.builders import review
from tests.support.harness import LocalWebhook
from tests.support.schemas import validate_builtin
from xmem_admission.cluster import labels
from xmem_admission.cluster.policy.model import Policy

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def _readme_commands() -> str:
    section = (ROOT / "README.md").read_text().split("## Install on a cluster", 1)[1]
    return section.split("```sh", 1)[1].split("```", 1)[0]


def _sample_job() -> Dict[str, Any]:
    applied = re.search(r"kubectl apply -f (\S+)", _readme_commands())
    assert applied, "the cluster track applies no file"
    return yaml.safe_load((ROOT / applied.group(1)).read_text())


def _chart_policy() -> Policy:
    values = yaml.safe_load((ROOT / "helm" / "xmem-admission" / "values.yaml").read_text())
    return Policy.from_object({"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                               "metadata": {"name": values["policy"]["name"]},
                               "spec": values["policy"]["spec"]})


def test_the_sample_job_is_valid_and_mounts_the_configmap_the_readme_creates() -> None:
    job = _sample_job()
    validate_builtin(job)
    created = re.search(r"kubectl create configmap (\S+) -n (\S+) --from-file=(\S+)",
                        _readme_commands())
    labelled = re.search(r"kubectl label namespace (\S+) xmem.io/estimate=true",
                         _readme_commands())
    assert created and labelled
    name, namespace, source = created.groups()
    assert (ROOT / source).is_file()
    assert job["metadata"]["namespace"] == namespace == labelled.group(1)
    volumes = job["spec"]["template"]["spec"]["volumes"]
    assert any(v.get("configMap", {}).get("name") == name for v in volumes)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[1] == "/train/" + Path(source).name


def test_the_charts_policy_holds_the_sample_job_then_gives_its_pod_a_hami_request() -> None:
    job = _sample_job()
    webhook = LocalWebhook(_chart_policy())
    held = webhook.send(review(copy.deepcopy(job)), "mutate", "namespace")
    assert held.allowed
    held_job = held.patched()
    assert held_job["spec"]["suspend"] is True
    assert labels.HELD_REASON in held_job["metadata"]["annotations"]

    # What the controller writes when it releases the Job, then the pod the Job controller makes.
    template = copy.deepcopy(held_job["spec"]["template"])
    template["metadata"].setdefault("annotations", {}).update(
        {labels.REQUEST_BYTES: str(16 * GiB), labels.GPU_MODEL: "A100-80GB"})
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": dict(template["metadata"], name="gpt-sample-x7k2p",
                            namespace=job["metadata"]["namespace"],
                            ownerReferences=[{"apiVersion": "batch/v1", "kind": "Job",
                                              "name": job["metadata"]["name"], "uid": "u-1",
                                              "controller": True}]),
           "spec": template["spec"]}
    answer = webhook.send(review(pod), "mutate", "namespace")
    assert answer.allowed, answer.status
    limits = answer.patched()["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpumem"] == str(16 * 1024)
    assert limits["nvidia.com/gpu"] == 1
