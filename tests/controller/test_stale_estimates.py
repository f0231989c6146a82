"""An estimate knows when it no longer describes the program: the fingerprint holds the version
of the ConfigMap a job's script is mounted from, so an edited script is estimated again; and the
image digest its estimation pod ran is recorded, and a sized workload whose pod runs the same
tag under another digest marks it stale, so the next submission is estimated again instead of
being sized from it.

The process nodes report ``imageID`` from ``localkube.node.DIGESTS`` (an image pushed again
behind the same tag is a new entry there); a full controller runs against the real control plane.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Dict, Iterator, Tuple

import pytest

from localkube import node as process_node
from localkube.kwok import GPU_TAINT, GPU_TOLERATION
from localkube.node import ProcessNode
from tests.controller.support import IMAGE, Harness, code_map, training_job, wait
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.controller.estimate_cache import STALE_EVENT
from xmem_admission.cluster.controller.workloads import ESTIMATE_NAME

OLD = "sha256:" + "1" * 64
NEW = "sha256:" + "2" * 64


@pytest.fixture()
def gpu_node(harness: Harness) -> Iterator[ProcessNode]:
    """A process node with GPUs (tainted as GPU nodes are) that really runs a sized pod, so the
    pod's status carries the imageID the node reports."""
    name = f"xmem-{harness.namespace}"[:63]
    allocatable = {"cpu": "8", "memory": "32Gi", "pods": "20", "ephemeral-storage": "100Gi",
                   "nvidia.com/gpu": "4"}
    running = ProcessNode(harness.cluster.plane, name, allocatable=allocatable,
                          path_prefix=[os.path.dirname(sys.executable)],
                          taints=[GPU_TAINT]).start()
    try:
        yield running
    finally:
        def on_node() -> list:
            return [p for p in harness.cluster.list("v1", "Pod", harness.namespace)
                    if p["spec"].get("nodeName") == name]
        for job in harness.cluster.list("batch/v1", "Job", harness.namespace):
            harness.cluster.delete("batch/v1", "Job", job["metadata"]["name"], harness.namespace)
        wait(lambda: not on_node(), 60, f"the pods on {name} to go")
        running.stop()
        harness.cluster.delete("v1", "Node", name)
        process_node.DIGESTS.pop(IMAGE, None)


def _condition(gme: Dict[str, Any], kind: str) -> Tuple[str, str, str, str]:
    """A condition's status, reason, message and lastTransitionTime."""
    [found] = [c for c in gme["status"]["conditions"] if c["type"] == kind]
    return found["status"], found["reason"], found["message"], found["lastTransitionTime"]


def _on(node: ProcessNode, job: Dict[str, Any]) -> Dict[str, Any]:
    """The job with its pods placed on ``node`` (placement is not part of the fingerprint)."""
    out = copy.deepcopy(job)
    spec = out["spec"]["template"]["spec"]
    spec["nodeSelector"] = {"kubernetes.io/hostname": node.name}
    spec["tolerations"] = [GPU_TOLERATION]
    return out


