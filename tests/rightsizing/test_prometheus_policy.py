"""The policy names the Prometheus that finished workloads' peaks are read from
(``spec.rightSizing.prometheus``): strict parsing with the field's path, cluster-wide
(an override may not name it), and the CRD accepts and refuses what the parser does."""

from __future__ import annotations

import pytest

from tests.support.schemas import POLICY_CRD, crd_validator
from xmem_admission.cluster.policy.model import Policy, Prometheus
from xmem_admission.contract.errors import PolicyError

URL = "https://prometheus.monitoring.svc:9090"


def spec(**fields):
    return {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}], **fields}


def test_a_prometheus_with_credentials_reaches_every_namespace():
    prometheus = {"url": URL, "bearerTokenFile": "/etc/xmem/prometheus/token/token",
                  "caFile": "/etc/xmem/prometheus/ca/ca.crt", "tenant": "gpu-team",
                  "timeoutSeconds": 5}
    policy = Policy.from_spec(spec(rightSizing={"prometheus": prometheus}, overrides=[
        {"namespaces": ["sandbox"], "rightSizing": {"runs": 0}}]))

    expected = Prometheus(URL, "/etc/xmem/prometheus/token/token",
                          "/etc/xmem/prometheus/ca/ca.crt", "gpu-team", 5.0, 15.0)
    assert policy.prometheus == expected
    assert policy.for_namespace("sandbox").right_sizing.prometheus == expected
    assert policy.for_namespace("sandbox").right_sizing.runs == 0
    assert Policy.from_spec(spec()).prometheus is None


@pytest.mark.parametrize("prometheus, where, schema_rejects", [
    ({}, "spec.rightSizing.prometheus.url: is required", True),
    ({"url": "prometheus:9090"}, "spec.rightSizing.prometheus.url: must be http(s)", True),
    ({"url": URL + "?x=1"}, "spec.rightSizing.prometheus.url: must be http(s)", True),
    ({"url": URL, "bearerTokenFile": "token"}, "bearerTokenFile: must be an absolute path", True),
    ({"url": "http://p:9090", "caFile": "/ca.crt"}, "caFile: is for an https url", False),
    ({"url": URL, "timeoutSeconds": 0}, "timeoutSeconds: must be above 0", True),
    ({"url": URL, "timeoutSeconds": 301}, "timeoutSeconds: must be above 0 and at most 300",
     True),
    ({"url": URL, "tenant": ""}, "tenant: must not be empty", True),
    ({"url": URL, "bearerToken": "s3cret"}, "unknown field 'bearerToken'", True),
])
def test_a_wrong_prometheus_is_refused_with_its_field(prometheus, where, schema_rejects):
    with pytest.raises(PolicyError) as caught:
        Policy.from_spec(spec(rightSizing={"prometheus": prometheus}))

    assert where in str(caught.value)
    obj = {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
           "metadata": {"name": "default"}, "spec": spec(rightSizing={"prometheus": prometheus})}
    errors = list(crd_validator(str(POLICY_CRD)).iter_errors(obj))
    assert bool(errors) is schema_rejects, [e.message for e in errors]


def test_an_override_may_not_name_its_own_prometheus():
    with pytest.raises(PolicyError) as caught:
        Policy.from_spec(spec(overrides=[{"namespaces": ["a"],
                                          "rightSizing": {"prometheus": {"url": URL}}}]))

    assert "spec.overrides[0].rightSizing.prometheus: is cluster-wide" in str(caught.value)
