"""What a real API server found, each test named after its item, on the real
control plane: kube-apiserver v1.36 with ``OwnerReferencesPermissionEnforcement`` on (OpenShift's
default), the controller-manager's garbage collector, and the webhook and controller running with
the chart's service accounts and RBAC. The controller-level versions of these regressions are
in tests/controller/test_what_a_real_api_server_found.py and tests/admission/."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
from typing import Any, Dict, Optional

import httpx
import yaml
from kubernetes import client

from localkube import tools
from localkube.cluster import CHART, LEASE, NAMESPACE, helm
from localkube.controlplane import wait_for
from tests.e2e_real.support import QUICK_LEASE, job, policy, template_annotations
from tests.support.harness import metric_sum
from xmem_admission.cluster import labels


def _metrics_port(xmem: Any, name: str) -> int:
    return int(wait_for(lambda: (lambda m: m.group(1) if m else None)(re.search(
        r"metrics on http://127\.0\.0\.1:(\d+)/metrics", xmem.cluster.log(name))), 60,
        f"{name} to serve its metrics"))


def _refusal(create: Any, what: str) -> client.ApiException:
    """Call ``create(attempt)`` until the API server refuses it (a policy or role change takes
    a moment to reach the webhook or RBAC); the refusal. What was accepted meanwhile stays."""
    attempts = iter(range(1000))

    def attempt() -> Optional[client.ApiException]:
        try:
            create(next(attempts))
        except client.ApiException as exc:
            return exc
        return None
    return wait_for(attempt, 30, what, interval=0.5)


def _lease_holder(cluster: Any) -> Optional[str]:
    lease = cluster.get("coordination.k8s.io/v1", "Lease", LEASE, NAMESPACE)
    return None if lease is None else (lease.get("spec") or {}).get("holderIdentity")


def test_1_a_leading_controller_survives_an_api_server_restart_and_still_releases(xmem):
    """The Lease renewal fails for longer than the renew deadline while the API server is down:
    the controller steps down (counted), stays alive, takes the Lease again and releases a Job
    submitted afterwards."""
    cluster = xmem.cluster
    xmem.serve()
    name = f"{xmem.namespace}-leader"
    controller = xmem.controller(name, *QUICK_LEASE)
    wait_for(lambda: _lease_holder(cluster) == name, 60, "the controller to take the Lease")
    cluster.plane.restart_apiserver()
    cluster.invalidate_discovery()
    assert controller.poll() is None, cluster.log(name)[-2000:]
    client.BatchV1Api(cluster.api).create_namespaced_job(xmem.namespace,
                                                         job("after-restart", xmem.namespace))
    released = xmem.wait_released("after-restart")
    assert int(template_annotations(released)[labels.REQUEST_BYTES]) > 0
    assert controller.poll() is None
    assert _lease_holder(cluster) == name
    log = cluster.log(name)
    assert "Traceback" not in log
    if "stepped down" in log:  # the restart outlasted the 3 s renew deadline
        port = _metrics_port(xmem, name)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert metric_sum(text, "xmem_controller_leadership_lost_total") >= 1


def test_1_a_leader_whose_lease_is_taken_stands_by_and_leads_again_when_it_expires(xmem):
    """Deterministic: another holder writes the Lease; the leader cannot renew, steps down
    (logged, counted), stays alive, takes the Lease once the other's expires, and reconciles."""
    cluster = xmem.cluster
    xmem.serve()
    name = f"{xmem.namespace}-leader"
    controller = xmem.controller(name, *QUICK_LEASE)
    wait_for(lambda: _lease_holder(cluster) == name, 60, "the controller to take the Lease")
    coordination = client.CoordinationV1Api(cluster.api)
    lease = coordination.read_namespaced_lease(LEASE, NAMESPACE)
    now = datetime.datetime.now(datetime.timezone.utc)
    lease.spec.holder_identity, lease.spec.acquire_time, lease.spec.renew_time = \
        "intruder", now, now
    coordination.replace_namespaced_lease(LEASE, NAMESPACE, lease)
    wait_for(lambda: "stepped down; standing by to lead again" in cluster.log(name), 60,
             "the leader to step down")
    assert controller.poll() is None
    wait_for(lambda: _lease_holder(cluster) == name, 60, "the controller to lead again")
    client.BatchV1Api(cluster.api).create_namespaced_job(xmem.namespace,
                                                         job("after-stepping-down", xmem.namespace))
    xmem.wait_released("after-stepping-down")
    port = _metrics_port(xmem, name)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert metric_sum(text, "xmem_controller_leadership_lost_total") >= 1
    assert controller.poll() is None


