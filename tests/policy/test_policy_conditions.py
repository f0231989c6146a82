"""A policy on the real control plane: the API server refuses a wrong one with the field's path
(the CRD's schema and CEL rules), and the controller says in the policy's status (conditions
Accepted and Ready, observedGeneration), in ``kubectl get`` and in an Event whether it could load
one the schema cannot judge (a GPU model the catalogue lacks)."""

from __future__ import annotations

import copy
import subprocess
from typing import Any, Dict, List, Optional

import pytest
import yaml

from localkube.controlplane import wait_for
from tests.support.schemas import ROOT
from xmem_admission.cluster.policy.model import Policy
from xmem_admission.contract.errors import PolicyError

EXAMPLE = ROOT / "examples" / "policy.yaml"
GROUP = ("xmem.io", "v1alpha1", "gpuadmissionpolicies")


def policy(name: str, **changes: Any) -> Dict[str, Any]:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": name}
    body["spec"].update(changes)
    return body


def kubectl(cluster: Any, *args: str, stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "--kubeconfig", str(cluster.plane.admin_kubeconfig), *args],
                          input=stdin, capture_output=True, text=True, timeout=120)


def condition(obj: Optional[Dict[str, Any]], kind: str) -> Dict[str, Any]:
    found = [c for c in ((obj or {}).get("status") or {}).get("conditions") or []
             if c.get("type") == kind]
    return found[0] if found else {}


def wrong_policies() -> List[Any]:
    base = yaml.safe_load(EXAMPLE.read_text())["spec"]
    no_default = copy.deepcopy(base["onEstimationFailure"])
    no_default.pop("defaultRequest")
    twice = base["targets"] + [dict(base["targets"][0])]
    toleration = {"placement": {"tolerations": [{"key": "gpu", "operator": "Exists",
                                                 "value": "yes"}]}}
    return [
        pytest.param({"onEstimationFailure": no_default},
                     "spec.onEstimationFailure.defaultRequest", "action Default needs a "
                     "defaultRequest", id="default-without-request"),
        pytest.param({"onEstimationFailure": {"action": "Release"},
                      "overrides": [{"namespaces": ["team-*"],
                                     "onEstimationFailure": {"action": "Default"}}]},
                     "spec.overrides", "an override's onEstimationFailure.action Default needs a "
                     "defaultRequest", id="override-default-without-request"),
        pytest.param({"targets": twice}, "spec.targets[2]", "Duplicate value", id="gpu-twice"),
        pytest.param({"rightSizing": {"prometheus": {"url": "http://prometheus:9090",
                                                     "caFile": "/etc/ca.pem"}}},
                     "spec.rightSizing.prometheus.caFile", "caFile is for an https url",
                     id="ca-file-on-http"),
        pytest.param({"estimation": toleration},
                     "spec.estimation.placement.tolerations[0].value",
                     "value must be empty when operator is Exists", id="exists-with-value"),
        pytest.param({"learnedOverhead": {"minJobs": 60, "recentJobs": 50}},
                     "spec.learnedOverhead.minJobs", "minJobs is above recentJobs",
                     id="min-above-recent"),
        pytest.param({"dra": {"driver": "Nvidia", "cores": 50}}, "spec.dra.cores",
                     "cores is HAMi's capacity", id="cores-not-hami"),
    ]


@pytest.mark.parametrize("change, path, message", wrong_policies())
def test_kubectl_apply_of_a_wrong_policy_is_refused_with_the_fields_path(
        cluster: Any, change: Dict[str, Any], path: str, message: str) -> None:
    body = policy("wrong-policy", **change)
    with pytest.raises(PolicyError):  # what xmem serve --policy FILE says of the same object
        Policy.from_object(body)
    done = kubectl(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(body))
    assert done.returncode != 0, done.stdout
    assert path in done.stderr and message in done.stderr, done.stderr
    assert kubectl(cluster, "get", "gpuadmissionpolicy", "wrong-policy").returncode != 0


def test_the_controller_reports_a_policy_it_cannot_load_in_its_status_and_an_event(
        cluster: Any) -> None:
    from kubernetes import client as k8s

    name = "conditions-test"
    custom = k8s.CustomObjectsApi(cluster.api)
    created = custom.create_cluster_custom_object(*GROUP, policy(name))
    controller = cluster.controller(f"controller-{name}", name)
    try:
        # A good policy: kubectl wait returns on Accepted, kubectl get shows it.
        done = kubectl(cluster, "wait", "--for=condition=Accepted", "--timeout=90s",
                       f"gpuadmissionpolicy/{name}")
        assert done.returncode == 0, (done.stderr, cluster.log(f"controller-{name}")[-3000:])
        good = custom.get_cluster_custom_object(*GROUP, name)
        assert good["status"]["observedGeneration"] == created["metadata"]["generation"]
        assert condition(good, "Ready")["reason"] == "InForce"
        table = kubectl(cluster, "get", "gap", name).stdout.splitlines()
        assert table[0].split()[:6] == ["NAME", "TARGETS", "ENFORCEMENT", "ACCEPTED", "REASON",
                                        "LEARNED"], table
        assert "True" in table[1].split() and "Valid" in table[1].split(), table

        # A GPU model the catalogue lacks: the API server cannot know the webhook's catalogue,
        # so it stores it; the controller says why it cannot use it, and the old one stays.
        good["spec"]["targets"][0]["gpu"] = "A100-90GB"
        bad = custom.replace_cluster_custom_object(*GROUP, name, good)
        generation = bad["metadata"]["generation"]

        def refused() -> Optional[Dict[str, Any]]:
            obj = custom.get_cluster_custom_object(*GROUP, name)
            accepted = condition(obj, "Accepted")
            return obj if accepted.get("status") == "False" and \
                accepted.get("observedGeneration") == generation else None

        obj = wait_for(refused, 60, "Accepted=False on the policy")
        accepted = condition(obj, "Accepted")
        assert accepted["reason"] == "Invalid"
        assert "spec.targets[0].gpu: unknown GPU 'A100-90GB'" in accepted["message"]
        assert obj["status"]["observedGeneration"] == generation
        ready = condition(obj, "Ready")
        assert (ready["status"], ready["reason"]) == ("True", "PreviousGenerationInForce")
        assert f"generation {generation - 1} stays in force" in ready["message"]
        row = kubectl(cluster, "get", "gap", name, "--no-headers").stdout.split()
        assert "False" in row and "Invalid" in row, row

        def event() -> Optional[Dict[str, Any]]:
            events = k8s.CoreV1Api(cluster.api).list_event_for_all_namespaces(
                field_selector=f"involvedObject.name={name},reason=PolicyRejected").items
            return events[0] if events else None

        found = wait_for(event, 30, "a PolicyRejected Event")
        assert found.type == "Warning" and "unknown GPU 'A100-90GB'" in found.message
        assert found.involved_object.kind == "GPUAdmissionPolicy"
        described = kubectl(cluster, "describe", "gap", name).stdout
        assert "PolicyRejected" in described, described

        # Fixed: Accepted again, for the new generation.
        obj["spec"]["targets"][0]["gpu"] = "A100-80GB"
        fixed = custom.replace_cluster_custom_object(*GROUP, name, obj)
        wait_for(lambda: condition(custom.get_cluster_custom_object(*GROUP, name), "Accepted")
                 .get("observedGeneration") == fixed["metadata"]["generation"], 60,
                 "Accepted on the fixed generation")
        assert condition(custom.get_cluster_custom_object(*GROUP, name),
                         "Accepted")["status"] == "True"
    finally:
        cluster.stop_process(controller)
        custom.delete_cluster_custom_object(*GROUP, name)
