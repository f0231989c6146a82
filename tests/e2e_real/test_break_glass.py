"""Break-glass on the real control plane (docs/operations.md, "Break-glass"): the API server
sends the requester's groups in userInfo, as it authenticates them (here by impersonation, as an
admin's kubectl --as/--as-group would). Under Enforce, a Job an on-call admin annotates is
admitted unchanged and its pod too; a tenant's same Job is held; the admin releases the held one
with the runbook's one merge patch, after the annotation alone was refused."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from localkube.controlplane import wait_for
from tests.e2e_real.support import job, policy
from tests.support.harness import metric
from xmem_admission.cluster import labels

GROUP = "xmem-breakglass"
ONCALL = {"Impersonate-User": "oncall", "Impersonate-Group": GROUP}
TENANT = {"Impersonate-User": "alice", "Impersonate-Group": "ml-team"}
REASON = "INC-4711: controller down"


def _may_edit(cluster, namespace, kind, name):
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": f"edit-{name}", "namespace": namespace},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": "edit"},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": kind,
                                 "name": name}]})


def _create(batch, obj, headers):
    answer = batch.create_namespaced_job(obj["metadata"]["namespace"], obj,
                                         _preload_content=False, _headers=headers)
    assert answer.status == 201, answer.data
    return json.loads(answer.data), answer.headers.get("Warning", "")


def _patch(batch, name, namespace, body, headers):
    return batch.patch_namespaced_job(name, namespace, body, _headers=headers,
                                      _content_type="application/merge-patch+json")


def test_an_admin_in_the_break_glass_group_gets_a_job_admitted_unchanged_under_enforce(xmem):
    cluster, ns = xmem.cluster, xmem.namespace
    cluster.apply(policy(ns, enforcement="Enforce"))
    xmem.webhook = cluster.serve(f"serve-{ns}", xmem.policy_name,
                                 extra=("--break-glass-group", GROUP))
    _may_edit(cluster, ns, "Group", GROUP)
    _may_edit(cluster, ns, "User", "alice")
    batch = client.BatchV1Api(cluster.api)

    urgent = job("urgent", ns, opt_in=False)
    urgent["metadata"]["annotations"] = {labels.BREAK_GLASS: REASON}
    created, warning = _create(batch, urgent, ONCALL)
    assert not created["spec"].get("suspend"), created["spec"]
    assert labels.HELD_REASON not in created["metadata"]["annotations"]
    assert created["spec"]["template"]["metadata"]["annotations"] == {labels.BREAK_GLASS: REASON}
    assert "xmem: break-glass by oncall: admitted unchanged" in warning, warning

    # The Job controller's pod reaches the webhook (the namespace is labelled) and is left alone.
    pod = wait_for(lambda: (xmem.pods("job-name=urgent") or [None])[0], 60, "the Job's pod")
    assert pod["metadata"]["annotations"][labels.BREAK_GLASS] == REASON
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpumem" not in limits and labels.REQUEST_BYTES not in \
        pod["metadata"]["annotations"]

    # A tenant's same Job: the annotation is ignored and the Job held, as any other.
    theirs = job("theirs", ns, opt_in=False)
    theirs["metadata"]["annotations"] = {labels.BREAK_GLASS: "me too"}
    held, warning = _create(batch, theirs, TENANT)
    assert held["spec"]["suspend"] is True
    assert "is not honoured: alice is in none of the webhook's break-glass groups" in warning

    # The admin releases it: the annotation alone is refused (it would stay held, for the
    # controller to size), the runbook's merge patch releases it.
    with pytest.raises(ApiException) as refused:
        _patch(batch, "theirs", ns, {"metadata": {"annotations": {labels.BREAK_GLASS: REASON}}},
               ONCALL)
    assert refused.value.status == 403
    message = json.loads(refused.value.body)["message"]
    assert "spec.suspend: false" in message and "spec.template.metadata.annotations" in message
    runbook = {"metadata": {"annotations": {labels.BREAK_GLASS: REASON}},
               "spec": {"suspend": False, "template": {"metadata": {"annotations": {
                   labels.BREAK_GLASS: REASON}}}}}
    with pytest.raises(ApiException) as tenant:
        _patch(batch, "theirs", ns, runbook, TENANT)
    assert tenant.value.status == 403
    released = _patch(batch, "theirs", ns, runbook, ONCALL)
    assert released.spec.suspend is False
    pod = wait_for(lambda: (xmem.pods("job-name=theirs") or [None])[0], 60, "the released pod")
    assert labels.REQUEST_BYTES not in pod["metadata"]["annotations"]

    # Counted once per use, and logged with who and why.
    log = cluster.log(xmem.webhook.name)
    assert re.search(rf"break-glass: Job {ns}/urgent admitted unchanged by oncall \(groups "
                     rf"{GROUP}, system:authenticated\): {REASON}", log), log
    health = re.search(r"health on http://127\.0\.0\.1:(\d+)", log).group(1)
    metrics = httpx.get(f"http://127.0.0.1:{health}/metrics", timeout=10).text
    assert metric(metrics, "xmem_admission_break_glass_total", namespace=ns, kind="Job") == 2
