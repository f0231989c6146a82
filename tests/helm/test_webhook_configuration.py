"""The webhook configurations the chart installs: what the API server sends, where, and how it
behaves when the webhook is slow or down."""

from __future__ import annotations

import base64
from typing import Any, Dict, List

import pytest

from tests.helm.chart import NAMESPACE, RELEASE, VALUE_SETS, find, one, render
from xmem_admission.cluster import labels

KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


def _configs(values: Dict[str, Any]) -> List[Dict[str, Any]]:
    objects = render(values)
    return [one(objects, kind) for kind in KINDS]


def test_each_configuration_has_a_namespace_entry_and_an_object_entry() -> None:
    for config in _configs({}):
        hooks = {h["name"].split(".")[0]: h for h in config["webhooks"]}
        assert sorted(hooks) == ["namespace", "object"]
        by_namespace, by_object = hooks["namespace"], hooks["object"]
        # Namespace entry: opted-in namespaces, minus objects that opt in themselves (the
        # object entry takes those), so no workload is reviewed twice.
        ns_terms = by_namespace["namespaceSelector"]["matchExpressions"]
        assert {"key": labels.OPT_IN, "operator": "In", "values": ["true"]} in ns_terms
        assert by_namespace["objectSelector"]["matchExpressions"] == [
            {"key": labels.OPT_IN, "operator": "NotIn", "values": ["true"]}]
        assert by_object["objectSelector"]["matchLabels"] == {labels.OPT_IN: labels.OPT_IN_VALUE}


def test_the_release_namespace_and_system_namespaces_are_never_sent() -> None:
    for config in _configs({}):
        for hook in config["webhooks"]:
            excluded = [t for t in hook["namespaceSelector"]["matchExpressions"]
                        if t["key"] == "kubernetes.io/metadata.name"]
            assert excluded and excluded[0]["operator"] == "NotIn"
            assert {NAMESPACE, "kube-system"} <= set(excluded[0]["values"])


def test_paths_are_the_ones_the_server_answers_on() -> None:
    from tests.support.harness import make_policy
    from xmem_admission.cluster.admission.app import create_admission_app
    from xmem_admission.cluster.admission.metrics import AdmissionMetrics
    from xmem_admission.cluster.admission.webhook import Webhook
    from xmem_admission.cluster.policy.sources import StaticPolicySource
    from xmem_admission.cluster.policy.store import MemoryStore

    app = create_admission_app(Webhook(StaticPolicySource(make_policy()), MemoryStore(),
                                       AdmissionMetrics()))
    served = {route.path for route in app.routes if "POST" in getattr(route, "methods", ())}
    for config in _configs({}):
        endpoint = "mutate" if config["kind"].startswith("Mutating") else "validate"
        for hook in config["webhooks"]:
            scope = hook["name"].split(".")[0]
            service = hook["clientConfig"]["service"]
            assert service["path"] == f"/{endpoint}/{scope}"
            assert service["path"] in served
            assert service["namespace"] == NAMESPACE
            assert service["port"] == 443


def test_default_behaviour_is_safe_on_the_api_servers_request_path() -> None:
    mutating, validating = _configs({})
    for config in (mutating, validating):
        for hook in config["webhooks"]:
            assert hook["failurePolicy"] == "Ignore"  # a down webhook never blocks creations
            assert hook["sideEffects"] == "NoneOnDryRun"
            assert 1 <= hook["timeoutSeconds"] <= 10
            assert hook["admissionReviewVersions"] == ["v1"]
    for hook in mutating["webhooks"]:
        assert hook["reinvocationPolicy"] == "IfNeeded"
        assert {op for rule in hook["rules"] for op in rule["operations"]} == {"CREATE"}
    for hook in validating["webhooks"]:
        assert "reinvocationPolicy" not in hook
        # Pods only at creation (their extended resources are immutable), workloads also on
        # update, where a hand-set request can be lowered below the estimate.
        for rule in hook["rules"]:
            expected = ["CREATE"] if rule["resources"] == ["pods"] else ["CREATE", "UPDATE"]
            assert rule["operations"] == expected


