"""RBAC and pod security: each component gets only what its job needs, and runs as nobody."""

from __future__ import annotations

from typing import Any, Dict, List, Set, Tuple

import pytest

from tests.helm.chart import NAMESPACE, RELEASE, VALUE_SETS, find, one, render

WEBHOOK_SA = f"{RELEASE}-xmem-admission-webhook"
CONTROLLER_SA = f"{RELEASE}-xmem-admission-controller"
CERTGEN_SA = f"{RELEASE}-xmem-admission-certgen"
READ = {"get", "list", "watch"}


def _rules_of(objects: List[Dict[str, Any]], account: str) -> List[Tuple[str, Dict[str, Any]]]:
    """(scope, rule) for every rule bound to a ServiceAccount, scope '' for cluster-wide."""
    roles = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
             for o in objects if o["kind"] in ("Role", "ClusterRole")}
    out = []
    for binding in find(objects, "RoleBinding") + find(objects, "ClusterRoleBinding"):
        subjects = binding.get("subjects", [])
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account
                   and s["namespace"] == NAMESPACE for s in subjects):
            continue
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace", "") if ref["kind"] == "Role" else ""
        role = roles[(ref["kind"], namespace, ref["name"])]
        scope = namespace if binding["kind"] == "RoleBinding" else ""
        out.extend((scope, rule) for rule in role["rules"])
    return out


