"""Where the policy comes from: a file reloaded on change, or the cluster's GPUAdmissionPolicy
read with the official Kubernetes client from the real API server (``make tools``)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest
import yaml

from tests.support.schemas import ROOT
from xmem_admission.cluster.policy.sources import ClusterPolicySource, FilePolicySource
from xmem_admission.contract.errors import PolicyError

EXAMPLE = ROOT / "examples" / "policy.yaml"


def test_a_policy_file_is_reloaded_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(EXAMPLE.read_text())
    source = FilePolicySource(str(path))
    assert not source.current().for_namespace("dev").enforcing
    path.write_text(EXAMPLE.read_text().replace("enforcement: Warn", "enforcement: Enforce  # now"))
    source.refresh()
    assert source.current().for_namespace("dev").enforcing and source.error is None


def test_a_broken_reload_keeps_the_last_good_policy_and_reports_it(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(EXAMPLE.read_text())
    errors: List[str] = []
    source = FilePolicySource(str(path), on_error=errors.append)
    good = source.current()
    path.write_text(EXAMPLE.read_text().replace("backend: HAMi", "backend: nope"))
    source.refresh()
    assert source.current() is good
    assert "spec.targets[0].backend" in (source.error or "") and errors == ["reload"]


def test_a_broken_file_at_startup_is_an_error() -> None:
    with pytest.raises(PolicyError):
        FilePolicySource(str(ROOT / "pyproject.toml"))


def test_the_cluster_policy_is_read_with_the_official_client(cluster, tmp_path: Path) -> None:
    """From the real API server (the session's control plane): missing, then two versions (one
    parse per resourceVersion), then deleted (the last good policy stays)."""
    from kubernetes import client as k8s

    name = "policy-source-test"
    custom = k8s.CustomObjectsApi(cluster.api)
    errors: List[str] = []
    source = ClusterPolicySource(cluster.plane.api_client(), name, on_error=errors.append)
    source.refresh()
    assert source.current() is None and "not found" in (source.error or "")
    assert errors == ["fetch"]

    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": name}
    body["spec"]["enforcement"] = "Warn"
    created = custom.create_cluster_custom_object("xmem.io", "v1alpha1", "gpuadmissionpolicies",
                                                  body)
    try:
        source.refresh()
        first = source.current()
        assert first is not None and first.generation == created["metadata"]["generation"]
        assert source.error is None
        source.refresh()
        assert source.current() is first  # same resourceVersion: not parsed again

        created["spec"]["enforcement"] = "Enforce"
        custom.replace_cluster_custom_object("xmem.io", "v1alpha1", "gpuadmissionpolicies",
                                             name, created)
        source.refresh()
        assert source.current().for_namespace("dev").enforcing
    finally:
        custom.delete_cluster_custom_object("xmem.io", "v1alpha1", "gpuadmissionpolicies", name)
    source.refresh()
    assert source.current().for_namespace("dev").enforcing  # the last good policy stays
    assert "not found" in (source.error or "")
