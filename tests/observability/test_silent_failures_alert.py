"""The alerts for the ways xmem could fail without a word, unit-tested by the real promtool: the
controller gone or not leading, workloads the webhook holds with no controller to release them
(read from the webhook's own counter), the API server admitting unreviewed (its fail-open
counter), and the webhook's serving certificate near expiry. Each fires on its situation and
stays quiet otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from tests.observability.rules import RULE_VALUES, rule_groups
from tests.observability.test_alert_rules import _run_unit_tests

JOB = "xmem-xmem-admission-controller-metrics"  # the controller's metrics Service: its scrape job
DAY = 86400


def _up(value: str, instance: str = "10.0.0.7:8080") -> Dict[str, str]:
    return {"series": f'up{{job="{JOB}",instance="{instance}"}}', "values": value}


def _leader(value: str, instance: str = "10.0.0.7:8080") -> Dict[str, str]:
    return {"series": f'xmem_controller_leader{{job="{JOB}",instance="{instance}"}}',
            "values": value}


def _held(value: str, kind: str = "Job") -> Dict[str, str]:
    return {"series": f'xmem_workloads_held_total{{job="xmem-xmem-admission-webhook",'
                      f'instance="10.0.0.9:8080",kind="{kind}"}}', "values": value}


def _fired(summary: str, description: str, severity: str = "critical",
           **labels: str) -> List[Dict[str, object]]:
    return [{"exp_labels": {"severity": severity, **labels},
             "exp_annotations": {"summary": summary, "description": description}}]


def _case(series: List[Dict[str, str]], alert: str, at: str, fired: List[Dict[str, object]]
          ) -> Dict[str, object]:
    return {"interval": "1m", "input_series": series,
            "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": fired}]}


def test_a_controller_that_stops_being_scraped_alerts_after_five_minutes(tmp_path: Path) -> None:
    gone = [_up("1 1 1 1 1 0 0 0 0 0 0 0 0 0 0"), _leader("1 1 1 1 1")]
    description = ("Prometheus has scraped no xmem controller replica for 5m. Held workloads are "
                   "neither estimated nor released while it is down: check the controller's "
                   "pods (kubectl get pods -n xmem-system -l "
                   "app.kubernetes.io/component=controller).")
    fired = _fired("No xmem controller replica is up", description)
    never_scraped: List[Dict[str, str]] = [_held("0x15")]  # Prometheus has no controller target
    _run_unit_tests(tmp_path, [
        _case(gone, "XmemControllerDown", "8m", []),  # down 3 minutes: not yet
        _case(gone, "XmemControllerDown", "11m", fired),
        _case(never_scraped, "XmemControllerDown", "11m", fired),
        _case([_up("1x15"), _leader("1x15")], "XmemControllerDown", "11m", []),
    ])


def test_replicas_that_run_without_a_leader_alert_and_a_standby_beside_a_leader_does_not(
        tmp_path: Path) -> None:
    standby = "10.0.0.8:8080"
    leaderless = [_up("1x15"), _leader("0x15"), _up("1x15", standby), _leader("0x15", standby)]
    led = [_up("1x15"), _leader("1x15"), _up("1x15", standby), _leader("0x15", standby)]
    _run_unit_tests(tmp_path, [
        _case(leaderless, "XmemControllerNotLeading", "11m", _fired(
            "xmem controller replicas run but none leads",
            "No controller replica has held the Lease "
                               "xmem-xmem-admission-controller for 5m: nothing estimates or "
                               "releases held workloads. Check the replicas' logs for Lease "
                               "errors (xmem_controller_lease_errors_total) and the Lease "
                               "(kubectl get lease -n xmem-system "
            "xmem-xmem-admission-controller).")),
        _case(led, "XmemControllerNotLeading", "11m", []),
        # Down altogether is the other alert's.
        _case([_up("0x15")], "XmemControllerNotLeading", "11m", []),
    ])


def test_holds_the_webhook_counts_with_no_leading_controller_alert_by_kind(tmp_path: Path) -> None:
    # The controller's series end at minute 5; the webhook holds a Job at minute 7 and 9.
    alone = [_up("1 1 1 1 1 1"), _leader("1 1 1 1 1 1"), _held("0 0 0 0 0 0 0 1 1 2 2 2 2 2 2 2 2 2"),
             _held("0x17", kind="PyTorchJob")]
    attended = [_up("1x17"), _leader("1x17"), _held("0 0 0 0 0 0 0 1 1 2 2 2 2 2 2 2 2 2")]
    quiet = [_up("1 1 1 1 1 1"), _leader("1 1 1 1 1 1"), _held("0x17")]  # down, nothing held
    _run_unit_tests(tmp_path, [
        _case(alone, "XmemWorkloadsHeldWithoutController", "16m", _fired(
            "The xmem webhook holds workloads that no controller releases",
            "The webhook held 2 Job workloads in the last 1h while no xmem "
                               "controller leads: they stay suspended until one runs. Bring "
                               "the controller back, or release them by hand "
            "(docs/operations.md, \"When a part is down\").", kind="Job")),
        _case(attended, "XmemWorkloadsHeldWithoutController", "16m", []),
        _case(quiet, "XmemWorkloadsHeldWithoutController", "16m", []),
    ])


def test_the_api_server_admitting_past_a_failing_xmem_webhook_alerts_with_its_name(
        tmp_path: Path) -> None:
    def fail_open(name: str, values: str) -> Dict[str, str]:
        return {"series": f'apiserver_admission_webhook_fail_open_count{{job="apiserver",'
                          f'name="{name}",type="admit"}}', "values": values}

    failing = [fail_open("namespace.mutate.xmem.io", "0 0 3 6 9 9 9 9 9 9"),
               fail_open("policy.other.example.com", "0+5x9")]
    _run_unit_tests(tmp_path, [
        _case(failing, "XmemWebhookFailingOpen", "5m", _fired(
            "The API server admits workloads the xmem webhook did not review",
            "Calls to the webhook namespace.mutate.xmem.io failed 9 times in "
                               "10 minutes and, with failurePolicy Ignore, the API server "
                               "admitted those objects unchanged: neither held nor sized. Check "
                               "the webhook's pods, its Service and its certificate (the API "
            "server's log names the error).", severity="warning",
            name="namespace.mutate.xmem.io")),
        # Another webhook's failures are not xmem's.
        _case([fail_open("policy.other.example.com", "0+5x9")], "XmemWebhookFailingOpen", "5m",
              []),
    ])


def test_a_serving_certificate_within_fourteen_days_of_expiry_alerts(tmp_path: Path) -> None:
    def expiry(seconds: int, instance: str) -> Dict[str, str]:
        return {"series": f'xmem_admission_certificate_expiry_timestamp_seconds{{'
                          f'instance="{instance}"}}', "values": f"{seconds}x10"}

    # At 5m (300 s): one replica still serves a certificate with 10 days left, the other a
    # renewed one.
    stale = [expiry(300 + 10 * DAY, "10.0.0.9:8080"), expiry(300 + 365 * DAY, "10.0.0.10:8080")]
    renewed = [expiry(300 + 365 * DAY, "10.0.0.9:8080")]
    _run_unit_tests(tmp_path, [
        _case(stale, "XmemWebhookCertificateExpiring", "5m", _fired(
            "The xmem webhook's serving certificate expires soon",
            "A webhook replica serves a certificate that expires in 10d 0h "
                               "0m 0s. At expiry the API server can no longer call the webhook "
                               "and, with failurePolicy Ignore, xmem stops reviewing workloads. "
                               "The webhook renews the chart's self-signed certificate itself "
                               "(cert-manager renews its own): check the webhook's log for "
            "certificate errors.")),
        _case(renewed, "XmemWebhookCertificateExpiring", "5m", []),
    ])


def test_a_release_without_a_controller_has_no_controller_alerts() -> None:
    values = {**RULE_VALUES, "controller": {"enabled": False}}
    alerts = {r["alert"] for g in rule_groups(values) for r in g["rules"] if "alert" in r}
    assert "XmemControllerDown" not in alerts and "XmemControllerNotLeading" not in alerts
    assert {"XmemWebhookFailingOpen", "XmemWebhookCertificateExpiring"} <= alerts
