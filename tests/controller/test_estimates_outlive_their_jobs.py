"""A recorded estimate belongs to no Job: copies share it without a refused request, it outlives
the Job that made it, and it is deleted only once unused past the policy's cacheTTLSeconds.

The controller runs as ``xmem controller`` with the chart's ServiceAccount and RBAC, on the real
API server with OwnerReferencesPermissionEnforcement (``localkube.controlplane``): a write the
chart's role does not allow is refused there, and the controller's log says so.
"""

from __future__ import annotations

import subprocess
from typing import Any, Dict, List

from tests.controller.support import Harness, policy_spec, template_annotations, training_job, wait
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.controller.workloads import ESTIMATE_NAME
from xmem_admission.cluster.kube.client import GME

COPIES = 5


def _chart_controller(harness: Harness, name: str) -> subprocess.Popen:
    """``xmem controller`` as the chart's ServiceAccount, reading the harness's policy from the
    cluster (a GPUAdmissionPolicy named after the test's namespace)."""
    harness.cluster.apply({"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                           "metadata": {"name": harness.namespace}, "spec": harness.spec})
    return harness.cluster.controller(name, harness.namespace)


def _refusals(log: str) -> List[str]:
    return [line for line in log.splitlines() if "Forbidden" in line or " 403 " in line]


def _gme(harness: Harness) -> Dict[str, Any]:
    [gme] = harness.gmes()
    return gme


def test_copies_share_one_estimate_and_deleting_the_first_job_leaves_it_for_the_others(
        harness: Harness) -> None:
    name = f"{harness.namespace}-ctl"
    controller = _chart_controller(harness, name)
    try:
        jobs = [harness.submit(training_job(f"copy-{i}")) for i in range(COPIES)]
        for job in jobs:
            harness.wait_released(job["metadata"]["name"], timeout=240)
        gme = _gme(harness)
        assert records.phase(gme) == records.SUCCEEDED
        assert "ownerReferences" not in gme["metadata"], gme["metadata"]
        assert gme["status"]["lastUsedTime"]
        assert gme["status"]["attempt"] == 1  # one estimation for all the copies
        for job in jobs:
            sized = harness.job(job["metadata"]["name"])
            assert sized["metadata"]["annotations"][ESTIMATE_NAME] == gme["metadata"]["name"]
            assert int(template_annotations(sized)["xmem.io/request-bytes"]) == \
                gme["status"]["requestBytes"]
        assert _refusals(harness.cluster.log(name)) == []

        # The first Job goes, and the garbage collector with it deletes its dependents: the
        # estimate is none of them.
        first = jobs[0]["metadata"]["name"]
        harness.cluster.delete("batch/v1", "Job", first, harness.namespace)
        wait(lambda: harness.get("batch/v1", "Job", first) is None, 60, f"job {first} deleted")
        wait(lambda: not [p for p in harness.cluster.list("v1", "Pod", harness.namespace,
                                                           f"job-name={first}")],
             60, f"the pods of {first} to be garbage-collected")
        kept = _gme(harness)
        assert kept["metadata"]["uid"] == gme["metadata"]["uid"]
        for job in jobs[1:]:
            assert "xmem.io/request-bytes" in template_annotations(
                harness.job(job["metadata"]["name"]))

        # A new copy is sized from the same estimate: no second estimation pod.
        harness.submit(training_job("copy-late"))
        late = harness.wait_released("copy-late", timeout=120)
        assert late["metadata"]["annotations"][ESTIMATE_NAME] == gme["metadata"]["name"]
        again = _gme(harness)
        assert again["metadata"]["uid"] == gme["metadata"]["uid"]
        assert (again["status"]["attempt"], again["status"]["completionTime"]) == \
            (1, gme["status"]["completionTime"])  # sized from it, not estimated again
        assert _refusals(harness.cluster.log(name)) == []
    finally:
        harness.cluster.stop_process(controller)


def test_an_unused_estimate_past_its_ttl_is_deleted_and_one_a_held_job_waits_on_is_kept(
        harness: Harness) -> None:
    harness.use(policy_spec(estimation={"cacheTTLSeconds": 3},
                            onEstimationFailure={"action": "Hold"}))
    name = f"{harness.namespace}-ctl"
    controller = _chart_controller(harness, name)
    try:
        # A script that fails: its Job stays held (Hold) on a failed estimate past the TTL.
        harness.submit(training_job("broken", script="fails_before_step.py", args=()))
        failed = wait(lambda: next((g for g in harness.gmes()
                                    if records.phase(g) == records.FAILED), None),
                      180, "the broken job's estimate to fail")
        harness.submit(training_job("train"))
        harness.wait_released("train", timeout=240)
        used = next(g for g in harness.gmes() if g["metadata"]["uid"] != failed["metadata"]["uid"])
        wait(lambda: harness.get("xmem.io/v1alpha1", "GPUMemoryEstimate",
                                 used["metadata"]["name"]) is None,
             120, "the released job's estimate to be deleted past cacheTTLSeconds")
        assert f"deleted GPUMemoryEstimate {harness.namespace}/{used['metadata']['name']}: " \
            "unused for" in harness.cluster.log(name)
        # Deleted in the pass that saw the failed one past its TTL too (it completed first).
        kept = harness.get("xmem.io/v1alpha1", "GPUMemoryEstimate", failed["metadata"]["name"])
        assert kept is not None and kept["metadata"]["uid"] == failed["metadata"]["uid"]
        broken = harness.job("broken")
        assert broken["spec"]["suspend"] is True
        assert broken["metadata"]["annotations"]["xmem.io/held-reason"] == "EstimationFailed"
        assert _refusals(harness.cluster.log(name)) == []
    finally:
        harness.cluster.stop_process(controller)


def test_an_estimate_an_older_release_gave_owner_references_loses_them(harness: Harness) -> None:
    job = harness.submit(training_job("train"))
    fp = job["metadata"]["annotations"]["xmem.io/fingerprint"]
    body = records.new(job, fp, ["A100-80GB", "H100-80GB"], "img")
    m = job["metadata"]
    body["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job",
                                            "name": m["name"], "uid": m["uid"]}]
    legacy = harness.kube().create(GME, harness.namespace, body)
    assert legacy["metadata"]["ownerReferences"]
    name = f"{harness.namespace}-ctl"
    controller = _chart_controller(harness, name)
    try:
        bare = wait(lambda: (lambda g: g if g and not g["metadata"].get("ownerReferences")
                             else None)(harness.get("xmem.io/v1alpha1", "GPUMemoryEstimate",
                                                    legacy["metadata"]["name"])),
                    120, "the owner references to be dropped")
        assert bare["metadata"]["uid"] == legacy["metadata"]["uid"]
        harness.wait_released("train", timeout=240)
        harness.cluster.delete("batch/v1", "Job", "train", harness.namespace)
        wait(lambda: harness.get("batch/v1", "Job", "train") is None, 60, "job train deleted")
        wait(lambda: not harness.cluster.list("v1", "Pod", harness.namespace, "job-name=train"),
             60, "the pods of train to be garbage-collected")
        assert harness.get("xmem.io/v1alpha1", "GPUMemoryEstimate",
                           legacy["metadata"]["name"]) is not None
        assert _refusals(harness.cluster.log(name)) == []
    finally:
        harness.cluster.stop_process(controller)
