"""The policy's OOM-retry and right-sizing fields: defaults, per-namespace overrides, strict
validation with the field named, the CRD agreeing with the parser, and the retry rule they make."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from tests.support.schemas import POLICY_CRD, ROOT, crd_schema, crd_validator
from xmem_admission.cluster.policy.model import OomRetry, Policy, RightSizing
from xmem_admission.cluster.policy.retry import RetryRule, rule_for
from xmem_admission.contract.errors import PolicyError

GiB, MiB = 1 << 30, 1 << 20
TARGETS = [{"gpu": "A100-80GB", "backend": "HAMi"}]


def spec(**fields: Any) -> Dict[str, Any]:
    return dict({"targets": TARGETS}, **fields)


def test_a_policy_that_says_nothing_retries_and_only_raises_requests() -> None:
    settings = Policy.from_spec(spec()).for_namespace("any")
    assert settings.oom_retry == OomRetry(enabled=True, max_request_bytes=None, growth_percent=50)
    assert settings.right_sizing == RightSizing(runs=3, lower_requests=False)


def test_each_field_is_read_and_an_override_refines_them_field_by_field() -> None:
    policy = Policy.from_spec(spec(
        oomRetry={"maxRequest": "60Gi", "growthPercent": 25},
        rightSizing={"runs": 5, "lowerRequests": True},
        overrides=[{"namespaces": ["sandbox"], "oomRetry": {"enabled": False}},
                   {"namespaces": ["prod-*"], "rightSizing": {"runs": 0}}],
    ))
    base = policy.for_namespace("team-a")
    assert base.oom_retry == OomRetry(True, 60 * GiB, 25)
    assert base.right_sizing == RightSizing(5, True)
    sandbox = policy.for_namespace("sandbox")
    assert sandbox.oom_retry == OomRetry(False, 60 * GiB, 25)  # the cap and growth kept
    assert sandbox.right_sizing == RightSizing(5, True)
    prod = policy.for_namespace("prod-eu")
    assert prod.right_sizing == RightSizing(0, True) and prod.oom_retry.enabled


@pytest.mark.parametrize("fields, message, schema_rejects", [
    ({"oomRetry": {"enabled": "yes"}}, "spec.oomRetry.enabled: must be true or false", True),
    ({"oomRetry": {"maxRequest": "lots"}}, "spec.oomRetry.maxRequest: 'lots' is not a quantity",
     True),
    ({"oomRetry": {"maxRequest": 0}}, "spec.oomRetry.maxRequest: must be positive", False),
    ({"oomRetry": {"growthPercent": 0}}, "spec.oomRetry.growthPercent: must be above 0", True),
    ({"oomRetry": {"growthPercent": -5}}, "spec.oomRetry.growthPercent: must be above 0",
     True),
    ({"oomRetry": {"growthPercent": 5000}}, "spec.oomRetry.growthPercent: must be at most 1000", True),
    ({"oomRetry": {"growth": 50}}, "spec.oomRetry: unknown field 'growth'", True),
    ({"oomRetry": "on"}, "spec.oomRetry: must be an object", True),
    ({"oomRetry": {"maxRequest": "512Mi"}}, "spec.oomRetry.maxRequest: is below minimumRequest",
     False),
    ({"rightSizing": {"runs": -1}}, "spec.rightSizing.runs: must be at least 0", True),
    ({"rightSizing": {"runs": 2.5}}, "spec.rightSizing.runs: must be an integer", True),
    ({"rightSizing": {"runs": 101}}, "spec.rightSizing.runs: must be at most 100", True),
    ({"rightSizing": {"lowerRequests": "no"}}, "spec.rightSizing.lowerRequests: must be true or "
     "false", True),
    ({"rightSizing": {"window": 3}}, "spec.rightSizing: unknown field 'window'", True),
    ({"overrides": [{"namespaces": ["x"], "oomRetry": {"growthPercent": "fast"}}]},
     "spec.overrides[0].oomRetry.growthPercent: must be an integer", True),
    ({"overrides": [{"namespaces": ["x"], "rightSizing": {"runs": True}}]},
     "spec.overrides[0].rightSizing.runs: must be an integer, got True", True),
])
def test_an_invalid_field_is_refused_with_its_path(
        fields: Dict[str, Any], message: str, schema_rejects: bool) -> None:
    with pytest.raises(PolicyError) as caught:
        Policy.from_spec(spec(**fields))
    assert message in str(caught.value)
    obj = {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
           "metadata": {"name": "default"}, "spec": spec(**fields)}
    errors = list(crd_validator(str(POLICY_CRD)).iter_errors(obj))
    assert bool(errors) is schema_rejects, [e.message for e in errors]


def test_the_crd_defaults_and_bounds_are_the_parsers() -> None:
    properties = crd_schema(POLICY_CRD)["properties"]["spec"]["properties"]
    retry = properties["oomRetry"]["properties"]
    assert retry["enabled"]["default"] is OomRetry().enabled
    assert retry["growthPercent"]["default"] == OomRetry().growth_percent
    assert "default" not in retry["maxRequest"]
    sizing = properties["rightSizing"]["properties"]
    assert sizing["runs"]["default"] == RightSizing().runs
    assert sizing["lowerRequests"]["default"] is RightSizing().lower_requests
    from xmem_admission.cluster.policy.model import MAX_GROWTH_PERCENT, MAX_RIGHT_SIZING_RUNS
    assert retry["growthPercent"]["maximum"] == MAX_GROWTH_PERCENT
    assert sizing["runs"]["maximum"] == MAX_RIGHT_SIZING_RUNS
    override = properties["overrides"]["items"]["properties"]
    assert set(override["oomRetry"]["properties"]) == set(retry)
    # spec.rightSizing.prometheus is cluster-wide: an override may not name it.
    assert set(override["rightSizing"]["properties"]) == set(sizing) - {"prometheus"}


def test_the_example_policy_turns_retries_off_in_its_sandbox() -> None:
    policy = Policy.from_file(str(ROOT / "examples" / "policy.yaml"))
    assert policy.for_namespace("team-a").oom_retry.enabled
    assert not policy.for_namespace("sandbox").oom_retry.enabled
    assert policy.for_namespace("team-a").right_sizing == RightSizing(3, False)


def test_a_namespaces_retry_rule_comes_from_its_settings() -> None:
    policy = Policy.from_spec(spec(
        safetyMarginPercent=10, granularity="512Mi", minimumRequest="2Gi",
        oomRetry={"maxRequest": "40Gi", "growthPercent": 100},
        overrides=[{"namespaces": ["big"], "oomRetry": {"maxRequest": "70Gi"}}],
    ))
    assert rule_for(policy.for_namespace("a")) == RetryRule(10, 100, 512 * MiB, 2 * GiB, 40 * GiB)
    assert rule_for(policy.for_namespace("big")).cap_bytes == 70 * GiB
    assert rule_for(Policy.from_spec(spec()).for_namespace("a")).cap_bytes is None
