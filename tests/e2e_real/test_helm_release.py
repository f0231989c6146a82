"""`helm install`, `helm upgrade` and `helm uninstall` of the chart against the real API server:
every object is validated by the server (the chart's and third-party CRDs' schemas included), an
upgrade with changed values changes the objects, and an uninstall leaves nothing behind but the
CRDs.

The release uses cert-manager for its certificate (no hook Job: nothing here would run the chart's
image) with the ServiceMonitor and PrometheusRule on; those CRDs come from the cert-manager and
prometheus-operator Go modules (``make tools``)."""

from __future__ import annotations

import subprocess
from typing import Any, Dict, List

import yaml

from localkube import tools
from localkube.cluster import CHART, helm
from localkube.controlplane import wait_for

RELEASE = "helm-e2e"
NAMESPACE = "helm-e2e"
THIRD_PARTY_CRDS = ("monitoring.coreos.com_servicemonitors.yaml",
                    "monitoring.coreos.com_prometheusrules.yaml",
                    "cert-manager.io_certificates.yaml", "cert-manager.io_issuers.yaml",
                    "cert-manager.io_clusterissuers.yaml",
                    "cert-manager.io_certificaterequests.yaml")
VALUES: Dict[str, Any] = {
    "image": {"repository": "registry.example/xmem-admission"},  # required; never pulled here
    "certificates": {"mode": "certManager"},
    "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
    "policy": {"name": "helm-e2e"},
}
# Every kind the chart can create, and where (None: cluster-scoped).
KINDS = [("v1", "ServiceAccount", NAMESPACE), ("v1", "Service", NAMESPACE),
         ("v1", "ConfigMap", NAMESPACE), ("apps/v1", "Deployment", NAMESPACE),
         ("policy/v1", "PodDisruptionBudget", NAMESPACE),
         ("networking.k8s.io/v1", "NetworkPolicy", NAMESPACE),
         ("rbac.authorization.k8s.io/v1", "Role", NAMESPACE),
         ("rbac.authorization.k8s.io/v1", "RoleBinding", NAMESPACE),
         ("rbac.authorization.k8s.io/v1", "ClusterRole", None),
         ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", None),
         ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", None),
         ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration", None),
         ("xmem.io/v1alpha1", "GPUAdmissionPolicy", None),
         ("cert-manager.io/v1", "Certificate", NAMESPACE),
         ("cert-manager.io/v1", "Issuer", NAMESPACE),
         ("monitoring.coreos.com/v1", "ServiceMonitor", NAMESPACE),
         ("monitoring.coreos.com/v1", "PrometheusRule", NAMESPACE)]


def _helm(cluster: Any, *args: str, values: Dict[str, Any] = VALUES) -> str:
    argv = [helm(), *args, "--kubeconfig", str(cluster.plane.admin_kubeconfig),
            "--namespace", NAMESPACE]
    if values is not None:
        argv += ["--values", "-"]
    done = subprocess.run(argv, input=yaml.safe_dump(values or {}), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _released_objects(cluster: Any) -> List[str]:
    selector = f"app.kubernetes.io/instance={RELEASE}"
    found = []
    for api_version, kind, namespace in KINDS:
        for obj in cluster.list(api_version, kind, namespace, selector):
            found.append(f"{kind}/{obj['metadata']['name']}")
    return sorted(found)


def test_the_chart_installs_upgrades_and_uninstalls_cleanly_on_the_real_api_server(cluster):
    for name in THIRD_PARTY_CRDS:
        crd = yaml.safe_load(tools.crd(name).read_text())
        cluster.apply(crd)
        cluster.wait_established(crd["metadata"]["name"])

    # The session installed the CRDs already (server-side apply, another field manager): helm 4
    # applies the chart's CRDs server-side too, and takes them over.
    _helm(cluster, "install", RELEASE, str(CHART), "--create-namespace", "--force-conflicts")
    installed = _released_objects(cluster)
    assert "Certificate/helm-e2e-xmem-admission-webhook" in installed, installed
    assert {"ServiceMonitor", "PrometheusRule", "MutatingWebhookConfiguration",
            "GPUAdmissionPolicy", "Deployment"} <= {o.split("/")[0] for o in installed}
    mutating = cluster.get("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration",
                           f"{RELEASE}-xmem-admission")
    assert {w["failurePolicy"] for w in mutating["webhooks"]} == {"Ignore"}

    changed = {**VALUES, "webhook": {"failurePolicy": "Fail", "replicas": 3}}
    _helm(cluster, "upgrade", RELEASE, str(CHART), values=changed)
    mutating = cluster.get("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration",
                           f"{RELEASE}-xmem-admission")
    assert {w["failurePolicy"] for w in mutating["webhooks"]} == {"Fail"}
    deployment = cluster.get("apps/v1", "Deployment", f"{RELEASE}-xmem-admission-webhook",
                             NAMESPACE)
    assert deployment["spec"]["replicas"] == 3
    assert "REVISION: 2" in _helm(cluster, "status", RELEASE, values=None)

    _helm(cluster, "uninstall", RELEASE, "--wait", values=None)
    wait_for(lambda: _released_objects(cluster) == [], 60,
             "every object of the release to be gone")
    for name in ("gpuadmissionpolicies.xmem.io", "gpumemoryestimates.xmem.io"):
        assert cluster.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", name)
    cluster.delete("v1", "Namespace", NAMESPACE)
