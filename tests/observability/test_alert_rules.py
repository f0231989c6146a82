"""The chart's recording rules and alerts, checked and unit-tested by the real promtool: each
alert fires on the situation it names, stays quiet otherwise, and says what to do; the recording
rules join GPU memory actually used (DCGM exporter or HAMi) to the workload xmem sized."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import yaml

from tests.helm.chart import run, tool
from tests.observability.rules import rule_groups, write_rule_file

GiB = 1024 ** 3
MiB = 1024 ** 2
A100 = 84970559242  # xmem gpus: A100-80GB capacity_bytes, the chart's gpuCapacityBytes default


def _dcgm(namespace: str, pod: str, mib: int, minutes: int = 30, gpu: str = "0") -> Dict[str, str]:
    labels = (f'gpu="{gpu}",UUID="GPU-5fd4e2a4-1c0b-7b52-2f0a-00000000000{gpu}",device="nvidia{gpu}",'
              f'modelName="NVIDIA A100-SXM4-80GB",Hostname="gpu-node-1",container="trainer",'
              f'namespace="{namespace}",pod="{pod}"')
    return {"series": f"DCGM_FI_DEV_FB_USED{{{labels}}}", "values": f"{mib}x{minutes}"}


def _owner(namespace: str, pod: str, kind: str, name: str, minutes: int = 30) -> Dict[str, str]:
    return {"series": f'kube_pod_owner{{namespace="{namespace}",pod="{pod}",owner_kind="{kind}",'
                      f'owner_name="{name}",owner_is_controller="true"}}',
            "values": f"1x{minutes}"}


def _request(namespace: str, workload: str, value: int, minutes: int = 30,
             gpu_model: str = "A100-80GB") -> Dict[str, str]:
    return {"series": f'xmem_estimate_request_bytes{{namespace="{namespace}",workload="{workload}",'
                      f'kind="Job",gpu_model="{gpu_model}",job="xmem"}}',
            "values": f"{value}x{minutes}"}


def _run_unit_tests(tmp_path: Path, tests: List[Dict[str, Any]]) -> None:
    promtool = tool("promtool")
    rules = write_rule_file(tmp_path)
    spec = tmp_path / "tests.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m",
                                    "tests": tests}, sort_keys=False))
    result = run([promtool, "test", "rules", str(spec)], check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _fires_only_on(tmp_path: Path, alert: str, bad: List[Dict[str, str]],
                   good: List[Dict[str, str]], at: str, summary: str, description: str) -> None:
    """The alert fires (severity warning, these annotations) on `bad` and not on `good`."""
    _run_unit_tests(tmp_path, [
        {"interval": "1m", "input_series": bad, "alert_rule_test": [
            {"eval_time": at, "alertname": alert, "exp_alerts": [{
                "exp_labels": {"severity": "warning"},
                "exp_annotations": {"summary": summary, "description": description}}]}]},
        {"interval": "1m", "input_series": good, "alert_rule_test": [
            {"eval_time": at, "alertname": alert, "exp_alerts": []}]},
    ])


def test_promtool_accepts_the_rendered_rules(tmp_path: Path) -> None:
    promtool = tool("promtool")
    rules = write_rule_file(tmp_path)
    result = run([promtool, "check", "rules", str(rules)])
    recording = sum(1 for g in rule_groups() for r in g["rules"] if "record" in r)
    alerting = sum(1 for g in rule_groups() for r in g["rules"] if "alert" in r)
    assert f"SUCCESS: {recording + alerting} rules found" in result.stdout
    assert alerting == 11


def test_memory_above_request_alerts_after_five_minutes_for_that_workload_only(tmp_path: Path) -> None:
    over = "XmemGPUMemoryAboveRequest"
    series = [
        # resnet: given 20 GiB, uses 30000 MiB on its GPU: an OOM waiting to happen.
        _dcgm("ml-team", "resnet-x7k2p", 30000), _owner("ml-team", "resnet-x7k2p", "Job", "resnet"),
        _request("ml-team", "resnet", 20 * GiB),
        # llama: given 40 GiB, uses 30000 MiB: fine.
        _dcgm("ml-team", "llama-9bq4d", 30000, gpu="1"),
        _owner("ml-team", "llama-9bq4d", "Job", "llama"), _request("ml-team", "llama", 40 * GiB),
    ]
    description = ("ml-team/resnet uses 29.3GiB of GPU memory, above its request: the next spike "
                   "can OOM it or, on GPUs shared without isolation, its neighbours. Check the "
                   "estimate (kubectl get gme -n ml-team) and raise the policy's "
                   "safetyMarginPercent if this repeats.")
    _run_unit_tests(tmp_path, [{
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": over, "exp_alerts": []},
            {"eval_time": "10m", "alertname": over, "exp_alerts": [{
                "exp_labels": {"severity": "warning", "namespace": "ml-team", "workload": "resnet"},
                "exp_annotations": {
                    "summary": "GPU memory use above the xmem request (OOM risk)",
                    "description": description}}]},
        ],
        "promql_expr_test": [
            {"expr": "xmem:workload_gpu_memory_used_bytes", "eval_time": "10m", "exp_samples": [
                {"labels": 'xmem:workload_gpu_memory_used_bytes{namespace="ml-team",workload="resnet"}',
                 "value": 30000 * MiB},
                {"labels": 'xmem:workload_gpu_memory_used_bytes{namespace="ml-team",workload="llama"}',
                 "value": 30000 * MiB}]},
            {"expr": 'xmem:workload_request_error_ratio{workload="llama"}', "eval_time": "10m",
             "exp_samples": [{"labels": 'xmem:workload_request_error_ratio{namespace="ml-team",'
                                        'workload="llama"}',
                              "value": (40 * GiB - 30000 * MiB) / (30000 * MiB)}]},
        ],
    }])


def test_hami_usage_counts_when_there_is_no_dcgm_and_a_bare_pod_is_its_own_workload(
        tmp_path: Path) -> None:
    series = [
        {"series": 'hami_vgpu_memory_used_bytes{namespace="research",pod="notebook-gpu",'
                   'container="jupyter",deviceuuid="GPU-1"}', "values": f"{12 * GiB}x30"},
        _owner("research", "notebook-gpu", "<none>", "<none>"),
        _request("research", "notebook-gpu", 16 * GiB, gpu_model="A100-80GB"),
    ]
    _run_unit_tests(tmp_path, [{
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [{"eval_time": "10m", "alertname": "XmemGPUMemoryAboveRequest",
                             "exp_alerts": []}],
        "promql_expr_test": [
            {"expr": "xmem:workload_gpu_memory_used_bytes", "eval_time": "5m", "exp_samples": [
                {"labels": 'xmem:workload_gpu_memory_used_bytes{namespace="research",'
                           'workload="notebook-gpu"}', "value": 12 * GiB}]},
            # Memory left for others on the A100-80GB versus a whole-GPU request.
            {"expr": "xmem:workload_gpu_memory_saved_bytes", "eval_time": "5m", "exp_samples": [
                {"labels": 'xmem:workload_gpu_memory_saved_bytes{gpu_model="A100-80GB",'
                           'namespace="research",workload="notebook-gpu"}',
                 "value": A100 - 16 * GiB}]},
        ],
    }])


def test_hamis_series_before_v2_9_counts_and_a_pod_under_both_names_counts_once(
        tmp_path: Path) -> None:
    series = [  # HAMi up to v2.8.3: the old name and labels only
        {"series": 'vGPU_device_memory_usage_in_bytes{podnamespace="research",podname="old-hami",'
                   'ctrname="jupyter",vdeviceid="0",deviceuuid="GPU-1"}', "values": f"{6 * GiB}x30"},
        _owner("research", "old-hami", "<none>", "<none>"),
        # HAMi v2.9.0 on with --legacy-metrics: both names for one container
        {"series": 'hami_vgpu_memory_used_bytes{namespace="research",pod="both-hami",'
                   'container="jupyter",vdevice_index="0",device_uuid="GPU-2"}',
         "values": f"{5 * GiB}x30"},
        {"series": 'vGPU_device_memory_usage_in_bytes{podnamespace="research",podname="both-hami",'
                   'ctrname="jupyter",vdeviceid="0",deviceuuid="GPU-2"}', "values": f"{5 * GiB}x30"},
        _owner("research", "both-hami", "<none>", "<none>"),
    ]
    _run_unit_tests(tmp_path, [{
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            {"expr": "xmem:pod_gpu_memory_used_bytes", "eval_time": "5m", "exp_samples": [
                {"labels": 'xmem:pod_gpu_memory_used_bytes{namespace="research",pod="old-hami"}',
                 "value": 6 * GiB},
                {"labels": 'xmem:pod_gpu_memory_used_bytes{namespace="research",pod="both-hami"}',
                 "value": 5 * GiB}]},
            {"expr": "xmem:workload_gpu_memory_used_bytes", "eval_time": "5m", "exp_samples": [
                {"labels": 'xmem:workload_gpu_memory_used_bytes{namespace="research",'
                           'workload="old-hami"}', "value": 6 * GiB},
                {"labels": 'xmem:workload_gpu_memory_used_bytes{namespace="research",'
                           'workload="both-hami"}', "value": 5 * GiB}]},
        ],
    }])


def test_failing_estimations_alert_when_a_fifth_of_them_fail(tmp_path: Path) -> None:
    name = "XmemEstimationsFailing"
    failing = [  # one OOMKilled estimation pod for every one that succeeds
        {"series": 'xmem_controller_estimations_failed_total{reason="OOMKilled"}', "values": "0+1x60"},
        {"series": "xmem_controller_estimations_succeeded_total", "values": "0+1x60"},
    ]
    healthy = [  # a failure early on, then only successes
        {"series": 'xmem_controller_estimations_failed_total{reason="ScriptFailed"}',
         "values": "0 1 1+0x58"},
        {"series": "xmem_controller_estimations_succeeded_total", "values": "0+2x60"},
    ]
    _fires_only_on(
        tmp_path, name, failing, healthy, "45m", "Many xmem estimations fail",
        "50% of estimations failed over 30 minutes. Workloads then get the policy's "
        "onEstimationFailure action instead of an estimate; see the Events of the held "
        "workloads for the probe's last log lines.")


def _latency_buckets(per_minute_slow: int) -> List[Dict[str, str]]:
    """100 admissions a minute on /mutate, `per_minute_slow` of them taking 1 to 2.5 s."""
    fast = 100 - per_minute_slow
    out = []
    for le in ("0.001", "0.005", "0.5", "1.0"):
        out.append({"series": f'xmem_admission_duration_seconds_bucket{{endpoint="mutate",le="{le}"}}',
                    "values": f"0+{fast}x30"})
    for le in ("2.5", "10.0", "+Inf"):
        out.append({"series": f'xmem_admission_duration_seconds_bucket{{endpoint="mutate",le="{le}"}}',
                    "values": "0+100x30"})
    return out


def test_slow_admissions_alert_at_the_p99(tmp_path: Path) -> None:
    _fires_only_on(
        tmp_path, "XmemWebhookSlow", _latency_buckets(5), _latency_buckets(0), "20m",
        "xmem admission webhook is slow",
        "p99 admission latency is 2.2s. The API server waits for it on every opted-in Job and "
        "Pod creation and gives up after timeoutSeconds (5 s), admitting unchanged.")


def test_a_workload_held_past_the_threshold_alerts(tmp_path: Path) -> None:
    name = "XmemWorkloadHeldTooLong"
    series = [  # the controller's gauge: the oldest held Job's wait, growing by the minute
        {"series": 'xmem_controller_held_workload_oldest_age_seconds{kind="Job"}',
         "values": "3000+60x30"},
        {"series": 'xmem_controller_held_workload_oldest_age_seconds{kind="PyTorchJob"}',
         "values": "10+60x30"},
    ]
    _run_unit_tests(tmp_path, [{"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": "5m", "alertname": name, "exp_alerts": []},
        {"eval_time": "15m", "alertname": name, "exp_alerts": [{
            "exp_labels": {"severity": "warning", "kind": "Job"},
            "exp_annotations": {
                "summary": "A workload has been held by xmem for too long",
                "description": "The oldest held Job has been suspended awaiting its estimate for "
                               "1h 5m 0s. The policy's maxHoldSeconds should have released it: "
                               "check the xmem controller (kubectl get gme -A, and the "
                               "workload's Events)."}}]},
    ]}])
