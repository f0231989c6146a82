"""The chart's alerts on OOM retries and right-sizing, unit-tested by the real
promtool: they fire on the situation they name, with the numbers, and stay quiet otherwise."""

from __future__ import annotations

from pathlib import Path

from tests.observability.test_alert_rules import _fires_only_on, _run_unit_tests


def test_retries_that_rarely_end_in_a_completed_workload_alert(tmp_path: Path) -> None:
    timid = [  # a retry a minute, one retried workload in four completes
        {"series": 'xmem_controller_oom_retries_total{backend="HAMi"}', "values": "0+1x120"},
        {"series": 'xmem_controller_oom_avoided_total{backend="HAMi"}', "values": "0+0.25x120"},
    ]
    saving = [  # every retried workload completes
        {"series": 'xmem_controller_oom_retries_total{backend="HAMi"}', "values": "0+1x120"},
        {"series": 'xmem_controller_oom_avoided_total{backend="HAMi"}', "values": "0+1x120"},
    ]
    _fires_only_on(
        tmp_path, "XmemOOMRetriesNotAvoidingFailures", timid, saving, "100m",
        "xmem's OOM retries rarely save the workload",
        "Only 25% of the workloads retried bigger after a CUDA out-of-memory failure completed "
        "over 6 hours. Look at status.oomRetries (kubectl get gme -A -o yaml): a low "
        "oomRetry.maxRequest or growthPercent, or estimates far below use (raise "
        "safetyMarginPercent).")


def test_retries_none_of_which_completed_alert_and_no_retries_stay_quiet(tmp_path: Path) -> None:
    never = [{"series": 'xmem_controller_oom_retries_total{backend="KAI"}', "values": "0+1x120"}]
    quiet = [{"series": 'xmem_controller_oom_avoided_total{backend="KAI"}', "values": "0x120"}]
    _fires_only_on(
        tmp_path, "XmemOOMRetriesNotAvoidingFailures", never, quiet, "100m",
        "xmem's OOM retries rarely save the workload",
        "Only 0% of the workloads retried bigger after a CUDA out-of-memory failure completed "
        "over 6 hours. Look at status.oomRetries (kubectl get gme -A -o yaml): a low "
        "oomRetry.maxRequest or growthPercent, or estimates far below use (raise "
        "safetyMarginPercent).")


def test_observed_peaks_that_cannot_be_read_alert_with_the_reason(tmp_path: Path) -> None:
    failing = [
        {"series": 'xmem_controller_observed_peak_failures_total{reason="timeout"}',
         "values": "0+1x60"},
        {"series": 'xmem_controller_observed_peak_failures_total{reason="unreachable"}',
         "values": "0x60"},
    ]
    healthy = [
        {"series": 'xmem_controller_observed_peak_failures_total{reason="timeout"}',
         "values": "0x60"},
        {"series": 'xmem_controller_observed_peaks_total{source="hami"}', "values": "0+1x60"},
    ]
    _run_unit_tests(tmp_path, [
        {"interval": "1m", "input_series": failing, "alert_rule_test": [
            {"eval_time": "45m", "alertname": "XmemObservedPeaksUnreadable", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "reason": "timeout"},
                "exp_annotations": {
                    "summary": "xmem cannot read observed GPU memory peaks from Prometheus",
                    "description": "Reads of finished workloads' peaks failed (timeout) for 30 "
                                   "minutes: right-sizing corrects nothing meanwhile. Check the "
                                   "policy's spec.rightSizing.prometheus (url, token, CA, "
                                   "tenant) and the controller's NetworkPolicy egress "
                                   "(networkPolicy.prometheus)."}}]}]},
        {"interval": "1m", "input_series": healthy, "alert_rule_test": [
            {"eval_time": "45m", "alertname": "XmemObservedPeaksUnreadable", "exp_alerts": []}]},
    ])
