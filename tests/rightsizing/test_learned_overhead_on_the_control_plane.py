"""The memory outside the allocator, learned in the cluster, on the real
control plane with a real Prometheus.

Prometheus (``make tools``) scrapes, every second, an exporter this test serves with DCGM
exporter-shaped series (``DCGM_FI_DEV_FB_USED`` per device, the pod's namespace and name, and
the ``DCGM_FI_DRIVER_VERSION`` label dcgm-exporter puts on every series) for each Job's pod once
it runs. Two Jobs of one fingerprint use, at their peak, their estimate's simulated reserved
peak plus 500 MiB more outside the allocator than the estimate's own term (the catalogue's):
the controller records both runs, learns the figure for the GPU model and driver
(``learnedOverhead.minJobs: 2``), writes it on the policy's status and publishes it as a
metric. The next new Job (another fingerprint, estimated and released by the controller) is
requested that much more, and says so on its GPUMemoryEstimate and in ``kubectl get gme``.
Then a third run of the first fingerprint leaks 20 GiB: the learned figure does not follow it
(a high quantile is never the single largest value), and the repeat of the new Job, sized at
CREATE by the webhook, moves by the same learned amount, never more than the bound.
About 3 minutes here (four Jobs, two estimations, 8 s held per pod).
"""

from __future__ import annotations

import math
import subprocess
import threading
import time
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
DRIVER = "580.159.04"
EXTRA = 500 * MiB  # what the runs keep outside the allocator beyond the estimate's own term
WILD = 20 * GiB  # a run that leaks
BOUND = 1 * GiB  # learnedOverhead.maxCorrection (the default)
NEED = 256 * MiB  # what the step allocates: it fits the first request (the 1 GiB minimum)
HOLD = 8  # seconds a pod stays up after its step: its spike is scraped meanwhile
CARD = "GPU-7a1c90e2-5b3d-4c1e-9f00-3e61c0d2b0{:02x}"


class DcgmSeries:
    """The exporter's answer to scrape n: per pod that runs, a DCGM series with the driver
    label, a third of its peak except at the one scrape that holds it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pods: List[Tuple[str, str, int, int]] = []  # namespace, pod, peak MiB, spike_at

    def add(self, namespace: str, pod: str, peak_mib: int, spike_at: int) -> None:
        with self.lock:
            self.pods.append((namespace, pod, peak_mib, spike_at))

    def __call__(self, n: int) -> str:
        lines = ["# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).",
                 "# TYPE DCGM_FI_DEV_FB_USED gauge"]
        with self.lock:
            pods = list(self.pods)
        for index, (namespace, pod, peak, spike_at) in enumerate(pods):
            value = peak if n == spike_at else peak // 3
            lines.append(
                f'DCGM_FI_DEV_FB_USED{{gpu="{index}",UUID="{CARD.format(index)}",'
                f'device="nvidia{index}",modelName="NVIDIA A100-SXM4-80GB",'
                f'Hostname="xmem-gpu-process-node",DCGM_FI_DRIVER_VERSION="{DRIVER}",'
                f'namespace="{namespace}",pod="{pod}",container="train"}} {value}')
        return "\n".join(lines) + "\n"


def _estimate_row(xmem: Any, fingerprint: str) -> Dict[str, Any]:
    """The GME of a fingerprint, once it holds an estimate, and its row for the GPU."""
    def found() -> Optional[Dict[str, Any]]:
        for gme in xmem.gmes():
            status = gme.get("status") or {}
            if gme["spec"]["fingerprint"] == fingerprint and status.get("estimates"):
                return gme
        return None
    gme = wait_for(found, 240, f"the estimate of {fingerprint[:12]}", interval=0.5)
    [row] = [r for r in gme["status"]["estimates"] if r["gpu"] == GPU]
    return dict(row, gme=gme)


def _run(xmem: Any, name: str, hold: int, exporter: Exporter, series: DcgmSeries,
         outside: Optional[int] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Submit a Job and see it complete. With ``outside``, while its pod runs the exporter
    publishes a peak of the estimate's simulated reserved peak plus ``outside``."""
    xmem.cluster.apply(oom_job(name, xmem.namespace, GPU, NEED, "HAMi", hold_seconds=hold))
    pod = wait_for(lambda: next((p for p in xmem.pods(f"job-name={name}")
                                 if (p.get("status") or {}).get("phase") == "Running"), None),
                   240, f"the pod of {name} to run", interval=0.3)
    if outside is not None:
        row = _estimate_row(xmem, _fingerprint(xmem, name))
        spike_at = len(exporter.served) + 2
        series.add(xmem.namespace, pod["metadata"]["name"],
                   math.ceil((row["peakReservedBytes"] + outside) / MiB), spike_at)
        wait_for(lambda: len(exporter.served) > spike_at + 1, 30, "the spike to be scraped")
    job = wait_for(lambda: (lambda obj: obj if any(
        c.get("type") == "Complete" and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []) else None)(xmem.job(name)),
        120, f"{name} to complete", interval=0.5)
    return job, pod


