"""The webhook's estimate store backed by GPUMemoryEstimates answers from a watch-fed cache."""

from __future__ import annotations

import base64
import json

import jsonpatch

from tests.controller.support import training_job, wait
from xmem_admission.cluster import labels
from xmem_admission.cluster.admission.webhook import Endpoint, Webhook
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.kube.client import GME
from xmem_admission.cluster.policy.sources import StaticPolicySource
from xmem_admission.cluster.policy.store import EstimateRecord

FP = "0123456789abcdef0123456789abcdef"


def _record(namespace: str, fp: str = FP, total: int = 10 << 30) -> EstimateRecord:
    return EstimateRecord.from_dict({
        "fingerprint": fp, "created": "2026-01-31T12:00:00Z",
        "workload": {"namespace": namespace, "kind": "Job", "name": "train"},
        "gpus": [{"gpu": "A100-80GB", "capacity_bytes": 84970559242, "peak_reserved_bytes": total,
                  "total_bytes": total, "recommended_request_bytes": total, "fits": True,
                  "mig_profile": "1g.20gb"}]})


def test_put_records_a_succeeded_estimate_that_get_then_answers(harness):
    store = KubeStore(harness.kube()).start()
    try:
        store.put(_record(harness.namespace))
        assert store.get(FP, harness.namespace) == _record(harness.namespace)
        [gme] = harness.gmes()
        assert gme["metadata"]["name"] == records.name_for(FP)
        assert gme["status"]["phase"] == "Succeeded"
        assert gme["status"]["estimates"][0]["totalBytes"] == 10 << 30
    finally:
        store.stop()


def test_only_succeeded_estimates_are_served_and_deleted_ones_go(harness):
    store = KubeStore(harness.kube()).start()
    kube = harness.kube()
    try:
        job = harness.submit(training_job("train"))
        pending = kube.create(GME, harness.namespace, records.new(job, FP, ["A100-80GB"], "img"))
        assert store.get(FP, harness.namespace) is None
        record = _record(harness.namespace)
        kube.replace_status(GME, dict(pending, status=records.from_record(record, harness.namespace)["status"]))
        wait(lambda: store.get(FP, harness.namespace), 10, "the succeeded estimate in the store")
        kube.custom.delete_namespaced_custom_object("xmem.io", "v1alpha1", harness.namespace,
                                                    "gpumemoryestimates", records.name_for(FP))
        wait(lambda: store.get(FP, harness.namespace) is None, 10, "the deleted estimate to leave the store")
    finally:
        store.stop()


def test_the_webhook_sizes_a_job_at_once_from_an_estimate_the_controller_recorded(harness):
    job = training_job("again")
    held = harness.submit(training_job("train"))
    fp = held["metadata"]["annotations"][labels.FINGERPRINT]
    store = KubeStore(harness.kube()).start()
    try:
        store.put(_record(harness.namespace, fp, total=6 << 30))
        # with the ConfigMap versions the fingerprint reads, as xmem serve's watch gives them
        webhook = Webhook(StaticPolicySource(harness.policy), store, versions=harness.versions)
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "u", "kind": {"group": "batch", "version": "v1", "kind": "Job"},
            "resource": {"group": "batch", "version": "v1", "resource": "jobs"},
            "name": "again", "namespace": harness.namespace, "operation": "CREATE",
            "userInfo": {"username": "alice"}, "object": job}}
        answer = json.loads(webhook.review(json.dumps(review).encode(), Endpoint.MUTATE))
        ops = json.loads(base64.b64decode(answer["response"]["patch"]))
        patched = jsonpatch.apply_patch(job, ops)
        assert not patched["spec"].get("suspend")  # not held: sized straight away
        sized = patched["spec"]["template"]["metadata"]["annotations"]
        assert sized[labels.ESTIMATE_BYTES] == str(6 << 30)
        limits = patched["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpumem"]) * (1 << 20) >= int(sized[labels.REQUEST_BYTES])
    finally:
        store.stop()


def test_an_oom_retry_recorded_on_an_estimate_is_served_by_workload_uid_in_its_namespace(
        harness):
    """status.oomRetries reaches the webhook's store through the watch, whatever the
    estimate's phase, by the workload's uid and only in the estimate's own namespace; it goes
    with the estimate."""
    store = KubeStore(harness.kube()).start()
    kube = harness.kube()
    try:
        job = harness.submit(training_job("train"))
        uid = job["metadata"]["uid"]
        pending = kube.create(GME, harness.namespace, records.new(job, FP, ["A100-80GB"], "img"))
        entry = {"workload": {"kind": "Job", "name": "train", "uid": uid}, "ooms": 1,
                 "gpu": "A100-80GB", "failedRequestBytes": 4 << 30, "requestBytes": 6 << 30}
        kube.replace_status(GME, dict(pending, status={"phase": "Running",
                                                       records.OOM_RETRIES: [entry]}))
        grant = wait(lambda: store.retry(harness.namespace, uid), 10, "the grant in the store")
        assert (grant.request_bytes, grant.ooms, grant.gpu, grant.gave_up) == (
            6 << 30, 1, "A100-80GB", None)
        assert store.retry("another-namespace", uid) is None
        assert store.get(FP, harness.namespace) is None  # a grant is no estimate
        kube.custom.delete_namespaced_custom_object("xmem.io", "v1alpha1", harness.namespace,
                                                    "gpumemoryestimates", records.name_for(FP))
        wait(lambda: store.retry(harness.namespace, uid) is None, 10, "the grant to go")
    finally:
        store.stop()