def test_2_a_namespace_override_of_one_nested_field_keeps_the_others(xmem):
    """The override sets only ``estimation.maxHoldSeconds``; the estimation pod still gets the
    defaults' deadline and memory. The override also survives the CRD's structural schema (a
    real API server prunes fields its schema does not name)."""
    cluster = xmem.cluster
    body = policy(xmem.namespace, estimation={"activeDeadlineSeconds": 170,
                                              "resources": {"cpu": "1", "memory": "1536Mi"}})
    body["spec"]["overrides"] = [{"namespaces": [xmem.namespace],
                                  "estimation": {"maxHoldSeconds": 150}}]
    cluster.apply(body)
    stored = cluster.get("xmem.io/v1alpha1", "GPUAdmissionPolicy", xmem.namespace)
    assert stored["spec"]["overrides"][0]["estimation"] == {"maxHoldSeconds": 150}
    xmem.serve()
    xmem.controller("", "--no-leader-election")
    client.BatchV1Api(cluster.api).create_namespaced_job(xmem.namespace,
                                                         job("merged", xmem.namespace))
    pod = wait_for(lambda: next(iter(xmem.estimation_pods()), None), 120, "the estimation pod")
    assert pod["spec"]["activeDeadlineSeconds"] == 170
    assert pod["spec"]["containers"][0]["resources"]["limits"]["memory"] == "1536Mi"
    xmem.wait_released("merged")


def _hand_sized(name: str, namespace: str) -> Dict[str, Any]:
    """The same training Job as the estimated one, with a hand-set HAMi request of 64 MiB,
    below even the CUDA context the estimate includes."""
    return job(name, namespace, gpu_resources={"nvidia.com/gpumem": "64"})


def test_3_an_enforced_namespace_still_lets_a_job_below_its_estimate_be_labelled_and_deleted(
        xmem):
    """Stored under Warn, the Job is below its recorded estimate; after the switch to Enforce a
    ``kubectl label`` and a foreground deletion (the garbage collector's update removing the
    ``foregroundDeletion`` finalizer) both pass, while a new such Job is refused."""
    cluster = xmem.cluster
    batch = client.BatchV1Api(cluster.api)
    xmem.serve()
    xmem.controller("", "--no-leader-election")
    batch.create_namespaced_job(xmem.namespace, job("estimated", xmem.namespace))
    xmem.wait_released("estimated")

    stored = batch.create_namespaced_job(xmem.namespace, _hand_sized("low", xmem.namespace))
    assert not stored.spec.suspend
    # Its pod too is made under Warn: the Job controller, lagging on a busy machine, would
    # otherwise create it after the switch, and the webhook rightly refuses that pod (a
    # FailedCreate Event that says "denied", which is not what this test is about).
    wait_for(lambda: xmem.pods("app=low"), 60, "the Job's pod, created under Warn")
    cluster.apply(policy(xmem.namespace, enforcement="Enforce"))
    refused = _refusal(lambda n: batch.create_namespaced_job(
        xmem.namespace, _hand_sized(f"refused-{n}", xmem.namespace)),
        "the webhook to enforce the changed policy")
    assert refused.status == 403, refused.body
    assert "nvidia.com/gpumem" in json.loads(refused.body)["message"]

    labelled = batch.patch_namespaced_job("low", xmem.namespace,
                                          {"metadata": {"labels": {"owner": "alice"}}})
    assert labelled.metadata.labels["owner"] == "alice"
    batch.delete_namespaced_job("low", xmem.namespace, propagation_policy="Foreground")
    wait_for(lambda: cluster.get("batch/v1", "Job", "low", xmem.namespace) is None, 120,
             "the foreground deletion to finish")
    # The label and the deletion were not refused, nor the Job controller's and the garbage
    # collector's writes to the Job on the way.
    denied = [e for e in xmem.events("low") if "denied" in (e.get("message") or "")]
    assert not denied, denied


