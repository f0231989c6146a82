"""The webhook's answers for a Kubeflow Trainer v2 TrainJob, with its runtime read from a real API
server (Trainer v2.3.0's CRDs and the ``torch-distributed`` ClusterTrainingRuntime it ships,
from `make tools`' cache entry), through the webhook's own service account and the chart's RBAC:

- held at CREATE (suspended, fingerprint and hold annotations, nothing written into its runtime
  patches: the controller sizes it), an estimate known or not; reinvoked, an empty patch;
- queued by Kueue (policy integration Kueue, a queue-name label): an empty patch, so Kueue's
  non-idempotent TrainJob webhook has nothing to be reinvoked for;
- a runtime that does not exist: a clear answer naming it (admitted with a warning under Warn,
  refused under Enforce), never an HTTP 500;
- a tenant's xmem.io/ sizing annotation in a runtime patch: refused (it would reach the pods).
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterator

import pytest

from tests.support.builders import review
from tests.support.estimates import record_for
from tests.support.harness import LocalWebhook, make_policy
from xmem_admission.cluster import labels
from xmem_admission.cluster.integrations.trainjob import RESOLVED, TrainJobIntegration
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.kubeconfig import api_client

GPUS = ("A100-80GB", "H100-80GB")
ESTIMATE = {"A100-80GB": 11.7, "H100-80GB": 11.9}
TRAINJOB = TrainJobIntegration()
_names = itertools.count()


@pytest.fixture(scope="module")
def runtime_reader(cluster: Any) -> Iterator[Kube]:
    """Trainer's CRDs and its torch runtime on the real API server; the reader the webhook
    uses in a cluster, with the webhook's service account (the chart's RBAC)."""
    from localkube.hosted import install_crds
    from localkube.trainer import TORCH_RUNTIME, home, shipped_runtimes

    install_crds(cluster, (home() / "trainer" / "crds").glob("*.yaml"))
    cluster.apply(shipped_runtimes()[TORCH_RUNTIME])
    api = api_client(str(cluster.webhook_kubeconfig))
    try:
        yield Kube(api, attempts=2, backoff=0.05)
    finally:
        api.close()


@pytest.fixture()
def webhook(local: LocalWebhook, runtime_reader: Kube) -> LocalWebhook:
    local.webhook.reader = runtime_reader
    return local


def trainjob(runtime: str = "torch-distributed", gpus: int = 4, **extra: Any) -> Dict[str, Any]:
    obj: Dict[str, Any] = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": f"llm-{next(_names)}", "namespace": "ml",
                     "labels": {labels.OPT_IN: labels.OPT_IN_VALUE}},
        "spec": {"runtimeRef": {"name": runtime},
                 "trainer": {"image": "ghcr.io/acme/train:1.0",
                             "command": ["torchrun", "train.py"], "numNodes": 2,
                             "numProcPerNode": 4,
                             "resourcesPerNode": {"limits": {"nvidia.com/gpu": str(gpus)}}}},
    }
    obj["spec"].update(extra)
    return obj


def test_a_trainjob_is_held_and_nothing_is_written_into_its_runtime_patches(
        webhook: LocalWebhook) -> None:
    answer = webhook.send(review(trainjob()))
    assert answer.allowed
    paths = sorted(op["path"] for op in answer.ops)
    assert "/spec/suspend" in paths
    assert not any(p.startswith("/spec/runtimePatches") for p in paths)
    patched = answer.patched()
    assert patched["spec"]["suspend"] is True
    assert labels.HELD_REASON in patched["metadata"]["annotations"]
    assert patched["metadata"]["annotations"][labels.FINGERPRINT]
    assert RESOLVED not in patched
    assert any("TrainJob held until its GPU memory is estimated" in w for w in answer.warnings)
    checked = webhook.send(review(patched), endpoint="validate")
    assert checked.allowed and checked.warnings == []


def test_invoked_again_on_its_own_output_the_webhook_patches_nothing(
        webhook: LocalWebhook) -> None:
    patched = webhook.send(review(trainjob())).patched()
    again = webhook.send(review(patched))
    assert again.allowed and again.ops == []


def test_a_known_estimate_still_holds_it_for_the_controller_to_size(
        webhook: LocalWebhook, runtime_reader: Kube) -> None:
    obj = trainjob()
    webhook.record(record_for(TRAINJOB.resolve(obj, runtime_reader), ESTIMATE, GPUS))
    answer = webhook.send(review(obj))
    assert answer.patched()["spec"]["suspend"] is True
    assert any("estimate known" in w for w in answer.warnings)


def test_queued_by_kueue_it_gets_an_empty_patch(webhook: LocalWebhook) -> None:
    webhook.use(make_policy(integration="Kueue"))
    obj = trainjob()
    obj["metadata"]["labels"][labels.KUEUE_QUEUE_NAME] = "gpu-queue"
    obj["spec"]["suspend"] = True  # Kueue's own webhook suspends it
    answer = webhook.send(review(obj))
    assert answer.allowed and answer.ops == []
    assert any("AdmissionCheck" in w for w in answer.warnings)
    assert webhook.send(review(obj), endpoint="validate").allowed


def test_a_missing_runtime_is_named_in_a_warning_where_the_policy_warns(
        webhook: LocalWebhook) -> None:
    answer = webhook.send(review(trainjob(runtime="no-such-runtime")))
    assert answer.allowed and answer.ops == []
    (warning,) = answer.warnings
    assert "ClusterTrainingRuntime 'no-such-runtime' (spec.runtimeRef) does not exist" in warning


def test_a_missing_runtime_is_refused_with_its_name_where_the_policy_enforces(
        webhook: LocalWebhook) -> None:
    webhook.use(make_policy(enforcement="Enforce"))
    obj = trainjob(runtime="no-such-runtime")
    obj["spec"]["runtimeRef"]["kind"] = "TrainingRuntime"
    answer = webhook.send(review(obj))
    assert not answer.allowed
    assert answer.status["code"] != 500
    assert "TrainingRuntime 'no-such-runtime' (spec.runtimeRef) does not exist in namespace ml" \
        in answer.status["message"]


def test_a_tenants_sizing_annotation_in_a_runtime_patch_is_refused(
        webhook: LocalWebhook) -> None:
    obj = trainjob(runtimePatches=[{
        "manager": "example.com/tenant",
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
            "name": "node", "template": {"spec": {"template": {"metadata": {"annotations": {
                labels.REQUEST_BYTES: str(1 << 30)}}}}}}]}}}}])
    answer = webhook.send(review(obj))
    assert not answer.allowed
    assert labels.REQUEST_BYTES in answer.status["message"]


def test_a_trainjob_without_gpus_is_admitted_unchanged(webhook: LocalWebhook) -> None:
    obj = trainjob()
    obj["spec"]["trainer"]["resourcesPerNode"] = {"limits": {"cpu": "2"}}
    answer = webhook.send(review(obj))
    assert answer.allowed and answer.ops == [] and answer.warnings == []