def test_a_new_digest_behind_the_same_tag_marks_the_estimate_stale_and_the_next_job_is_estimated_again(
        harness: Harness, gpu_node: ProcessNode) -> None:
    process_node.DIGESTS[IMAGE] = OLD
    harness.controller()
    harness.submit(training_job("first"))
    harness.wait_released("first", timeout=240)
    [gme] = harness.gmes()
    assert gme["status"]["imageID"] == f"pytorch/pytorch@{OLD}"
    assert not records.is_stale(gme)

    # The same tag is pushed again: the next job is sized from the estimate, but its pod runs
    # the new digest, which the controller sees in the pod's status.
    process_node.DIGESTS[IMAGE] = NEW
    harness.submit(_on(gpu_node, training_job("second")))
    harness.wait_released("second", timeout=120)
    assert harness.gmes()[0]["status"]["attempt"] == 1  # sized from it, not estimated again

    def stale() -> Any:
        found = harness.gmes()[0]
        return found if records.is_stale(found) else None
    marked = wait(stale, 120, "the estimate to be marked stale")
    assert marked["status"]["stale"]["imageID"] == f"pytorch/pytorch@{NEW}"
    assert marked["status"]["stale"]["reason"] == "ImageChanged"
    assert OLD in marked["status"]["stale"]["message"]
    # Its conditions say so; the estimate is still recorded, and Estimated did not transition.
    assert _condition(gme, "Stale")[:2] == ("False", "Current")
    assert _condition(marked, "Stale")[:2] == ("True", "ImageChanged")
    assert OLD in _condition(marked, "Stale")[2]
    assert _condition(marked, "Estimated") == _condition(gme, "Estimated")
    events = wait(lambda: [e for e in harness.events("second") if e["reason"] == STALE_EVENT],
                  30, "a Warning event on the job whose pod ran the new digest")
    assert events[0]["type"] == "Warning" and NEW in events[0]["message"]
    gme_events = [e for e in harness.cluster.list("v1", "Event", harness.namespace)
                  if e["involvedObject"]["name"] == gme["metadata"]["name"]
                  and e["reason"] == STALE_EVENT]
    assert gme_events, "no Event on the estimate"

    # The next submission is estimated again, from the new digest, not sized from the old one.
    harness.submit(training_job("third"))
    harness.wait_released("third", timeout=240)
    [again] = harness.gmes()
    assert again["metadata"]["uid"] == gme["metadata"]["uid"]
    assert again["status"]["attempt"] == 2
    assert again["status"]["imageID"] == f"pytorch/pytorch@{NEW}"
    assert not records.is_stale(again)
    assert _condition(again, "Stale")[:2] == ("False", "Current")
    assert _condition(again, "Estimated")[:2] == ("True", "Traced")
    assert again["status"]["podName"] != gme["status"]["podName"]  # a new estimation pod
    assert again["status"]["completionTime"] >= marked["status"]["stale"]["time"]


def test_a_script_edited_in_its_config_map_and_submitted_again_gets_a_new_estimation(
        harness: Harness) -> None:
    harness.controller()
    first = harness.submit(training_job("first"))
    harness.wait_released("first", timeout=240)
    [before] = harness.gmes()
    assert before["metadata"]["name"] == records.name_for(
        first["metadata"]["annotations"][labels.FINGERPRINT])
    code = harness.get("v1", "ConfigMap", "code")
    assert code is not None
    assert before["status"]["inputs"] == [
        {"kind": "ConfigMap", "name": "code", "uid": code["metadata"]["uid"],
         "resourceVersion": code["metadata"]["resourceVersion"]}]
    assert _condition(before, "Stale")[:2] == ("False", "Current")

    # Same name, same job: only the script in the ConfigMap changed.
    edited = code_map(harness.namespace)
    edited["data"]["train_gpt.py"] += "\n# tuned: a second run of the same job\n"
    harness.cluster.apply(edited)
    # The estimate made from the old script says it no longer matches what runs.
    stale = wait(lambda: (lambda g: g if records.is_stale(g) else None)(harness.get(
        "xmem.io/v1alpha1", "GPUMemoryEstimate", before["metadata"]["name"])), 60,
        "the old estimate to be marked stale")
    status, reason, message, _ = _condition(stale, "Stale")
    assert (status, reason) == ("True", "ConfigMapChanged")
    assert message.startswith(f"ConfigMap code changed (resourceVersion "
                              f"{code['metadata']['resourceVersion']} -> ")
    second = harness.submit(training_job("second"))
    assert second["metadata"]["annotations"][labels.FINGERPRINT] != \
        first["metadata"]["annotations"][labels.FINGERPRINT]
    assert second["spec"]["suspend"] is True  # held: no estimate for the edited script
    released = harness.wait_released("second", timeout=240)
    after = {g["metadata"]["name"]: g for g in harness.gmes()}
    assert set(after) == {before["metadata"]["name"], released["metadata"]["annotations"][
        ESTIMATE_NAME]}
    new = after[released["metadata"]["annotations"][ESTIMATE_NAME]]
    assert new["metadata"]["name"] == records.name_for(
        second["metadata"]["annotations"][labels.FINGERPRINT])
    assert records.phase(new) == records.SUCCEEDED and new["status"]["podName"]
    assert new["status"]["podName"] != before["status"]["podName"]  # its own estimation pod
    assert _condition(new, "Stale")[:2] == ("False", "Current")
    old = after[before["metadata"]["name"]]
    assert (old["metadata"]["uid"], old["status"]["completionTime"]) == \
        (before["metadata"]["uid"], before["status"]["completionTime"])