def test_4_estimation_pods_are_created_where_owner_reference_permissions_are_enforced(xmem):
    """The estimation pod blocks its GPUMemoryEstimate's deletion, which the admission plugin
    allows only to a user who may update ``gpumemoryestimates/finalizers``: the chart's
    controller role may, a role with only ``pods: create`` may not (the plugin is on)."""
    cluster = xmem.cluster
    assert "OwnerReferencesPermissionEnforcement" in " ".join(cluster.plane.apiserver_argv())
    xmem.serve()
    xmem.controller("", "--no-leader-election")
    client.BatchV1Api(cluster.api).create_namespaced_job(xmem.namespace,
                                                         job("owned", xmem.namespace))
    pod = wait_for(lambda: next(iter(xmem.estimation_pods()), None), 120, "the estimation pod")
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "GPUMemoryEstimate" and owner["blockOwnerDeletion"] is True
    xmem.wait_released("owned")

    rbac = client.RbacAuthorizationV1Api(cluster.api)
    rbac.create_namespaced_role(xmem.namespace, {
        "metadata": {"name": "pods-only"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}]})
    rbac.create_namespaced_role_binding(xmem.namespace, {
        "metadata": {"name": "pods-only"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "pods-only"},
        "subjects": [{"kind": "ServiceAccount", "name": "pods-only",
                      "namespace": xmem.namespace}]})
    kubeconfig = cluster.plane.service_account_kubeconfig(xmem.namespace, "pods-only")
    api = cluster.plane.api_client(kubeconfig)
    try:
        core = client.CoreV1Api(api)
        forged = {"metadata": {"name": "forged", "ownerReferences": [owner]},
                  "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
        refused = wait_for(lambda: (lambda e: e if e.status != 403 or "blockOwnerDeletion"
                                    in e.body else None)(_refusal(
            lambda _: core.create_namespaced_pod(xmem.namespace, forged, dry_run="All"),
            "a refusal")),
            60, "RBAC to grant pods: create, and the plugin to refuse blockOwnerDeletion")
        assert refused.status == 403, refused.body
        assert "cannot set blockOwnerDeletion" in json.loads(refused.body)["message"]
        plain = {**forged, "metadata": {"name": "plain"}}
        assert core.create_namespaced_pod(xmem.namespace, plain,
                                         dry_run="All").metadata.name == "plain"
    finally:
        api.close()


def test_5_a_lease_the_controller_may_not_use_is_loud_counted_and_fails_readiness(xmem):
    """The chart's role names one Lease; a controller told another gets 403 on every attempt:
    an ERROR naming the flag, a counted 403 and a failing /readyz, never a silent standby."""
    cluster = xmem.cluster
    name = f"{xmem.namespace}-wrong-lease"
    process = xmem.controller(name, "--lease-name", "not-the-charts-lease",
                              "--lease-unready-seconds", "2", *QUICK_LEASE[2:])
    port = _metrics_port(xmem, name)

    def unready() -> str:
        reply = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
        return reply.text if reply.status_code == 503 else ""

    why = wait_for(unready, 60, "readiness to fail")
    assert f"cannot read Lease {NAMESPACE}/not-the-charts-lease" in why and "403" in why
    log = cluster.log(name)
    assert "ERROR" in log and "--lease-name" in log
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert metric_sum(text, "xmem_controller_lease_errors_total", code="403") >= 1
    assert process.poll() is None


def test_9_helm_install_leaves_an_existing_policy_of_that_name_alone(cluster):
    """``kubectl apply -f examples/policy.yaml`` first, then ``helm install``: the install
    succeeds, the admin's policy keeps its spec and owner, and uninstalling leaves it."""
    name, release, namespace = "helm-existing", "helm-existing", "helm-existing"
    existing = yaml.safe_load((CHART.parents[1] / "examples" / "policy.yaml").read_text())
    existing["metadata"] = {"name": name}
    cluster.apply(existing)
    values = {"certificates": {"mode": "certManager"}, "policy": {"name": name},
              "image": {"repository": "registry.example/xmem-admission"}}  # required, not pulled

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [helm(), *args, "--kubeconfig", str(cluster.plane.admin_kubeconfig),
             "--namespace", namespace], input=yaml.safe_dump(values),
            capture_output=True, text=True, timeout=300)

    try:
        for crd in ("cert-manager.io_certificates.yaml", "cert-manager.io_issuers.yaml"):
            obj = yaml.safe_load(tools.crd(crd).read_text())
            cluster.apply(obj)
            cluster.wait_established(obj["metadata"]["name"])
        done = run("install", release, str(CHART), "--create-namespace", "--force-conflicts",
                   "--values", "-")
        assert done.returncode == 0, done.stderr
        kept = cluster.get("xmem.io/v1alpha1", "GPUAdmissionPolicy", name)
        assert kept["spec"] == {**kept["spec"], **existing["spec"]}
        assert "app.kubernetes.io/managed-by" not in (kept["metadata"].get("labels") or {})
        done = run("uninstall", release, "--wait")
        assert done.returncode == 0, done.stderr
        assert cluster.get("xmem.io/v1alpha1", "GPUAdmissionPolicy", name) is not None
    finally:
        cluster.delete("xmem.io/v1alpha1", "GPUAdmissionPolicy", name)
        cluster.delete("v1", "Namespace", namespace)
