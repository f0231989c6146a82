"""A JobSet whose replicated Jobs run two programs closes the loop per program, on the real
control plane with the real JobSet v0.12.0 controller, the GPU process node (its pods really
run tests/e2e_real/scripts/oom_job.py) and a real Prometheus.

Each program is estimated on its own (``integrations.estimation_units``): one estimate each.
The JobSet's pods are owned by the Jobs JobSet makes; the controller walks pod -> Job -> JobSet
(``integrations.held_owner``) and tells the program by the pod's replicated Job
(``jobset.sigs.k8s.io/replicatedjob-name``, ``integrations.unit_of``). So the program that runs
out of GPU memory ("big": its step needs 1.2 GiB, its first pod got the 1 GiB minimum) is the
only one retried bigger, its OOM recorded on its own estimate, and the Job controller's
replacement pod gets the grant by the Job's uid (``podOwners``); the other ("small") keeps its
request. When the JobSet completes, what each program's pods used at their peak (HAMi's series,
served by an exporter Prometheus scrapes every second) lands on that program's estimate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from kubernetes import client

from localkube.controlplane import wait_for
from localkube.jobset import API_VERSION as JOBSET_API
from localkube.jobset import JOBSET_NAME_LABEL, REPLICATED_JOB_LABEL
from localkube.kwok import GPU_TOLERATION
from tests.e2e_real.support import GPU_POOL, IMAGE, policy
from tests.e2e_real.test_oom_retry import _condition as _true
from tests.e2e_real.test_oom_retry import _request
from tests.e2e_real.test_right_sizing import GpuSeries
from tests.rightsizing.prometheus import Exporter, start_prometheus, stop
from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.quantity import GiB, MiB

GPU = "A100-80GB"
HOLD = 20  # seconds a pod whose step fits stays up: its spike is scraped meanwhile
# replicated Job: (what its step needs on the GPU, the peak its pod's series shows)
PROGRAMS = {"big": (int(1.2 * GiB), 3 * GiB), "small": (256 * MiB, 2 * GiB)}
KINDS = ("--workloads", "Job,JobSet")


def _replicated(name: str, need: int) -> Dict[str, Any]:
    def field(path: str) -> Dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    return {"name": name, "replicas": 1, "template": {"spec": {
        "parallelism": 1, "completions": 1, "backoffLimit": 1, "template": {"spec": {
            "restartPolicy": "Never", "nodeSelector": GPU_POOL, "tolerations": [GPU_TOLERATION],
            "containers": [{
                "name": "train", "image": IMAGE, "command": ["python", "/app/oom_job.py"],
                "env": [{"name": "NEED_BYTES", "value": str(need)},
                        {"name": "ENFORCER", "value": "HAMi"},
                        {"name": "HOLD_SECONDS", "value": str(HOLD)},
                        {"name": "GRANTED_BYTES", "valueFrom": field(
                            f"metadata.annotations['{labels.REQUEST_BYTES}']")}],
                "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "4", "memory": "16Gi"}},
                "volumeMounts": [{"name": "code", "mountPath": "/app"}]}],
            "volumes": [{"name": "code", "configMap": {"name": "code"}}]}}}}}


def _mine(entries: Any, uid: str) -> List[Dict[str, Any]]:
    return [dict(e) for e in entries or [] if e["workload"]["uid"] == uid]


def test_a_jobset_of_two_programs_retries_only_the_one_that_ran_out_and_records_each_peak(
        xmem: Any, trainer: Any, gpu_process_node: Any, tmp_path: Path) -> None:
    cluster = xmem.cluster
    series = GpuSeries()
    exporter = Exporter(series).start()
    prometheus, url = start_prometheus(tmp_path / "prometheus", exporter)
    try:
        cluster.apply(policy(xmem.policy_name, gpus=(GPU,), rightSizing={"prometheus": {
            "url": url, "timeoutSeconds": 5, "slackSeconds": 3}}))
        xmem.serve()
        xmem.controller("", "--no-leader-election", *KINDS)
        body = {"apiVersion": JOBSET_API, "kind": "JobSet",
                "metadata": {"name": "two", "namespace": xmem.namespace,
                             "labels": {labels.OPT_IN: "true"}},
                "spec": {"replicatedJobs": [_replicated(n, need)
                                            for n, (need, _) in PROGRAMS.items()]}}
        created = client.CustomObjectsApi(cluster.api).create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", xmem.namespace, "jobsets", body)
        assert created["spec"]["suspend"] is True

        def pods(role: str) -> List[Dict[str, Any]]:
            found = xmem.pods(f"{JOBSET_NAME_LABEL}=two,{REPLICATED_JOB_LABEL}={role}")
            return sorted(found, key=lambda p: p["metadata"]["creationTimestamp"])

        def fitting(role: str) -> Optional[Dict[str, Any]]:
            """The role's pod whose step fits, once it runs (big's: the retry)."""
            return next((p for p in pods(role) if (p.get("status") or {}).get("phase") ==
                         "Running" and (role == "small" or labels.OOM_RETRY in
                                        p["metadata"]["annotations"])), None)

        # Estimated (two estimation pods), released; each program's fitting pod peaks once.
        running = {role: wait_for(lambda role=role: fitting(role), 420,
                                  f"the {role} program's pod to run", interval=0.5)
                   for role in PROGRAMS}
        spike_at = len(exporter.served) + 2
        for role, pod in running.items():
            series.add(xmem.namespace, pod["metadata"]["name"], "hami", PROGRAMS[role][1],
                       spike_at)
        wait_for(lambda: len(exporter.served) > spike_at + 1, 30, "the spikes to be scraped")
        done = wait_for(lambda: (lambda obj: obj if obj and (_true(obj, "Completed") or
                                                              _true(obj, "Failed")) else None)(
            cluster.get(JOBSET_API, "JobSet", "two", xmem.namespace)), 180,
            "the JobSet to end", interval=1.0)
        assert _true(done, "Completed"), done.get("status")
        uid = done["metadata"]["uid"]

        gmes = xmem.gmes()
        assert len(gmes) == 2, [g["metadata"]["name"] for g in gmes]
        [big] = [g for g in gmes if _mine(g["status"].get("oomRetries"), uid)]
        [small] = [g for g in gmes if g is not big]
        # Only the program that ran out was retried; the grant went by its Job's uid.
        [entry] = _mine(big["status"]["oomRetries"], uid)
        [big_job] = [j for j in cluster.list("batch/v1", "Job", xmem.namespace)
                     if j["metadata"]["labels"].get(REPLICATED_JOB_LABEL) == "big"]
        assert entry["workload"] == {"kind": "JobSet", "name": "two", "uid": uid}
        assert entry["podOwners"] == [big_job["metadata"]["uid"]]
        first, retry = pods("big")
        assert entry["failedRequestBytes"] == _request(first) < _request(retry) == \
            entry["requestBytes"]
        assert [_request(p) for p in pods("small")] == [_request(first)]
        assert not small["status"].get("oomRetries")
        assert "ran out of GPU memory" in {e["reason"]: e["message"]
                                           for e in xmem.events("two")}["OutOfGPUMemory"]
        # Each program's peak on its own estimate.
        for gme, role in ((big, "big"), (small, "small")):
            def run(gme: Dict[str, Any] = gme) -> Optional[Dict[str, Any]]:
                fresh = cluster.get("xmem.io/v1alpha1", "GPUMemoryEstimate",
                                    gme["metadata"]["name"], xmem.namespace) or {}
                found = _mine((fresh.get("status") or {}).get("runs"), uid)
                return found[0] if found else None
            ran = wait_for(run, 60, f"the {role} program's run on its estimate")
            assert ran["observedPeakBytes"] == PROGRAMS[role][1], (role, ran)
            assert ran["completed"] is True and ran["source"] == "HAMi"
            assert ran["workload"]["kind"] == "JobSet"
            assert ran["estimateBytes"] == int(
                running[role]["metadata"]["annotations"][labels.ESTIMATE_BYTES])
        cluster.delete(JOBSET_API, "JobSet", "two", xmem.namespace)
    finally:
        stop(prometheus)
        exporter.shutdown()
