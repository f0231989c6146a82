"""Regressions for what a real API server found, each named after its item, at the
controller's level (the harness on the real control plane; items 1-5 and 9 end to end, with the
chart's RBAC, are tests/e2e_real/test_what_a_real_api_server_found.py)."""

from __future__ import annotations

from pathlib import Path

from tests.controller.support import Harness, training_job, wait
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.leader import LeaderElector
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract.errors import KubeUnavailable


def test_1_an_unreachable_api_server_is_unavailable_not_a_crash(tmp_path: Path):
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = "https://127.0.0.1:1"  # nothing listens there
    kube = Kube(client.ApiClient(configuration), attempts=2, backoff=0.01)
    try:
        kube.read_lease("default", "xmem")
    except KubeUnavailable:
        pass
    else:
        raise AssertionError("an unreachable API server must raise KubeUnavailable")
    elector = LeaderElector(kube, "default", "xmem", "me", lease_duration=2, renew_deadline=1,
                            retry_period=0.1)
    assert elector.try_acquire_or_renew() is False  # a failed attempt, not an exception


def test_5_the_cli_and_the_chart_name_the_same_lease():
    from localkube.cluster import LEASE
    from xmem_admission.commands import controller

    parser = __import__("argparse").ArgumentParser()
    controller.register(parser.add_subparsers())
    args = parser.parse_args(["controller", "--probe-image", "registry.example/xmem:1"])
    assert args.lease_name == LEASE


def test_7_the_controller_sees_a_policy_change_within_seconds_not_at_resync(harness: Harness):
    harness.spawn("--resync-seconds", "300", identity="watcher", cluster_policy=True)
    wait(lambda: f"policy {harness.namespace} loaded" in harness.log_of("watcher"), 30,
         "the first load")
    policy = harness.get("xmem.io/v1alpha1", "GPUAdmissionPolicy", harness.namespace, None)
    policy["spec"]["estimation"]["resources"]["memory"] = "3Gi"
    changed = harness.cluster.resource("xmem.io/v1alpha1", "GPUAdmissionPolicy").replace(
        body=policy).to_dict()
    version = changed["metadata"]["resourceVersion"]
    wait(lambda: f"(resourceVersion {version})" in harness.log_of("watcher"), 10,
         "the controller to load the changed policy")
    harness.submit(training_job("after-change"))
    pod = wait(lambda: next(iter(harness.estimation_pods()), None), 30, "the estimation pod")
    assert pod["spec"]["containers"][0]["resources"]["limits"]["memory"] == "3Gi"


def test_8_an_estimate_the_controller_did_not_finish_gets_its_kubectl_columns(harness: Harness):
    held = harness.submit(training_job("columns"))
    fingerprint = held["metadata"]["annotations"]["xmem.io/fingerprint"]
    store = KubeStore(harness.kube()).start()
    try:
        store.put(EstimateRecord.from_dict({
            "fingerprint": fingerprint, "workload": {"namespace": harness.namespace, "kind": "Job",
                                                    "name": "columns"},
            "gpus": [{"gpu": g, "capacity_bytes": 84970559242, "peak_reserved_bytes": 9 << 30,
                      "total_bytes": 10 << 30, "recommended_request_bytes": 11 << 30,
                      "fits": True, "mig_profile": None} for g in ("A100-80GB", "H100-80GB")]}))
    finally:
        store.stop()
    harness.controller()
    status = wait(lambda: (lambda s: s if "gpu" in s else None)(
        harness.gmes()[0].get("status") or {}), 30, "the columns to be filled in")
    assert (status["gpu"], status["estimateBytes"]) == ("A100-80GB", 10 << 30)
    assert status["requestBytes"] >= 10 << 30 and status["request"].endswith("Gi")
