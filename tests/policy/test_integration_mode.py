"""The policy's integration mode: ``Suspend`` (the webhook holds, the controller releases) unless
an admin says ``Kueue`` for the cluster or for namespaces; a typo is an error naming the field."""

from __future__ import annotations

import pytest

from tests.support.schemas import POLICY_CRD, validate_custom
from xmem_admission.cluster.policy.model import IntegrationMode, Policy
from xmem_admission.contract.errors import PolicyError

TARGETS = [{"gpu": "A100-80GB", "backend": "HAMi"}]


def test_without_a_mode_every_namespace_is_held_by_suspending() -> None:
    policy = Policy.from_spec({"targets": TARGETS})
    assert policy.for_namespace("team-a").integration is IntegrationMode.SUSPEND
    assert not policy.for_namespace("team-a").kueue


def test_kueue_can_be_chosen_for_the_cluster_and_refined_per_namespace() -> None:
    policy = Policy.from_spec({"targets": TARGETS, "integration": "Kueue", "overrides": [
        {"namespaces": ["legacy-*"], "integration": "Suspend"}]})
    assert policy.for_namespace("team-a").kueue
    assert policy.for_namespace("legacy-batch").integration is IntegrationMode.SUSPEND


@pytest.mark.parametrize("spec, field", [
    ({"integration": "kueue"}, "spec.integration"),  # the old casing
    ({"overrides": [{"namespaces": ["a"], "integration": "Volcano"}]},
     "spec.overrides[0].integration"),
])
def test_an_unknown_mode_is_refused_naming_the_field_and_the_choices(spec, field) -> None:
    with pytest.raises(PolicyError) as caught:
        Policy.from_spec({"targets": TARGETS, **spec})
    assert str(caught.value).startswith(f"{field}: ")
    assert "Suspend, Kueue" in str(caught.value)


def test_the_crd_schema_takes_both_modes_and_refuses_others() -> None:
    def policy(mode: str) -> dict:
        return {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                "metadata": {"name": "default"},
                "spec": {"targets": TARGETS, "integration": mode,
                         "overrides": [{"namespaces": ["x"], "integration": mode}]}}
    validate_custom(policy("Kueue"), POLICY_CRD)
    validate_custom(policy("Suspend"), POLICY_CRD)
    with pytest.raises(AssertionError, match="spec.integration: .queue. is not one of"):
        validate_custom(policy("queue"), POLICY_CRD)
