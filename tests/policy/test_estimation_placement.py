"""``spec.estimation.placement``: where estimation pods run. The parser, the CRD, the chart's
values schema and the example agree on it; a bad entry is refused with the field named."""

from __future__ import annotations

import json
from typing import Any, Dict

import jsonschema
import pytest

from tests.support.schemas import POLICY_CRD, ROOT, crd_schema, crd_validator
from xmem_admission.cluster.policy.model import Placement, Policy, Toleration
from xmem_admission.contract.errors import PolicyError

PLACEMENT = {"nodeSelector": {"node-pool": "cpu", "xmem.io/estimation": "yes"},
             "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "estimation",
                              "effect": "NoSchedule"},
                             {"operator": "Exists", "effect": "NoExecute",
                              "tolerationSeconds": 60}],
             "priorityClassName": "xmem-estimation"}


def _policy(placement: Any, override: Any = None) -> Dict[str, Any]:
    spec: Dict[str, Any] = {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
                            "estimation": {"placement": placement}}
    if override is not None:
        spec["overrides"] = [{"namespaces": ["team-*"],
                              "estimation": {"placement": override}}]
    return {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
            "metadata": {"name": "default"}, "spec": spec}


def test_a_placement_is_read_as_written_and_the_crd_admits_it() -> None:
    obj = _policy(PLACEMENT, override={"nodeSelector": {"node-pool": "team-cpu"}})
    crd_validator(str(POLICY_CRD)).validate(obj)
    policy = Policy.from_object(obj)
    assert policy.defaults.estimation.placement == Placement(
        node_selector=(("node-pool", "cpu"), ("xmem.io/estimation", "yes")),
        tolerations=(Toleration("dedicated", "Equal", "estimation", "NoSchedule"),
                     Toleration("", "Exists", "", "NoExecute", 60)),
        priority_class_name="xmem-estimation")
    # an override refines the node selector key by key and keeps the rest
    team = policy.for_namespace("team-a").estimation.placement
    assert dict(team.node_selector) == {"node-pool": "team-cpu", "xmem.io/estimation": "yes"}
    assert team.priority_class_name == "xmem-estimation"


# (placement, what the parser says, whether the CRD's schema refuses it too)
INVALID = [
    ({"tolerations": [{"key": "a", "operator": "Maybe"}]},
     "spec.estimation.placement.tolerations[0].operator: 'Maybe' is not one of Equal, Exists",
     True),
    ({"tolerations": [{"key": "a", "effect": "NoRun"}]},
     "spec.estimation.placement.tolerations[0].effect: 'NoRun' is not one of", True),
    ({"tolerations": [{"key": "a", "colour": "blue"}]},
     "spec.estimation.placement.tolerations[0]: unknown field 'colour'", True),
    ({"nodeSelector": ["pool=cpu"]},
     "spec.estimation.placement.nodeSelector: must be an object", True),
    ({"nodeSelector": {"pool": 3}},
     "spec.estimation.placement.nodeSelector['pool']: must be a string", True),
    ({"zone": "a"}, "spec.estimation.placement: unknown field 'zone'", True),
    ({"tolerations": [{"key": "a", "tolerationSeconds": 5, "effect": "NoSchedule"}]},
     "tolerations[0].tolerationSeconds: is for effect NoExecute only", False),
    ({"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]},
     "tolerations[0].value: must be empty when operator is Exists", False),
    ({"nodeSelector": {"bad key!": "x"}}, "'bad key!' is not a label key", False),
    ({"priorityClassName": "Low_Priority"},
     "spec.estimation.placement.priorityClassName: 'Low_Priority' is not an object name", True),
]


@pytest.mark.parametrize("placement, message, schema_refuses", INVALID)
def test_a_bad_placement_is_refused_with_the_field_named(placement: Any, message: str,
                                                        schema_refuses: bool) -> None:
    obj = _policy(placement)
    with pytest.raises(PolicyError) as caught:
        Policy.from_object(obj)
    assert message in str(caught.value)
    errors = list(crd_validator(str(POLICY_CRD)).iter_errors(obj))
    assert bool(errors) is schema_refuses, [e.message for e in errors]


def test_the_crd_the_values_schema_and_the_override_name_the_same_fields() -> None:
    spec = crd_schema(POLICY_CRD)["properties"]["spec"]["properties"]
    crd = spec["estimation"]["properties"]["placement"]["properties"]
    override = spec["overrides"]["items"]["properties"]["estimation"]["properties"][
        "placement"]["properties"]
    values = json.loads((ROOT / "helm/xmem-admission/values.schema.json").read_text())
    chart = values["properties"]["policy"]["properties"]["spec"]["properties"]["estimation"][
        "properties"]["placement"]["properties"]
    assert set(crd) == set(override) == set(chart) == {"nodeSelector", "tolerations",
                                                       "priorityClassName"}
    toleration = crd["tolerations"]["items"]["properties"]
    assert set(toleration) == set(chart["tolerations"]["items"]["properties"]) == \
        set(override["tolerations"]["items"]["properties"])
    for field in ("operator", "effect"):
        assert toleration[field]["enum"] == chart["tolerations"]["items"]["properties"][
            field]["enum"]
    jsonschema.Draft202012Validator(values).validate(
        {"policy": {"create": True, "name": "default",
                    "spec": {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
                             "estimation": {"placement": PLACEMENT}}}})
