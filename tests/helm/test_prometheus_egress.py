"""The controller reaches the Prometheus that right-sizing reads: the chart's
NetworkPolicy opens egress to the port of the policy's spec.rightSizing.prometheus url (or the
ports given), to the peers given; nothing when no Prometheus is configured; and the token and
CA bundle the policy names are mounted read-only where the values say."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from tests.helm.chart import RELEASE, one, render
from xmem_admission.cluster.policy.model import Policy

CONTROLLER = f"{RELEASE}-xmem-admission-controller"
MONITORING = [{"namespaceSelector": {"matchLabels": {
    "kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def _values(url: str = "", **network: Any) -> Dict[str, Any]:
    values: Dict[str, Any] = {"networkPolicy": {"prometheus": network}} if network else {}
    if url:
        spec = {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
                "rightSizing": {"prometheus": {"url": url}}}
        values["policy"] = {"spec": spec}
    return values


def _egress(values: Dict[str, Any]) -> List[Dict[str, Any]]:
    return one(render(values), "NetworkPolicy", CONTROLLER)["spec"]["egress"]


def _ports(rule: Dict[str, Any]) -> List[int]:
    return [p["port"] for p in rule["ports"]]


def test_without_a_prometheus_the_controller_reaches_only_the_api_server_and_dns():
    assert [_ports(r) for r in _egress({})] == [[443, 6443], [53, 53]]


@pytest.mark.parametrize("url, port", [
    ("http://prometheus-k8s.monitoring.svc:9090", 9090),
    ("https://mimir.example.com/prometheus", 443),
    ("http://thanos-query.monitoring", 80),
])
def test_the_port_of_the_policys_prometheus_is_opened(url, port):
    egress = _egress(_values(url, to=MONITORING))

    assert _ports(egress[-1]) == [port]
    assert egress[-1]["to"] == MONITORING
    assert webhook_egress_unchanged()


def webhook_egress_unchanged() -> bool:
    webhook = one(render(_values("http://p.monitoring:9090")), "NetworkPolicy",
                  f"{RELEASE}-xmem-admission-webhook")["spec"]["egress"]
    return [_ports(r) for r in webhook] == [[443, 6443], [53, 53]]


def test_ports_given_for_a_policy_outside_the_chart_are_opened_to_any_destination():
    egress = _egress(_values(ports=[9090, 9091]))

    assert _ports(egress[-1]) == [9090, 9091] and "to" not in egress[-1]


def test_the_chart_renders_a_policy_with_a_prometheus_the_parser_accepts():
    url = "https://prometheus.monitoring.svc:9090"
    values = _values(url)
    values["policy"]["spec"]["rightSizing"]["prometheus"].update(
        bearerTokenFile="/etc/xmem/prometheus/token/token",
        caFile="/etc/xmem/prometheus/ca/ca.crt", tenant="gpu")
    values["controller"] = {"prometheus": {"tokenSecret": "prom-token", "caConfigMap": "prom-ca"}}
    objects = render(values)

    policy = Policy.from_object(one(objects, "GPUAdmissionPolicy"))
    pod = one(objects, "Deployment", CONTROLLER)["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    assert policy.prometheus is not None and policy.prometheus.url == url
    token, ca = mounts["prometheus-token"], mounts["prometheus-ca"]
    assert token["readOnly"] and ca["readOnly"] and "subPath" not in token  # rotation reaches it
    assert policy.prometheus.bearer_token_file == f"{token['mountPath']}/token"
    assert policy.prometheus.ca_file == f"{ca['mountPath']}/ca.crt"
    assert volumes["prometheus-token"]["secret"]["secretName"] == "prom-token"
    assert volumes["prometheus-ca"]["configMap"]["name"] == "prom-ca"
    assert "prometheus-token" not in {v["name"] for v in one(render({}), "Deployment", CONTROLLER)[
        "spec"]["template"]["spec"]["volumes"]}
