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
    [policy] = find(render({}), "ValidatingAdmissionPolicy")
    [binding] = find(render({}), "ValidatingAdmissionPolicyBinding")
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
    lambda o: o["status"].update(requestBytes=1),
    lambda o: o["status"].pop("estimates"),
    lambda o: o["spec"].update(fingerprint="b" * 32),
    lambda o: o.pop("status"),
])
def test_a_tenant_cannot_rewrite_what_an_estimate_says(admit, change):
    forged = copy.deepcopy(SUCCEEDED)
    change(forged)
    assert not admit("alice", "UPDATE", forged, SUCCEEDED)


def test_a_measuring_tool_may_record_the_actual_peak_and_the_garbage_collector_its_owners(admit):
    measured = _changed(actualBytes=40 << 30, actual="40.0Gi", error="+2.5%")
    assert admit("system:serviceaccount:monitoring:gpu-meter", "UPDATE", measured, SUCCEEDED)
    regarbaged = copy.deepcopy(SUCCEEDED)
    regarbaged["metadata"]["ownerReferences"] = []
    assert admit("system:serviceaccount:kube-system:generic-garbage-collector", "UPDATE",
                 regarbaged, SUCCEEDED)
