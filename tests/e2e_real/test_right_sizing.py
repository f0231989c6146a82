"""Right-sizing on the real control plane: what a finished Job's pods used,
read from a real Prometheus, lands on its GPUMemoryEstimate, and the next Job of the same
fingerprint in the namespace is sized from it at CREATE.

Prometheus (``make tools``) scrapes, every second, an exporter this test serves with the series
HAMi's vGPU monitor and DCGM exporter publish (names and labels as ``cluster.observations``
cites them) for each Job's pod once it runs. The pod's peak is in one scrape only: the latest
value, what an instant query returns, is a third of it; only ``max_over_time`` over the pod's
lifetime finds it. The first Job's pod shares its GPU through HAMi (its per-container series
counts, not the whole card's DCGM figure), the second has its GPU alone (DCGM counts). With
Prometheus stopped, a third Job runs and ends as sized, and all that changes is a logged
warning and ``xmem_controller_observed_peak_failures_total``. About 2 minutes here (three Jobs,
one estimation, 20 s held per pod), on two cores shared with a CI run.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import httpx

from localkube.controlplane import wait_for
from tests.e2e_real.support import oom_job, policy
from tests.e2e_real.test_what_a_real_api_server_found import _metrics_port
from tests.helm.chart import tool
from tests.rightsizing.prometheus import Exporter, start_prometheus, stop
from tests.support.harness import metric_sum
from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.quantity import GiB, MiB
from xmem_admission.cluster.policy.model import Policy
from xmem_admission.cluster.policy.sizing import size_request
from xmem_admission.contract import gpus

GPU = "A100-80GB"
HOLD = 20  # seconds a Job's pod stays up after its step: its spike is scraped meanwhile
NEED = 256 * MiB  # what the step allocates: it fits the first request (the 1 GiB minimum)
FIRST_PEAK = 3 * GiB  # HAMi's figure for the first Job's container (bytes)
SECOND_PEAK_MIB = 5 * 1024  # DCGM's figure for the second Job's GPU (MiB)
CARD = "GPU-5fd4e2a4-1c0b-7b52-2f0a-3e61c0d2a9{:02x}"


class GpuSeries:
    """The exporter's answer to scrape n: per pod that runs, HAMi- or DCGM-shaped series, a
    third of the peak except at the one scrape that holds it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pods: List[Tuple[str, str, str, int, int]] = []  # ns, pod, shape, peak, spike_at

    def add(self, namespace: str, pod: str, shape: str, peak: int, spike_at: int) -> None:
        with self.lock:
            self.pods.append((namespace, pod, shape, peak, spike_at))

    def __call__(self, n: int) -> str:
        hami = ["# TYPE vGPU_device_memory_usage_in_bytes gauge"]
        dcgm = ["# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).",
                "# TYPE DCGM_FI_DEV_FB_USED gauge"]
        with self.lock:
            pods = list(self.pods)
        for index, (namespace, pod, shape, peak, spike_at) in enumerate(pods):
            value = peak if n == spike_at else peak // 3
            card = CARD.format(index)
            where = f'namespace="{namespace}",pod="{pod}",container="train"'
            device = f'gpu="{index}",UUID="{card}",device="nvidia{index}",' \
                     f'modelName="NVIDIA A100-SXM4-80GB",Hostname="xmem-gpu-process-node"'
            if shape == "hami":
                hami.append(f'vGPU_device_memory_usage_in_bytes{{podnamespace="{namespace}",'
                            f'podname="{pod}",ctrname="train",vdeviceid="0",'
                            f'deviceuuid="{card}"}} {value}')
                dcgm.append(f"DCGM_FI_DEV_FB_USED{{{device},{where}}} 60000")  # the whole card
            else:
                dcgm.append(f"DCGM_FI_DEV_FB_USED{{{device},{where}}} {value}")
        return "\n".join(hami + dcgm) + "\n"


