"""The GPUAdmissionPolicy the chart creates from its values is one the webhook and controller
accept (parsed by the product's own strict parser) and the CRD admits; the GPU capacities the
alerts and dashboard use are the catalogue's."""

from __future__ import annotations

import pytest
import yaml

from tests.helm.chart import CHART, VALUE_SETS, find, one, render
from tests.observability.rules import rule_groups
from xmem_admission.cluster.policy.model import Policy
from xmem_admission.contract import gpus
from xmem_admission.contract.errors import PolicyError


def test_the_default_policy_parses_and_names_the_policy_the_servers_read() -> None:
    objects = render({})
    obj = one(objects, "GPUAdmissionPolicy")
    policy = Policy.from_object(obj)
    assert policy.name == "default"
    assert policy.defaults.gpu_keys == ("A100-80GB", "H100-80GB")
    for deployment in find(objects, "Deployment"):
        env = {e["name"]: e.get("value")
               for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["XMEM_POLICY_NAME"] == policy.name


def test_a_renamed_policy_is_the_one_both_components_read() -> None:
    objects = render(VALUE_SETS["everything"])
    assert one(objects, "GPUAdmissionPolicy")["metadata"]["name"] == "gpu-policy"
    for deployment in find(objects, "Deployment"):
        env = {e["name"]: e.get("value")
               for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["XMEM_POLICY_NAME"] == "gpu-policy"


def test_the_example_policy_can_be_given_as_values_unchanged() -> None:
    example = yaml.safe_load((CHART.parents[1] / "examples" / "policy.yaml").read_text())
    obj = one(render({"policy": {"spec": example["spec"]}}), "GPUAdmissionPolicy")
    assert obj["spec"] == example["spec"]
    Policy.from_object(obj)


def test_the_charts_policy_is_the_example_policy_but_for_what_values_yaml_says() -> None:
    # values.yaml: examples/policy.yaml's spec but onEstimationFailure Release and no overrides
    example = yaml.safe_load((CHART.parents[1] / "examples" / "policy.yaml").read_text())
    chart = Policy.from_object(one(render({}), "GPUAdmissionPolicy"))
    values = yaml.safe_load((CHART / "values.yaml").read_text())["policy"]["spec"]
    assert values["onEstimationFailure"] == {"action": "Release"}
    assert example["spec"]["onEstimationFailure"] != values["onEstimationFailure"]
    assert example["spec"]["overrides"] and "overrides" not in values

    spec = dict(example["spec"], onEstimationFailure=values["onEstimationFailure"])
    del spec["overrides"]
    adjusted = Policy.from_object({**example, "spec": spec})
    assert adjusted.defaults == chart.defaults
    assert adjusted.overrides == chart.overrides == ()
    assert adjusted.sharing == chart.sharing


def test_a_policy_typo_in_values_is_refused_by_helm_and_by_the_products_parser() -> None:
    """values.schema.json's policy.spec is generated from the CRD (policy/schema.py): helm
    refuses the typo before anything reaches the cluster; the parser would refuse it too."""
    spec = {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}], "safetyMarginPercnt": 5}
    with pytest.raises(AssertionError, match="'safetyMarginPercnt' not allowed"):
        render({"policy": {"spec": spec}})
    with pytest.raises(PolicyError, match="safetyMarginPercnt"):
        Policy.from_spec(spec)


def test_no_policy_object_when_it_is_managed_elsewhere() -> None:
    assert find(render({"policy": {"create": False}}), "GPUAdmissionPolicy") == []


def test_gpu_capacities_in_the_rules_are_the_catalogues() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    capacities = values["metrics"]["prometheusRule"]["gpuCapacityBytes"]
    for model, capacity in capacities.items():
        assert gpus.lookup(model).capacity_bytes == capacity, model
    # Every GPU the default policy targets has a capacity, or its savings would be missing.
    targets = {t["gpu"] for t in values["policy"]["spec"]["targets"]}
    assert targets <= set(capacities)
    recorded = {r["labels"]["gpu_model"]: r["expr"] for g in rule_groups() for r in g["rules"]
                if r.get("record") == "xmem:gpu_capacity_bytes"}
    assert recorded == {m: f"vector({c})" for m, c in capacities.items()}