def test_failure_policy_timeout_and_kinds_follow_the_values() -> None:
    mutating, _ = _configs(VALUE_SETS["minimal"])
    for hook in mutating["webhooks"]:
        assert hook["failurePolicy"] == "Fail"
        assert hook["timeoutSeconds"] == 3
        resources = {r for rule in hook["rules"] for r in rule["resources"]}
        assert resources == {"jobs", "pods"}


def test_cert_manager_mode_injects_the_ca_of_the_serving_certificate() -> None:
    objects = render(VALUE_SETS["cert-manager"])
    certificate = next(c for c in find(objects, "Certificate") if not c["spec"].get("isCA"))
    service = one(objects, "Service", f"{RELEASE}-xmem-admission-webhook")
    for kind in KINDS:
        config = one(objects, kind)
        ref = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        assert ref == f"{NAMESPACE}/{certificate['metadata']['name']}"
    # The API server calls <service>.<namespace>.svc; certificates need it as a SAN.
    assert f"{service['metadata']['name']}.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    deployment = one(objects, "Deployment", f"{RELEASE}-xmem-admission-webhook")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == certificate["spec"]["secretName"]
    # No issuer given: the chart bootstraps a CA so renewals keep the injected CA valid.
    issuers = {i["metadata"]["name"]: i["spec"] for i in find(objects, "Issuer")}
    assert certificate["spec"]["issuerRef"]["name"] in issuers
    assert "ca" in issuers[certificate["spec"]["issuerRef"]["name"]]


def test_cert_manager_mode_uses_a_given_cluster_issuer_and_creates_none() -> None:
    objects = render(VALUE_SETS["cert-manager-cluster-issuer"])
    assert find(objects, "Issuer") == []
    certificate = one(objects, "Certificate")
    assert certificate["spec"]["issuerRef"] == {
        "name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


def test_self_signed_mode_runs_hooks_before_and_after_install() -> None:
    objects = render({})
    assert find(objects, "Certificate") == []
    jobs = {j["metadata"]["name"].rsplit("-", 1)[-1]: j for j in find(objects, "Job")}
    assert jobs["create"]["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert jobs["patch"]["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    # Its RBAC and script exist in both phases (created before the Jobs, by weight).
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding",
                 "ConfigMap"):
        hooked = [o for o in find(objects, kind)
                  if "helm.sh/hook" in o["metadata"].get("annotations", {})]
        assert len(hooked) == 1, kind
        annotations = hooked[0]["metadata"]["annotations"]
        assert int(annotations["helm.sh/hook-weight"]) < 0
        assert set(annotations["helm.sh/hook"].split(",")) == {
            "pre-install", "pre-upgrade", "post-install", "post-upgrade"}
    script = [c for c in find(objects, "ConfigMap") if "certgen.py" in c.get("data", {})]
    assert script and "def cmd_create" in script[0]["data"]["certgen.py"]
    for config in (one(objects, k) for k in KINDS):
        assert "cert-manager.io/inject-ca-from" not in config["metadata"]["annotations"]


def test_certgen_patch_sets_the_ca_on_every_entry_of_the_rendered_configurations() -> None:
    """The JSON patch the post-install hook sends, applied (by the jsonpatch library) to the
    configurations as rendered: every entry trusts the CA and the result is still valid."""
    import importlib.util

    import jsonpatch

    from tests.helm.chart import CHART
    from tests.support.schemas import validate_builtin

    spec = importlib.util.spec_from_file_location("certgen", CHART / "files" / "certgen.py")
    certgen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(certgen)
    ca_pem, _ = certgen.make_ca("test CA", 1)
    ca_b64 = base64.b64encode(ca_pem).decode()
    for config in _configs({}):
        patched = jsonpatch.apply_patch(config, certgen.ca_patch(config["webhooks"], ca_b64))
        assert [h["clientConfig"]["caBundle"] for h in patched["webhooks"]] == [ca_b64] * 2
        validate_builtin(patched)
        # The patch guards every index with the entry's name: a reordered list fails it.
        reordered = dict(config, webhooks=list(reversed(config["webhooks"])))
        with pytest.raises(jsonpatch.JsonPatchTestFailed):
            jsonpatch.apply_patch(reordered, certgen.ca_patch(config["webhooks"], ca_b64))