def _run(xmem: Any, name: str, exporter: Exporter, series: Optional[GpuSeries] = None,
         shape: str = "", peak: int = 0) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Submit a Job of the one fingerprint and see it complete; while its pod runs, the
    exporter publishes its series with the peak at one scrape (when ``series`` is given)."""
    xmem.cluster.apply(oom_job(name, xmem.namespace, GPU, NEED, "HAMi", hold_seconds=HOLD))
    pod = wait_for(lambda: next((p for p in xmem.pods(f"job-name={name}")
                                 if (p.get("status") or {}).get("phase") == "Running"), None),
                   240, f"the pod of {name} to run", interval=0.3)
    if series is not None:
        spike_at = len(exporter.served) + 2
        series.add(xmem.namespace, pod["metadata"]["name"], shape, peak, spike_at)
        wait_for(lambda: len(exporter.served) > spike_at + 1, 30, "the spike to be scraped")
    job = wait_for(lambda: (lambda obj: obj if any(
        c.get("type") == "Complete" and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []) else None)(xmem.job(name)),
        120, f"{name} to complete", interval=0.5)
    return job, pod


def _gme(xmem: Any) -> Dict[str, Any]:
    [gme] = xmem.gmes()
    return gme


def _run_of(xmem: Any, job: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    for entry in (_gme(xmem).get("status") or {}).get("runs") or []:
        if entry["workload"]["uid"] == job["metadata"]["uid"]:
            return dict(entry)
    return None


def _request(obj: Dict[str, Any]) -> int:
    template = obj["spec"]["template"] if "template" in obj.get("spec", {}) else obj
    return int(template["metadata"]["annotations"][labels.REQUEST_BYTES])


def test_the_peak_a_run_used_lands_on_the_estimate_and_sizes_the_repeat_job(
        xmem, gpu_process_node, tmp_path: Path):
    cluster = xmem.cluster
    series = GpuSeries()
    exporter = Exporter(series).start()
    prometheus, url = start_prometheus(tmp_path / "prometheus", exporter)
    try:
        body = policy(xmem.policy_name, gpus=(GPU,), rightSizing={"prometheus": {
            "url": url, "timeoutSeconds": 5, "slackSeconds": 3}})
        cluster.apply(body)
        settings = Policy.from_object(body).for_namespace(xmem.namespace)
        capacity = gpus.lookup(GPU).capacity_bytes
        xmem.serve()
        name = f"controller-{xmem.namespace}"
        xmem.controller(name, "--no-leader-election")

        # 1. A first Job: estimated, released, and its HAMi container peaks at 3 GiB once.
        first, first_pod = _run(xmem, "first", exporter, series, "hami", FIRST_PEAK)
        estimate = int(first_pod["metadata"]["annotations"][labels.ESTIMATE_BYTES])
        ran = wait_for(lambda: _run_of(xmem, first), 60, "the first run on the estimate")
        assert ran["observedPeakBytes"] == FIRST_PEAK and ran["source"] == "HAMi"
        assert ran["estimateBytes"] == estimate and ran["completed"] is True
        assert ran["gpu"] == GPU and ran["requestBytes"] == _request(first_pod)
        status = _gme(xmem)["status"]
        assert status["observedPeak"] == "3.0Gi"
        assert status["observedPercent"] == round(100 * FIRST_PEAK / estimate)

        # 2. The repeat Job is sized at CREATE from that peak; its GPU alone, DCGM counts.
        second, second_pod = _run(xmem, "second", exporter, series, "dcgm",
                                  SECOND_PEAK_MIB)
        assert _request(second) == _request(second_pod) == \
            size_request(FIRST_PEAK, settings, capacity) > _request(first_pod)
        assert int(second_pod["spec"]["containers"][0]["resources"]["limits"][
            "nvidia.com/gpumem"]) * MiB >= _request(second_pod)
        assert second_pod["metadata"]["annotations"][labels.ESTIMATE_BYTES] == str(estimate)
        ran = wait_for(lambda: _run_of(xmem, second), 60, "the second run on the estimate")
        assert ran["observedPeakBytes"] == SECOND_PEAK_MIB * MiB and ran["source"] == "DCGM"
        assert _gme(xmem)["status"]["observedPeak"] == "5.0Gi"
        listed = subprocess.run(
            [tool("kubectl"), "--kubeconfig", str(cluster.plane.admin_kubeconfig), "get", "gme",
             "-n", xmem.namespace, "-o", "wide"], capture_output=True, text=True, timeout=60, check=True).stdout
        header, row = listed.splitlines()[:2]
        columns = header.split()
        assert columns.index("ESTIMATE") < columns.index("OBSERVED") < columns.index("OBSERVED%")
        assert "5.0Gi" in row.split()
        assert str(round(100 * SECOND_PEAK_MIB * MiB / estimate)) in row.split()

        # 3. Prometheus down: the next Job is sized from both runs and ends as sized; nothing
        #    is recorded for it, and the controller says why and counts it.
        stop(prometheus)
        third, third_pod = _run(xmem, "third", exporter)
        assert _request(third) == size_request(SECOND_PEAK_MIB * MiB, settings, capacity)
        port = _metrics_port(xmem, name)

        def failures() -> float:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            return metric_sum(text, "xmem_controller_observed_peak_failures_total",
                              reason="unreachable")
        wait_for(lambda: failures() == 1, 60, "the failed read to be counted")
        assert _run_of(xmem, third) is None
        assert len(_gme(xmem)["status"]["runs"]) == 2
        assert f"no observed GPU memory peak for {xmem.namespace}/" \
               f"{third_pod['metadata']['name']}" in cluster.log(name)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert metric_sum(text, "xmem_controller_observed_peaks_total", source="hami") == 1
        assert metric_sum(text, "xmem_controller_observed_peaks_total", source="dcgm") == 1
    finally:
        stop(prometheus)
        exporter.shutdown()
