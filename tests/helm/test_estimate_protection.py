"""Only the controller records estimates: the chart's ValidatingAdmissionPolicy on
GPUMemoryEstimates, evaluated with a real CEL implementation (cel-expr-python; the API server
runs the Go one, same language) against the writes a tenant or a measuring tool would make."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import pytest

from tests.helm.chart import NAMESPACE, RELEASE, find, render

cel = pytest.importorskip(
    "cel_expr_python.cel",
    reason="cel-expr-python (test extra, Python >= 3.11) is not installed: `make venv`",
)

CONTROLLER = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-xmem-admission-controller"
SUCCEEDED = {
    "apiVersion": "xmem.io/v1alpha1", "kind": "GPUMemoryEstimate",
    "metadata": {"name": "gme-" + "a" * 32, "namespace": "team-b"},
    "spec": {"fingerprint": "a" * 32, "workload": {"kind": "Job", "name": "train"},
             "gpus": ["A100-80GB"]},
    "status": {"phase": "Succeeded", "attempt": 1, "estimates": [
        {"gpu": "A100-80GB", "capacityBytes": 84970559242, "peakReservedBytes": 40 << 30,
         "totalBytes": 41 << 30, "recommendedRequestBytes": 43 << 30, "fits": True}],
        "gpu": "A100-80GB", "estimateBytes": 41 << 30, "requestBytes": 44 << 30},
}


@pytest.fixture(scope="module")
def admit():
    [policy] = find(render({}), "ValidatingAdmissionPolicy", f"{RELEASE}-xmem-admission-estimates")
    [binding] = find(render({}), "ValidatingAdmissionPolicyBinding",
                     f"{RELEASE}-xmem-admission-estimates")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert {r for rule in rules for r in rule["resources"]} == {
        "gpumemoryestimates", "gpumemoryestimates/status"}
    env = cel.NewEnv(variables={n: cel.Type.DYN for n in
                                ("object", "oldObject", "request", "variables")})
    variables = {v["name"]: env.compile(v["expression"]) for v in policy["spec"]["variables"]}
    checks = [env.compile(v["expression"]) for v in policy["spec"]["validations"]]

    def allowed(user: str, operation: str, obj: Dict[str, Any],
                old: Optional[Dict[str, Any]] = None) -> bool:
        data: Dict[str, Any] = {"object": obj, "oldObject": old,
                                "request": {"operation": operation, "userInfo": {"username": user}}}
        data["variables"] = {n: p.eval(data=data).value() for n, p in variables.items()}
        return all(check.eval(data=data).value() is True for check in checks)

    return allowed


def _changed(**status: Any) -> Dict[str, Any]:
    out = copy.deepcopy(SUCCEEDED)
    out["status"].update(status)
    return out


def test_the_controller_creates_and_updates_estimates(admit):
    assert admit(CONTROLLER, "CREATE", SUCCEEDED)
    assert admit(CONTROLLER, "UPDATE", _changed(totalBytes=1), SUCCEEDED)


@pytest.mark.parametrize("user", ["alice", "system:serviceaccount:team-a:default",
                                  f"system:serviceaccount:{NAMESPACE}:default"])
def test_nobody_else_creates_an_estimate(admit, user):
    assert not admit(user, "CREATE", SUCCEEDED)


@pytest.mark.parametrize("change", [
    lambda o: o["status"]["estimates"][0].update(totalBytes=1 << 30),  # a forged small estimate
    lambda o: o["status"].update(phase="Failed"),
    lambda o: o["status"].update(conditions=[
        {"type": "Failed", "status": "True", "reason": "ScriptFailed", "message": "forged",
         "lastTransitionTime": "2026-01-31T12:00:00Z"}]),
    lambda o: o["status"].update(observedGeneration=7),
    lambda o: o["status"].update(stale={"reason": "ConfigMapChanged", "message": "forged"}),
    lambda o: o["status"].update(inputs=[{"kind": "ConfigMap", "name": "code", "uid": "u",
                                          "resourceVersion": "1"}]),
    lambda o: o["status"].update(requestBytes=1),
    # what judges staleness, trial sharing and the cache's TTL
    lambda o: o["status"].update(imageID="docker.io/pytorch/pytorch@sha256:" + "0" * 64),
    lambda o: o["status"].update(allocationDigest="f" * 32),  # makes an option look neutral
    lambda o: o["status"].update(sharedFrom={"estimate": "gme-" + "b" * 32,
                                             "options": ["--batch-size"]}),
    lambda o: o["status"].update(lastUsedTime="2099-01-01T00:00:00Z"),  # never collected
    lambda o: o["status"].update(overhead={"gpu": "A100-80GB", "source": "Pinned"},
                                 overheadApplied="pinned", range="41-42Gi",
                                 claim="gpu.nvidia.com memory=1Gi"),
    lambda o: o["status"].pop("estimates"),
    lambda o: o["spec"].update(fingerprint="b" * 32),
    lambda o: o.pop("status"),
])
def test_a_tenant_cannot_rewrite_what_an_estimate_says(admit, change):
    forged = copy.deepcopy(SUCCEEDED)
    change(forged)
    assert not admit("alice", "UPDATE", forged, SUCCEEDED)


RETRY = {"workload": {"kind": "Job", "name": "train", "uid": "u-1"}, "ooms": 1,
         "gpu": "A100-80GB", "failedRequestBytes": 44 << 30, "requestBytes": 50 << 30}


@pytest.mark.parametrize("change", [
    lambda o: o["status"].update(oomRetries=[dict(RETRY, requestBytes=80 << 30)]),  # grow it
    lambda o: o["status"].update(oomRetries=[dict(RETRY, gaveUp="")]),  # undo giving up
    lambda o: o["status"].pop("oomRetries"),  # forget the OOMs
])
def test_only_the_controller_writes_what_sizes_a_retry_after_an_oom(admit, change):
    """status.oomRetries sizes the workload's next pod: a tenant can neither add,
    grow nor remove it; the controller can."""
    before = _changed(oomRetries=[dict(RETRY, gaveUp="at the cap")])
    forged = copy.deepcopy(before)
    change(forged)
    assert not admit("alice", "UPDATE", forged, before)
    assert not admit("alice", "UPDATE", _changed(oomRetries=[RETRY]), SUCCEEDED)
    assert admit(CONTROLLER, "UPDATE", forged, before)


def test_a_measuring_tool_may_record_the_actual_peak_and_the_garbage_collector_its_owners(admit):
    measured = _changed(actualBytes=40 << 30, actual="40.0Gi", relativeErrorPercent=3)
    assert admit("system:serviceaccount:monitoring:gpu-meter", "UPDATE", measured, SUCCEEDED)
    regarbaged = copy.deepcopy(SUCCEEDED)
    regarbaged["metadata"]["ownerReferences"] = []
    assert admit("system:serviceaccount:kube-system:generic-garbage-collector", "UPDATE",
                 regarbaged, SUCCEEDED)


RUN = {"workload": {"kind": "Job", "name": "train", "uid": "u-1"}, "gpu": "A100-80GB",
       "estimateBytes": 41 << 30, "requestBytes": 44 << 30, "completed": True,
       "finished": "2026-01-31T12:00:00Z", "pods": 1, "observedPeakBytes": 38 << 30,
       "source": "HAMi", "series": 1}
OBSERVED = {"runs": [RUN], "observedPeakBytes": 38 << 30, "observedPeak": "38.0Gi",
            "observedPercent": 93}


@pytest.mark.parametrize("change", [
    lambda o: o["status"]["runs"][0].update(observedPeakBytes=80 << 30),  # inflate a peak
    lambda o: o["status"]["runs"].append(dict(RUN, workload=dict(RUN["workload"], uid="u-2"),
                                              observedPeakBytes=1 << 30)),  # a run never run
    lambda o: o["status"].pop("runs"),  # forget what was used
    lambda o: o["status"].update(observedPercent=10),
])
def test_only_the_controller_writes_what_finished_runs_used(admit, change):
    """status.runs sizes the fingerprint's next job (right-sizing), and the observed
    columns go with it: a tenant can neither add, change nor remove them; the controller can."""
    before = _changed(**copy.deepcopy(OBSERVED))
    forged = copy.deepcopy(before)
    change(forged)
    assert not admit("alice", "UPDATE", forged, before)
    assert not admit("alice", "UPDATE", _changed(**copy.deepcopy(OBSERVED)), SUCCEEDED)
    assert admit(CONTROLLER, "UPDATE", forged, before)