def _grants(rules) -> Set[Tuple[str, str, str, str]]:
    return {(scope, group, resource, verb)
            for scope, rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def test_no_rule_anywhere_uses_a_wildcard() -> None:
    objects = render(VALUE_SETS["everything"])
    for role in find(objects, "Role") + find(objects, "ClusterRole"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], (role["metadata"]["name"], rule)


def test_the_webhook_only_reads_its_policy_and_the_recorded_estimates() -> None:
    grants = _grants(_rules_of(render(VALUE_SETS["cert-manager"]), WEBHOOK_SA))
    # and a TrainJob's runtime, whose pod templates are the TrainJob's (docs/trainer.md)
    # and the ConfigMaps' versions the fingerprint holds, watched (metadata only)
    assert grants == {("", "xmem.io", r, v) for r in ("gpuadmissionpolicies", "gpumemoryestimates")
                      for v in READ} | {("", "trainer.kubeflow.org", r, "get")
                                        for r in ("trainingruntimes", "clustertrainingruntimes")} \
        | {("", "", "configmaps", v) for v in ("list", "watch")}
    without = _grants(_rules_of(render({"webhook": {"workloads": {"trainJobs": False}},
                                        "certificates": {"mode": "certManager"}}), WEBHOOK_SA))
    assert {g for _, g, _, _ in without} == {"xmem.io", ""}


def test_with_the_self_signed_certificate_the_webhook_renews_it_in_its_own_objects_only(
        ) -> None:
    objects = render({})
    rules = _rules_of(objects, WEBHOOK_SA)
    writes = {(s, g, r, v) for s, g, r, v in _grants(rules) if v not in READ}
    assert writes == {
        (NAMESPACE, "", "secrets", "update"),
        ("", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch"),
        ("", "admissionregistration.k8s.io", "validatingwebhookconfigurations", "patch"),
    }
    for _scope, rule in rules:
        if set(rule["resources"]) & {"secrets", "mutatingwebhookconfigurations",
                                     "validatingwebhookconfigurations"}:
            assert set(rule["verbs"]) <= {"get", "update", "patch"}, rule
            assert rule["resourceNames"] in (
                [f"{RELEASE}-xmem-admission-webhook-tls", f"{RELEASE}-xmem-admission-webhook-tls-ca"],
                [f"{RELEASE}-xmem-admission"]), rule


def test_the_controller_writes_only_what_releasing_a_workload_needs() -> None:
    grants = _grants(_rules_of(render({}), CONTROLLER_SA))
    writes = {(s, g, r, v) for s, g, r, v in grants if v not in READ}
    assert writes == {
        ("", "batch", "jobs", "update"), ("", "kubeflow.org", "pytorchjobs", "update"),
        ("", "jobset.x-k8s.io", "jobsets", "update"),
        ("", "trainer.kubeflow.org", "trainjobs", "update"),
        ("", "", "pods", "create"), ("", "", "pods", "delete"), ("", "", "events", "create"),
        ("", "xmem.io", "gpumemoryestimates", "create"),
        ("", "xmem.io", "gpumemoryestimates", "update"),
        # estimates unused past the policy's estimation.cacheTTLSeconds (no workload owns one)
        ("", "xmem.io", "gpumemoryestimates", "delete"),
        ("", "xmem.io", "gpumemoryestimates/status", "update"),
        # the memory outside the allocator it learned, on the policy's status
        ("", "xmem.io", "gpuadmissionpolicies/status", "update"),
        # blockOwnerDeletion on the estimation pods' owner reference (OpenShift's
        # OwnerReferencesPermissionEnforcement asks for it)
        ("", "xmem.io", "gpumemoryestimates/finalizers", "update"),
        # the DRA backend's claim template, owned by the released workload
        ("", "resource.k8s.io", "resourceclaimtemplates", "create"),
        (NAMESPACE, "coordination.k8s.io", "leases", "create"),
        (NAMESPACE, "coordination.k8s.io", "leases", "update"),
    }
    assert not any(r in ("secrets", "serviceaccounts", "nodes", "pods/log")
                   for _, _, r, _ in grants)  # no pod's logs: failures come as messages
    # ConfigMaps are read for the fingerprint's versions, never written
    assert {v for _, _, r, v in grants if r == "configmaps"} == {"get", "list", "watch"}


def test_the_lease_and_the_certgen_secrets_are_limited_by_name() -> None:
    objects = render({})
    for _scope, rule in _rules_of(objects, CONTROLLER_SA) + _rules_of(objects, CERTGEN_SA) \
            + _rules_of(objects, WEBHOOK_SA):
        writes = set(rule["verbs"]) - {"create"}
        touches = set(rule["resources"]) & {"leases", "secrets", "mutatingwebhookconfigurations",
                                            "validatingwebhookconfigurations"}
        if touches and writes:
            assert rule.get("resourceNames"), rule


def test_controller_permissions_follow_the_enabled_workload_kinds() -> None:
    values = {"webhook": {"workloads": {"jobs": True, "pods": True, "pytorchJobs": False}}}
    groups = {g for _, g, _, _ in _grants(_rules_of(render(values), CONTROLLER_SA))}
    assert "kubeflow.org" not in groups
    assert _rules_of(render(VALUE_SETS["minimal"]), CONTROLLER_SA) == []


def test_every_pod_runs_as_non_root_with_a_read_only_root_filesystem() -> None:
    objects = render(VALUE_SETS["everything"])
    templates = [d["spec"]["template"] for d in find(objects, "Deployment") + find(objects, "Job")]
    assert len(templates) == 4  # webhook, controller, certgen create and patch
    for template in templates:
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"] and container["resources"]["limits"]
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert "/tmp" in mounts


def test_the_webhook_is_highly_available_and_probed_on_the_plain_port() -> None:
    objects = render({})
    deployment = one(objects, "Deployment", WEBHOOK_SA)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert ports == {"https": 8443, "metrics": 8080}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["XMEM_CERT_FILE"] == "/etc/xmem/tls/tls.crt"
    assert env["XMEM_PORT"] == "8443" and env["XMEM_METRICS_PORT"] == "8080"
    pdb = one(objects, "PodDisruptionBudget", f"{RELEASE}-xmem-admission-webhook")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == \
        deployment["spec"]["selector"]["matchLabels"]
    # A single replica gets no PDB: minAvailable 1 would block every node drain.
    assert find(render(VALUE_SETS["minimal"]), "PodDisruptionBudget") == []


def test_the_serve_environment_variables_are_ones_xmem_serve_reads() -> None:
    from xmem_admission.commands import serve

    container = one(render({}), "Deployment", WEBHOOK_SA)["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["serve"]
    known = set(serve.ENV.values())
    assert {e["name"] for e in container["env"]} <= known


def test_network_policies_open_only_the_admission_metrics_dns_and_api_ports() -> None:
    objects = render(VALUE_SETS["everything"])
    policies = {p["metadata"]["name"]: p["spec"] for p in find(objects, "NetworkPolicy")}
    webhook = policies[f"{RELEASE}-xmem-admission-webhook"]
    assert webhook["policyTypes"] == ["Ingress", "Egress"]
    ingress_ports = [p["port"] for rule in webhook["ingress"] for p in rule["ports"]]
    assert ingress_ports == [8443, 8080]
    admission_rule = webhook["ingress"][0]
    assert admission_rule["from"] == [
        {"ipBlock": {"cidr": c}} for c in VALUE_SETS["everything"]["networkPolicy"]["apiServerCIDRs"]]
    metrics_rule = webhook["ingress"][1]
    assert metrics_rule["from"] == VALUE_SETS["everything"]["networkPolicy"]["metricsFrom"]
    egress_ports = sorted({p["port"] for rule in webhook["egress"] for p in rule["ports"]})
    assert egress_ports == [53, 443, 6443]
    controller = policies[f"{RELEASE}-xmem-admission-controller"]
    assert [p["port"] for rule in controller["ingress"] for p in rule["ports"]] == [8080]


def test_by_default_only_the_monitoring_namespace_may_scrape_the_metrics_ports() -> None:
    for policy in find(render({}), "NetworkPolicy"):
        metrics_rule = policy["spec"]["ingress"][-1]
        assert metrics_rule["from"] == [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]


def test_without_api_server_cidrs_the_admission_port_is_open_and_the_install_notes_say_so() -> None:
    from tests.helm.chart import notes

    webhook = one(render({}), "NetworkPolicy", f"{RELEASE}-xmem-admission-webhook")["spec"]
    assert "from" not in webhook["ingress"][0]
    assert "networkPolicy.apiServerCIDRs is empty" in notes({})
    assert "apiServerCIDRs" not in notes({"networkPolicy": {"apiServerCIDRs": ["10.0.0.0/24"]}})


def test_the_webhook_trusts_the_controllers_own_service_account_and_holds_only_with_a_controller(
) -> None:
    def env(values: Dict[str, Any]) -> Dict[str, Any]:
        container = one(render(values), "Deployment", WEBHOOK_SA)["spec"]["template"]["spec"][
            "containers"][0]
        return {e["name"]: e.get("value") for e in container["env"]}

    default = env({})
    assert default["XMEM_CONTROLLER_USERS"] == f"system:serviceaccount:{NAMESPACE}:{CONTROLLER_SA}"
    assert default["XMEM_HOLD"] == "true"
    assert "system:serviceaccount:kube-system:*" in default["XMEM_WORKLOAD_CONTROLLERS"].split(",")
    assert env({"controller": {"enabled": False}})["XMEM_HOLD"] == "false"


def test_the_controller_environment_variables_are_ones_xmem_controller_reads() -> None:
    import importlib.util

    if importlib.util.find_spec("xmem_admission.commands.controller") is None:
        pytest.skip("xmem controller is not in this checkout yet")
    from xmem_admission.commands import controller

    deployment = one(render({}), "Deployment", CONTROLLER_SA)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["controller"]
    env = {e["name"]: e for e in container["env"]}
    assert set(env) <= set(controller.ENV.values())
    assert env["XMEM_WORKLOADS"]["value"] == "Job,PyTorchJob,JobSet,TrainJob"
    assert env["XMEM_LEASE_NAME"]["value"] == CONTROLLER_SA  # the name the Role allows
    assert env["XMEM_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    minimal = one(render({"webhook": {"workloads": {"pytorchJobs": False, "jobSets": False,
                                                    "trainJobs": False}}}), "Deployment",
                  CONTROLLER_SA)["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in minimal["env"]}["XMEM_WORKLOADS"] == "Job"