def _fingerprint(xmem: Any, job: str) -> str:
    """The fingerprint the webhook wrote on a Job at its CREATE."""
    return str(xmem.job(job)["metadata"]["annotations"][labels.FINGERPRINT])


def _learned(xmem: Any) -> List[Dict[str, Any]]:
    found = xmem.cluster.get("xmem.io/v1alpha1", "GPUAdmissionPolicy", xmem.policy_name)
    return list(((found or {}).get("status") or {}).get("learnedOverhead") or [])


def _runs_with_peaks(xmem: Any, fingerprint: str) -> int:
    return sum(1 for gme in xmem.gmes() if gme["spec"]["fingerprint"] == fingerprint
               for r in (gme.get("status") or {}).get("runs") or []
               if r.get("observedPeakBytes") and r.get("peakReservedBytes"))


def _request(obj: Dict[str, Any]) -> int:
    template = obj["spec"]["template"] if "template" in obj.get("spec", {}) else obj
    return int(template["metadata"]["annotations"][labels.REQUEST_BYTES])


def test_jobs_that_used_more_outside_the_allocator_move_the_next_new_jobs_request(
        xmem, gpu_process_node, tmp_path: Path):
    cluster = xmem.cluster
    series = DcgmSeries()
    exporter = Exporter(series).start()
    prometheus, url = start_prometheus(tmp_path / "prometheus", exporter)
    try:
        body = policy(xmem.policy_name, gpus=(GPU,), rightSizing={"prometheus": {
            "url": url, "timeoutSeconds": 5, "slackSeconds": 3}},
            learnedOverhead={"minJobs": 2})
        cluster.apply(body)
        settings = Policy.from_object(body).for_namespace(xmem.namespace)
        capacity = gpus.lookup(GPU).capacity_bytes
        xmem.serve()
        name = f"controller-{xmem.namespace}"
        xmem.controller(name, "--no-leader-election")

        # 1. Two runs of one fingerprint keep 500 MiB more outside the allocator than their
        #    estimate's own term: the controller learns it for the GPU model and driver.
        _run(xmem, "first", HOLD, exporter, series)  # estimated; no series for it
        fingerprint = _fingerprint(xmem, "first")
        row = _estimate_row(xmem, fingerprint)
        own = row["totalBytes"] - row["peakReservedBytes"]  # the catalogue's term
        for job in ("second", "third"):
            _run(xmem, job, HOLD, exporter, series, outside=own + EXTRA)
        wait_for(lambda: _runs_with_peaks(xmem, fingerprint) == 2, 60, "two runs with peaks")
        [learned] = wait_for(lambda: _learned(xmem) or None, 60, "the learned figure")
        assert learned["gpu"] == GPU and learned["driverVersion"] == DRIVER
        assert learned["jobs"] == 2 and learned["namespaces"] == 1
        assert 0 <= learned["outsideAllocatorBytes"] - (own + EXTRA) < MiB  # DCGM's MiB
        listed = subprocess.run(
            [tool("kubectl"), "--kubeconfig", str(cluster.plane.admin_kubeconfig), "get", "gap",
             xmem.policy_name], capture_output=True, text=True, timeout=60, check=True).stdout
        assert "LEARNED" in listed.splitlines()[0].split()
        assert f"{GPU}/{DRIVER} {round(learned['outsideAllocatorBytes'] / MiB)}Mi (2 jobs)" \
            in listed.splitlines()[1]
        port = _metrics_port(xmem, name)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert metric_sum(text, "xmem_controller_learned_overhead_bytes", gpu_model=GPU,
                          driver_version=DRIVER) == learned["outsideAllocatorBytes"]
        assert metric_sum(text, "xmem_controller_learned_overhead_jobs", gpu_model=GPU,
                          driver_version=DRIVER) == 2

        # 2. A new Job (another fingerprint: it holds longer) is estimated and released with
        #    its estimate's term replaced by the learned figure: the request moves by it.
        time.sleep(5)  # the webhook reloads the policy, status included, every 2 s
        new, new_pod = _run(xmem, "new", HOLD + 1, exporter, series)
        new_fp = _fingerprint(xmem, "new")
        assert new_fp != fingerprint
        new_row = _estimate_row(xmem, new_fp)
        correction = learned["outsideAllocatorBytes"] - (
            new_row["totalBytes"] - new_row["peakReservedBytes"])
        assert EXTRA <= correction < EXTRA + MiB
        plain = size_request(new_row["totalBytes"], settings, capacity)
        moved = size_request(new_row["totalBytes"] + correction, settings, capacity)
        assert _request(new) == _request(new_pod) == moved > plain
        assert new_pod["metadata"]["annotations"][labels.ESTIMATE_BYTES] == \
            str(new_row["totalBytes"])  # the estimate stays the estimator's figure
        overhead = new_row["gme"]["status"]["overhead"]
        assert overhead["source"] == "Learned" and overhead["jobs"] == 2
        assert overhead["correctionBytes"] == correction and overhead["driverVersion"] == DRIVER
        listed = subprocess.run(
            [tool("kubectl"), "--kubeconfig", str(cluster.plane.admin_kubeconfig), "get", "gme",
             "-n", xmem.namespace, "-o", "wide", new_row["gme"]["metadata"]["name"]],
            capture_output=True, text=True, timeout=60, check=True).stdout
        header, line = listed.splitlines()[:2]
        assert "OVERHEAD" in header.split()
        assert f"+{round(correction / MiB)}Mi" in line and "learned/2" in line

        # 3. A run that leaks 20 GiB: the figure does not follow it, and the repeat of the new
        #    Job, sized at CREATE by the webhook, moves by the same amount, within the bound.
        _run(xmem, "leak", HOLD, exporter, series, outside=own + WILD)
        wait_for(lambda: _runs_with_peaks(xmem, fingerprint) == 3, 60, "the leaking run")
        time.sleep(3)  # a resync (1 s here) learns again
        [after] = _learned(xmem)
        assert after["outsideAllocatorBytes"] == learned["outsideAllocatorBytes"]
        assert after["jobs"] == 3
        cluster.apply(oom_job("repeat", xmem.namespace, GPU, NEED, "HAMi", hold_seconds=HOLD + 1))
        repeat = xmem.job("repeat")
        assert _request(repeat) == moved  # sized at CREATE, no estimation
        assert moved - plain <= size_request(new_row["totalBytes"] + BOUND, settings,
                                             capacity) - plain
        events = [e["message"] for e in xmem.events("new") if e["reason"] == "Estimated"]
        assert any("outside the allocator" in m and "learned from 2 job(s)" in m
                   for m in events), events
    finally:
        stop(prometheus)
        exporter.shutdown()
