"""The control plane under the e2e tests is the real one, at the pinned release, with RBAC on,
and its nodes are up: the project's process node and kwok's GPU nodes."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from localkube import tools
from localkube.controlplane import wait_for
from localkube.kwok import gpu_node


def test_the_api_server_is_the_pinned_release(cluster):
    pinned = tools.versions()["KUBERNETES_VERSION"]
    assert cluster.plane.version() == f"Kubernetes {pinned}"
    served = json.loads(client.VersionApi(cluster.api).get_code(_preload_content=False).data)
    assert served["gitVersion"] == pinned


def test_rbac_refuses_a_user_nothing_was_granted_to(cluster):
    stranger = cluster.plane.api_client(cluster.plane.user_kubeconfig("mallory"))
    try:
        with pytest.raises(client.ApiException) as refused:
            client.CoreV1Api(stranger).list_namespaced_pod("default")
        assert refused.value.status == 403
        message = json.loads(refused.value.body)["message"]
        assert 'User "mallory" cannot list resource "pods"' in message
    finally:
        stranger.close()


def test_the_webhook_service_account_may_read_estimates_but_not_write_them(cluster):
    webhook = cluster.plane.api_client(cluster.webhook_kubeconfig)
    try:
        custom = client.CustomObjectsApi(webhook)
        custom.list_cluster_custom_object("xmem.io", "v1alpha1", "gpumemoryestimates")
        with pytest.raises(client.ApiException) as refused:
            custom.create_namespaced_custom_object(
                "xmem.io", "v1alpha1", "default", "gpumemoryestimates",
                {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUMemoryEstimate",
                 "metadata": {"name": "forged"}, "spec": {}})
        assert refused.value.status == 403
    finally:
        webhook.close()


def test_the_process_node_is_ready_and_advertises_no_gpu(cluster):
    def ready():
        node = cluster.get("v1", "Node", cluster.node.name)
        conditions = {c["type"]: c["status"] for c in node["status"].get("conditions") or []}
        return node if conditions.get("Ready") == "True" else None

    node = wait_for(ready, 30, "the process node to be Ready")
    assert not [r for r in node["status"]["allocatable"] if "gpu" in r or "mig" in r]


def test_a_kwok_gpu_node_turns_ready_with_its_gpu_resources(cluster):
    cluster.apply(gpu_node("smoke-a100", "A100-80GB", mig={"1g.10gb": 7}))
    try:
        def ready():
            node = cluster.get("v1", "Node", "smoke-a100")
            conditions = {c["type"]: c["status"] for c in node["status"].get("conditions") or []}
            return node if conditions.get("Ready") == "True" else None

        node = wait_for(ready, 60, "kwok to make the GPU node Ready")
        allocatable = node["status"]["allocatable"]
        assert allocatable["nvidia.com/gpu"] == "10"
        assert allocatable["nvidia.com/gpumem"] == node["metadata"]["labels"]["nvidia.com/gpu.memory"]
        assert allocatable["nvidia.com/mig-1g.10gb"] == "7"
    finally:
        cluster.delete("v1", "Node", "smoke-a100")
