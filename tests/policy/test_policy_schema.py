"""The policy: one schema for the YAML file and the GPUAdmissionPolicy object, strict parsing,
per-namespace resolution."""

from __future__ import annotations

import copy
from typing import Any, Dict

import jsonschema
import pytest
import yaml

from tests.support.schemas import POLICY_CRD, ROOT, crd_schema, crd_validator, validate_custom
from xmem_admission.cluster.policy.model import Estimation, FailureAction, Policy
from xmem_admission.contract.errors import PolicyError

EXAMPLE = ROOT / "examples" / "policy.yaml"


def example() -> Dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def test_the_example_policy_validates_against_the_crd_schema_and_parses() -> None:
    obj = example()
    validate_custom(obj, POLICY_CRD)
    policy = Policy.from_file(str(EXAMPLE))
    settings = policy.for_namespace("team-a")
    assert [t.gpu.key for t in settings.targets] == ["A100-80GB", "H100-80GB"]
    assert {t.backend.value for t in settings.targets} == {"HAMi"}
    assert settings.on_failure is FailureAction.DEFAULT
    assert settings.default_request_bytes == 40 << 30
    assert policy.for_namespace("prod-eu").enforcing
    assert policy.for_namespace("prod-eu").on_failure is FailureAction.HOLD
    assert policy.for_namespace("sandbox").overcommit_percent == 10


def test_the_crd_is_a_structural_schema_kubernetes_accepts() -> None:
    """Every node has a type (or is int-or-string), and nothing sets additionalProperties: false."""

    def walk(node: Dict[str, Any], path: str) -> None:
        assert "additionalProperties" not in node or node["additionalProperties"] is not False, path
        if not node.get("x-kubernetes-int-or-string"):
            assert "type" in node, f"{path} has no type"
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(crd_schema(POLICY_CRD), "")
    crd = yaml.safe_load(POLICY_CRD.read_text())
    assert crd["spec"]["scope"] == "Cluster" and crd["spec"]["group"] == "xmem.io"
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]


