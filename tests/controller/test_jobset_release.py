"""A JobSet on the real control plane (JobSet v0.12.0's CRD): held, estimated and released by the
controller, with real estimation pods (the probe on the example GPT script). A JobSet whose
replicated Jobs run different programs gets an estimate per program, each estimation pod built
from its own template, and each template is sized from its own estimate."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import pytest

from tests.controller.support import IMAGE, Harness, training_job, wait
from tests.support.builders import review
from tests.support.harness import LocalWebhook
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import records

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
LEARNER_IMAGE = "python:3.11-slim"  # the process node runs any image's command on the host


@pytest.fixture()
def jobsets(cluster: Any, harness: Harness) -> Harness:
    """The test's namespace on a control plane that serves JobSets."""
    from localkube.hosted import install_crds
    from localkube.jobset import home

    install_crds(cluster, (home() / "jobset" / "crds").glob("*.yaml"))
    return harness


def replicated(name: str, template: Dict[str, Any]) -> Dict[str, Any]:
    return {"name": name, "replicas": 1, "template": {"spec": {
        "parallelism": 1, "completions": 1, "backoffLimit": 0, "template": template}}}


def two_program_jobset(harness: Harness) -> Dict[str, Any]:
    actor = training_job("actor", harness.namespace)["spec"]["template"]
    learner = copy.deepcopy(actor)
    learner["spec"]["containers"][0]["image"] = LEARNER_IMAGE
    learner["spec"]["containers"][0]["args"] = ["--layers", "2", "--hidden", "128", "--heads",
                                                "4", "--vocab", "100", "--seq-len", "32",
                                                "--batch-size", "2"]
    obj = {"apiVersion": JOBSET_API, "kind": "JobSet",
           "metadata": {"name": "rl", "namespace": harness.namespace,
                        "labels": {labels.OPT_IN: labels.OPT_IN_VALUE}},
           "spec": {"replicatedJobs": [replicated("actor", actor),
                                       replicated("learner", learner)]}}
    answer = LocalWebhook(harness.policy).send(review(obj))
    assert answer.allowed, answer.status
    held = answer.patched()
    assert held["spec"]["suspend"] is True
    return harness.create(held)


def released(harness: Harness, name: str) -> Dict[str, Any]:
    def done() -> Optional[Dict[str, Any]]:
        obj = harness.get(JOBSET_API, "JobSet", name)
        return obj if obj and labels.HELD_REASON not in (
            obj["metadata"].get("annotations") or {}) else None
    return wait(done, 300, f"JobSet {name} to be released")


def test_a_jobset_with_two_replicated_jobs_of_different_images_gets_an_estimate_per_template(
        jobsets: Harness) -> None:
    two_program_jobset(jobsets)
    jobsets.controller()
    obj = released(jobsets, "rl")
    assert obj["spec"]["suspend"] is False
    gmes = {g["spec"]["image"]: g for g in jobsets.gmes()}
    assert set(gmes) == {IMAGE, LEARNER_IMAGE}
    assert all(records.phase(g) == records.SUCCEEDED for g in gmes.values())
    # each estimation pod ran its own template's program (the command each estimate
    # reproduces is its pod's; the pods are deleted once their results are recorded)
    assert "128" in gmes[LEARNER_IMAGE]["status"]["reproduce"].split()
    assert "128" not in gmes[IMAGE]["status"]["reproduce"].split()
    # each template sized from its own estimate
    sized = {j["name"]: j["template"]["spec"]["template"]["metadata"]["annotations"]
             for j in obj["spec"]["replicatedJobs"]}
    for role, image in (("actor", IMAGE), ("learner", LEARNER_IMAGE)):
        status = gmes[image]["status"]
        assert int(sized[role][labels.REQUEST_BYTES]) == status["requestBytes"]
        assert int(sized[role][labels.ESTIMATE_BYTES]) == status["estimateBytes"]
    assert gmes[LEARNER_IMAGE]["status"]["estimateBytes"] > gmes[IMAGE]["status"]["estimateBytes"]
