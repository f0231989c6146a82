"""The chart lints and renders with the real helm for every value set, and every object it
renders is one the API server accepts: built-in kinds against the official Kubernetes schemas
(1.30 to 1.35, strict: unknown fields rejected), custom resources against their CRDs (the
project's own, and those cert-manager and the Prometheus Operator publish, kept in tests/data)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helm.chart import CHART, VALUE_SETS, find, render, run, tool, values_file
from tests.support.schemas import ROOT, validate_builtin, validate_custom

CRDS = ROOT / "tests" / "data" / "crds"
CHART_CRDS = CHART / "crds"
CUSTOM_KINDS = {
    ("xmem.io/v1alpha1", "GPUAdmissionPolicy"): CHART_CRDS / "gpuadmissionpolicies.xmem.io.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): CRDS / "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): CRDS / "monitoring.coreos.com_prometheusrules.yaml",
    ("cert-manager.io/v1", "Certificate"): CRDS / "cert-manager.io_certificates.yaml",
    ("cert-manager.io/v1", "Issuer"): CRDS / "cert-manager.io_issuers.yaml",
}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_chart_lints_cleanly_with_each_value_set(value_set: str, tmp_path: Path) -> None:
    helm = tool("helm")
    values = values_file(VALUE_SETS[value_set], tmp_path)
    result = run([helm, "lint", str(CHART), "--strict", "--values", str(values)])
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_rendered_object_is_accepted_by_its_schema(value_set: str) -> None:
    objects = render(VALUE_SETS[value_set])
    assert objects, "helm template rendered nothing"
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if key in CUSTOM_KINDS:
            crd = CUSTOM_KINDS[key]
            if not crd.exists():
                pytest.fail(f"{where}: no CRD at {crd} to validate it against")
            validate_custom(obj, crd)
        else:
            assert "." not in obj["apiVersion"].split("/")[0] or obj["apiVersion"].split("/")[0].endswith(
                "k8s.io"), f"{where}: {obj['apiVersion']} is neither built-in nor a known CRD"
            validate_builtin(obj)


def test_the_crds_folder_is_installed_with_the_chart() -> None:
    crds = find(render({}), "CustomResourceDefinition")
    names = {c["metadata"]["name"] for c in crds}
    on_disk = {p.name for p in CHART_CRDS.glob("*.yaml")}
    assert "gpuadmissionpolicies.xmem.io" in names
    assert len(names) == len(on_disk), (names, on_disk)


def test_every_object_is_namespaced_in_the_release_namespace_or_cluster_scoped() -> None:
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                      "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                      "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                      "GPUAdmissionPolicy"}
    for obj in render(VALUE_SETS["cert-manager"], namespace="gpu-admission"):
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in cluster_scoped:
            assert namespace is None, obj["metadata"]["name"]
        else:
            assert namespace == "gpu-admission", f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("image", [{}, {"repository": ""}, {"tag": "0.1.0"}])
def test_the_chart_refuses_to_render_without_an_image_and_says_how_to_build_one(
        image: dict, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"image": {"repository": "", **image}}))
    for command in ("template", "install"):
        argv = [tool("helm"), command, "xmem", str(CHART), "--values", str(path)]
        if command == "install":  # what an admin runs; a client dry run needs no cluster
            argv.append("--dry-run=client")
        result = run(argv, check=False)
        assert result.returncode != 0, command
        assert "image.repository is required" in result.stderr
        assert "make image" in result.stderr and "--set image.repository=" in result.stderr


def test_the_image_given_names_every_pod_and_hook_of_the_chart() -> None:
    objects = render({"image": {"repository": "registry.corp/ml/xmem", "tag": "1.2.3"}})
    images = {c["image"] for o in objects if o["kind"] in ("Deployment", "Job")
              for c in o["spec"]["template"]["spec"]["containers"]}
    assert images == {"registry.corp/ml/xmem:1.2.3"}
    assert len(find(objects, "Job")) == 2  # the certificate hooks run it too (selfSigned)


@pytest.mark.parametrize("bad, complaint", [
    ({"webhook": {"failurePolicy": "Maybe"}}, "failurePolicy"),
    ({"webhook": {"timeoutSeconds": 31}}, "timeoutSeconds"),
    ({"webhook": {"replica": 3}}, "replica"),
    ({"certificates": {"mode": "vault"}}, "mode"),
    ({"image": {"digest": "latest"}}, "digest"),
    ({"metrics": {"prometheusRule": {"estimationFailureRatio": 2}}}, "estimationFailureRatio"),
])
def test_values_schema_refuses_a_bad_value_with_its_name(bad: dict, complaint: str,
                                                        tmp_path: Path) -> None:
    helm = tool("helm")
    values = values_file(bad, tmp_path)
    result = run([helm, "template", "xmem", str(CHART), "--values", str(values)], check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert complaint in result.stderr