def test_a_policy_naming_only_its_targets_resolves_to_the_crd_defaults() -> None:
    spec = crd_schema(POLICY_CRD)["properties"]["spec"]["properties"]
    settings = Policy.from_spec({"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}]}) \
        .for_namespace("team-a")
    assert settings.enabled is spec["enabled"]["default"]
    assert settings.safety_margin_percent == spec["safetyMarginPercent"]["default"]
    assert settings.overcommit_percent == spec["overcommitPercent"]["default"]
    assert settings.minimum_request_bytes == 1 << 30 and spec["minimumRequest"]["default"] == "1Gi"
    assert settings.granularity_bytes == 256 << 20 and spec["granularity"]["default"] == "256Mi"
    assert settings.enforcement.value == spec["enforcement"]["default"]
    assert settings.on_failure.value == \
        spec["onEstimationFailure"]["properties"]["action"]["default"]
    estimation = spec["estimation"]["properties"]
    assert settings.estimation.steps == estimation["steps"]["default"] == Estimation().steps
    assert settings.estimation.mode == estimation["mode"]["default"].lower()  # the probe's word
    assert settings.estimation.active_deadline_seconds == \
        estimation["activeDeadlineSeconds"]["default"]
    assert settings.estimation.max_hold_seconds == estimation["maxHoldSeconds"]["default"]
    assert settings.estimation.cache_ttl_seconds == estimation["cacheTTLSeconds"]["default"] \
        == 2592000


def test_every_field_an_override_may_set_is_a_spec_field() -> None:
    """Every spec field but the cluster-wide ones (overrides, estimateSharing, and the
    cluster-wide estimation cap) can be refined per namespace, and nothing else."""
    from xmem_admission.cluster.policy.model import TOP_LEVEL_FIELDS

    spec = crd_schema(POLICY_CRD)["properties"]["spec"]["properties"]
    override = spec["overrides"]["items"]["properties"]
    assert set(override) - {"namespaces"} == set(spec) - set(TOP_LEVEL_FIELDS)
    estimation = set(spec["estimation"]["properties"]) - {"maxConcurrent"}
    assert set(override["estimation"]["properties"]) == estimation


def _with(path: str, value: Any) -> Dict[str, Any]:
    obj = copy.deepcopy(example())
    node = obj
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is KeyError:
        del node[parts[-1]]
    else:
        node[int(parts[-1]) if parts[-1].isdigit() else parts[-1]] = value
    return obj


# (change, what the parser says, whether the CRD schema rejects it too)
INVALID = [
    ("spec.targets.0.backend", "hamii", "spec.targets[0].backend: 'hamii' is not one of", True),
    ("spec.safetyMarginPercent", -1, "spec.safetyMarginPercent: must be at least 0", True),
    ("spec.overcommitPercent", 100, "spec.overcommitPercent: must be below 100", True),
    ("spec.granularity", "256 MB", "spec.granularity: '256 MB' is not a quantity", True),
    ("spec.targets", KeyError, "spec.targets: is required", True),
    ("spec.targets", [], "spec.targets: must be a non-empty list", True),
    ("spec.enforcement", "Deny", "spec.enforcement: 'Deny' is not one of Warn, Enforce", True),
    ("spec.colour", "blue", "spec: unknown field 'colour'", True),
    ("spec.overrides.0.namespaces", KeyError, "spec.overrides[0].namespaces: is required", True),
    ("spec.overrides.1.granularity", "lots", "spec.overrides[1].granularity: 'lots' is not a quantity", True),
    ("spec.estimation.mode", "guess", "spec.estimation.mode: 'guess' is not one of Auto", True),
    ("spec.onEstimationFailure.defaultRequest", KeyError, "action Default needs a defaultRequest", False),
    ("spec.targets.0.gpu", "A100-90GB", "spec.targets[0].gpu: unknown GPU 'A100-90GB'", False),
    ("spec.targets.1.gpu", "A100-80GB", "spec.targets[1].gpu: A100-80GB is listed twice", False),
]


@pytest.mark.parametrize("path, value, message, schema_rejects", INVALID)
def test_an_invalid_policy_is_refused_with_the_field_named(
    path: str, value: Any, message: str, schema_rejects: bool
) -> None:
    obj = _with(path, value)
    with pytest.raises(PolicyError) as caught:
        Policy.from_object(obj)
    assert message in str(caught.value)
    errors = list(crd_validator(str(POLICY_CRD)).iter_errors(obj))
    assert bool(errors) is schema_rejects, [e.message for e in errors]


def test_a_mig_backend_needs_a_gpu_with_mig() -> None:
    with pytest.raises(PolicyError, match=r"spec.targets\[0\].backend: T4 has no MIG profiles"):
        Policy.from_spec({"targets": [{"gpu": "T4", "backend": "MIGMixed"}]})


def test_a_file_that_is_not_a_policy_says_what_it_expected(tmp_path: Any) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\n")
    with pytest.raises(PolicyError, match="expected apiVersion xmem.io/v1alpha1 and kind GPUAdmissionPolicy"):
        Policy.from_file(str(path))
    path.write_text("a: [")
    with pytest.raises(PolicyError, match="not valid YAML"):
        Policy.from_file(str(path))
    with pytest.raises(PolicyError, match="cannot read"):
        Policy.from_file(str(tmp_path / "missing.yaml"))


def test_the_first_matching_override_wins_and_others_keep_the_defaults() -> None:
    policy = Policy.from_spec({
        "targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
        "overrides": [
            {"namespaces": ["team-*"], "safetyMarginPercent": 20},
            {"namespaces": ["team-a"], "safetyMarginPercent": 50, "enforcement": "Enforce"},
        ],
    })
    assert policy.for_namespace("team-a").safety_margin_percent == 20
    assert not policy.for_namespace("team-a").enforcing
    assert policy.for_namespace("other").safety_margin_percent == 5


def test_the_schema_the_tests_use_is_strict_about_unknown_fields() -> None:
    with pytest.raises(jsonschema.ValidationError):
        crd_validator(str(POLICY_CRD)).validate(_with("spec.targets.0.colour", "blue"))


def test_an_override_refines_nested_blocks_field_by_field() -> None:
    """An override of one nested field keeps its siblings from above, at every depth."""
    spec = {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
            "estimation": {"activeDeadlineSeconds": 30, "maxHoldSeconds": 600,
                           "resources": {"cpu": "1", "memory": "2Gi"}},
            "overrides": [{"namespaces": ["short"], "estimation": {"maxHoldSeconds": 150}},
                          {"namespaces": ["big"], "estimation": {"resources": {"memory": "32Gi"}}}]}
    policy = Policy.from_spec(spec)
    short = policy.for_namespace("short").estimation
    assert (short.max_hold_seconds, short.active_deadline_seconds, short.memory) == (150, 30, "2Gi")
    big = policy.for_namespace("big").estimation
    assert (big.memory, big.cpu, big.max_hold_seconds, big.active_deadline_seconds) == \
        ("32Gi", "1", 600, 30)


def test_estimates_are_shared_only_between_namespaces_the_policy_names() -> None:
    spec = {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
            "estimateSharing": [{"namespaces": ["team-a", "team-a-dev"]}]}
    policy = Policy.from_spec(spec)
    assert policy.shares_with("team-a") == {"team-a", "team-a-dev"}
    assert policy.shares_with("team-b") == {"team-b"}
    with pytest.raises(PolicyError, match=r"estimateSharing\[0\].namespaces\[1\]: 'team-\*'"):
        Policy.from_spec(dict(spec, estimateSharing=[{"namespaces": ["team-a", "team-*"]}]))
    with pytest.raises(PolicyError, match=r"overrides\[0\].estimation.maxConcurrent: is cluster"):
        Policy.from_spec(dict(spec, overrides=[{"namespaces": ["x"],
                                                "estimation": {"maxConcurrent": 3}}]))


def test_kubectl_get_gap_shows_every_target_not_only_the_first() -> None:
    """A table column's JSONPath with [*] shows only its first match: the Targets
    column selects the whole list, which the API server prints whole."""
    import yaml as _yaml

    crd = _yaml.safe_load(POLICY_CRD.read_text())
    [column] = [c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]
                if c["name"] == "Targets"]
    node: Any = example()
    for part in column["jsonPath"].strip(".").split("."):
        assert "[" not in part, column["jsonPath"]
        node = node[part]
    assert [t["gpu"] for t in node] == ["A100-80GB", "H100-80GB"]


def test_the_estimate_cache_ttl_is_read_per_namespace_and_a_bad_one_is_named() -> None:
    spec = {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
            "estimation": {"cacheTTLSeconds": 86400},
            "overrides": [{"namespaces": ["scratch-*"], "estimation": {"cacheTTLSeconds": 600}}]}
    policy = Policy.from_spec(spec)
    assert policy.for_namespace("team-a").estimation.cache_ttl_seconds == 86400
    assert policy.for_namespace("scratch-1").estimation.cache_ttl_seconds == 600
    assert Policy.from_spec({"targets": spec["targets"]}).for_namespace("x").estimation \
        .cache_ttl_seconds == 30 * 24 * 3600
    with pytest.raises(PolicyError, match=r"spec.estimation.cacheTTLSeconds: must be at least 1, got 0"):
        Policy.from_spec(dict(spec, estimation={"cacheTTLSeconds": 0}))
    with pytest.raises(PolicyError, match=r"cacheTTLSeconds: must be an integer, got '30d'"):
        Policy.from_spec(dict(spec, estimation={"cacheTTLSeconds": "30d"}))
