"""Regressions for what a real API server found (issue #15), each named after its item, on the
stand-in until the real control plane runs in the tests: the controller as its own process
(``xmem controller``), with the chart's RBAC where permissions are the point."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.controller.support import Harness, training_job, wait
from tests.fakekube.cluster import PROBE_IMAGE
from tests.support.harness import metric_sum
from tests.support.installed import Installed
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.leader import LeaderElector
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract.errors import KubeUnavailable


def test_1_a_controller_survives_an_api_server_restart_and_keeps_leading(harness: Harness):
    process = harness.spawn(identity="survivor")
    wait(lambda: "survivor leads" in harness.log_of("survivor"), 30, "the controller to lead")
    harness.server.outage(3.0)  # every connection dropped, watches cut, as a restart does
    wait(lambda: not harness.server.down, 10, "the API server to be back")
    harness.submit(training_job("after-restart"))
    harness.wait_released("after-restart", 120)
    assert process.poll() is None, harness.log_of("survivor")
    assert "Traceback" not in harness.log_of("survivor")


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


def test_5_a_lease_the_controller_may_not_use_is_loud_counted_and_fails_readiness(
        harness: Harness, tmp_path: Path):
    installed = Installed(harness.server, tmp_path)
    try:
        installed.controller(PROBE_IMAGE, "--lease-name", "not-the-charts-lease",
                             "--lease-unready-seconds", "1", "--log-level", "info")
        port = wait(lambda: (lambda m: int(m.group(1)) if m else None)(re.search(
            r"metrics on http://127\.0\.0\.1:(\d+)/metrics", installed.log_of("controller"))),
            30, "the controller to listen")

        def unready() -> str:
            reply = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
            return reply.text if reply.status_code == 503 else ""

        why = wait(unready, 30, "readiness to fail")
        assert "cannot read Lease xmem-system/not-the-charts-lease" in why
        assert "403" in why
        log = installed.log_of("controller")
        assert "ERROR" in log and "cannot read Lease" in log and "--lease-name" in log
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert metric_sum(text, "xmem_controller_lease_errors_total", code="403") >= 1
    finally:
        installed.close()


def test_5_the_cli_and_the_chart_name_the_same_lease():
    from tests.support.installed import LEASE
    from xmem_admission.commands import controller

    parser = __import__("argparse").ArgumentParser()
    controller.register(parser.add_subparsers())
    args = parser.parse_args(["controller"])
    assert args.lease_name == LEASE


def test_7_the_controller_sees_a_policy_change_within_seconds_not_at_resync(harness: Harness):
    harness.spawn("--resync-seconds", "300", identity="watcher", cluster_policy=True)
    wait(lambda: "policy default loaded" in harness.log_of("watcher"), 30, "the first load")
    policy = harness.server.get("xmem.io/v1alpha1", "GPUAdmissionPolicy", "default")
    policy["spec"]["estimation"]["resources"]["memory"] = "3Gi"
    changed = harness.server.api.update(
        harness.server.api.kind("xmem.io/v1alpha1", "GPUAdmissionPolicy"), None, "default",
        policy)[0]
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
            "fingerprint": fingerprint, "workload": {"namespace": "default", "kind": "Job",
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
