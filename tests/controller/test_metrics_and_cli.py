"""The controller's metrics over HTTP, and ``xmem controller``'s answers to bad input."""

from __future__ import annotations

import urllib.request

import pytest

from tests.controller.support import UNPULLABLE, training_job, wait
from tests.support.harness import metric
from xmem_admission import cli
from xmem_admission.cluster.controller.manager import HealthServer


def test_metrics_count_estimations_by_outcome_and_show_held_workloads(harness):
    controller = harness.controller()
    health = HealthServer(controller, "127.0.0.1", 0).start()
    try:
        harness.submit(training_job("good"))
        harness.submit(training_job("bad", image=UNPULLABLE))
        harness.wait_released("good")
        harness.wait_released("bad")

        def scrape() -> str:
            url = f"http://127.0.0.1:{health.port}/metrics"
            return urllib.request.urlopen(url, timeout=5).read().decode()

        def settled(text: str) -> bool:
            # A release is counted just after its write, and the held gauge is published at
            # the next resync from the watch cache, which may not have seen the last release yet.
            return bool(metric(text, "xmem_controller_estimates", gpu_model="A100-80GB")) and \
                sum(metric(text, "xmem_controller_released_workloads_total", kind="Job",
                           outcome=o) or 0 for o in ("estimated", "unchanged")) == 2 and \
                metric(text, "xmem_controller_held_workloads", kind="Job") == 0

        text = wait(lambda: (lambda t: t if settled(t) else None)(scrape()), 10,
                    "the resync to publish the gauges and both releases")
        assert metric(text, "xmem_controller_estimations_started_total") == 2
        assert metric(text, "xmem_controller_estimations_succeeded_total") == 1
        assert metric(text, "xmem_controller_estimations_failed_total",
                      reason="ImagePullFailed") == 1
        assert metric(text, "xmem_controller_estimation_duration_seconds_count") == 1
        assert metric(text, "xmem_controller_released_workloads_total", kind="Job",
                      outcome="estimated") == 1
        assert metric(text, "xmem_controller_released_workloads_total", kind="Job",
                      outcome="unchanged") == 1
        assert metric(text, "xmem_controller_held_workloads", kind="Job") == 0
        assert metric(text, "xmem_controller_estimates", gpu_model="H100-80GB") == 1
        assert metric(text, "xmem_controller_leader") == 1
        ready = urllib.request.urlopen(f"http://127.0.0.1:{health.port}/readyz", timeout=5)
        assert ready.read().strip() == b"leading"
    finally:
        health.stop()


def test_held_workloads_and_their_age_are_published_while_they_wait(harness):
    harness.submit(training_job("waiting", image=UNPULLABLE))
    controller = harness.controller(start=False)
    for informer in controller.informers():
        informer.start()
        assert informer.synced.wait(60), informer.error
    wait(lambda: controller.ctx.workloads["Job"].informer.get(harness.namespace, "waiting"), 10, "cache")
    controller.resync()
    text = __import__("prometheus_client").generate_latest(controller.metrics.registry).decode()
    assert metric(text, "xmem_controller_held_workloads", kind="Job") == 1
    assert metric(text, "xmem_controller_held_workload_oldest_age_seconds", kind="Job") >= 0
    controller.stop()


@pytest.mark.parametrize("argv, complaint", [
    (["--probe-image", "img", "--workloads", "Job,CronJob"], "unknown kind CronJob"),
    (["--probe-image", "img", "--kubeconfig", "/nonexistent/kubeconfig"], "no cluster credentials"),
])
def test_bad_input_is_one_clear_line_and_exit_status_2(argv, complaint, capsys, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("XMEM_PROBE_IMAGE", raising=False)
    assert cli.main(["controller", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xmem controller: error:")
    assert complaint in err


def test_the_probe_image_is_required_unless_its_environment_variable_names_it(capsys,
                                                                              monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("XMEM_PROBE_IMAGE", raising=False)
    with pytest.raises(SystemExit) as exited:
        cli.main(["controller", "--kubeconfig", "/nonexistent/kubeconfig"])
    assert exited.value.code == 2
    assert "the following arguments are required: --probe-image" in capsys.readouterr().err
    monkeypatch.setenv("XMEM_PROBE_IMAGE", "img")
    assert cli.main(["controller", "--kubeconfig", "/nonexistent/kubeconfig"]) == 2
    assert "no cluster credentials" in capsys.readouterr().err


def test_a_renew_deadline_not_shorter_than_the_lease_is_refused(harness, capsys):
    code = cli.main(["controller", "--probe-image", "img", "--kubeconfig",
                     harness.kubeconfig, "--lease-duration", "1", "--renew-deadline", "2",
                     "--metrics-port", "0"])
    assert code == 2
    assert "renew_deadline must be shorter than lease_duration" in capsys.readouterr().err
