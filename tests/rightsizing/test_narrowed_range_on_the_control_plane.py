"""Where jobs land in their range, learned in the cluster, narrows a NEW job's request at CREATE,
on the real control plane.

Three earlier convolution jobs finished on the A100-80GB, and the controller recorded their
runs on their GPUMemoryEstimates (written here as ``controller.observed_peaks`` writes them:
the run entry, its observed peak from HAMi, the estimate and range it was sized from). Their
peaks landed 10, 20 and 30 % of the way from their estimate to its high end. The controller
learns the position (``learnedOverhead.minJobs: 3``) and writes it on the policy's
``status.rangePositions`` (``kubectl get gap -o yaml``). A new Job whose estimate is already
recorded (its fingerprint's GME holds a 2 GiB range) is then sized by the webhook at CREATE: its
request covers 30 % of its range, not all of it, and kubectl's warning says why; the controller's
summary on the GME shows the same request.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any, Dict, List, Optional

import yaml

from localkube.controlplane import wait_for
from tests.e2e_real.support import IMAGE, job, policy
from tests.helm.chart import tool
from tests.support.estimates import record_dict
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import observed_peaks, records
from xmem_admission.cluster.kube.client import GME, Kube
from xmem_admission.cluster.observations import ObservedPeak, Source
from xmem_admission.cluster.policy.model import Policy
from xmem_admission.cluster.policy.sizing import size_request
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract import gpus

MiB, GiB = 1 << 20, 1 << 30
GPU = "A100-80GB"
EARLIER = 8 * GiB  # the earlier jobs' estimate, with a 1000 MiB range
LANDED = (100, 200, 300)  # MiB above it: 10, 20 and 30 % of the range
NEW, NEW_RANGE = 4 * GiB, 2 * GiB  # the new job's estimate and range


def _kubectl(xmem: Any, *args: str, stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run([tool("kubectl"), "--kubeconfig",
                           str(xmem.cluster.plane.admin_kubeconfig), *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


def _record(fingerprint: str, total: int, high: int) -> EstimateRecord:
    raw = record_dict(fingerprint, {GPU: total / GiB})
    raw["gpus"][0]["high_bytes"] = high
    return EstimateRecord.from_dict(raw)


def _recorded(kube: Kube, xmem: Any, workload: Dict[str, Any], fingerprint: str, total: int,
              high: int, runs: List[Dict[str, Any]]) -> None:
    """A succeeded GME for ``fingerprint`` with a ranged estimate on the GPU and ``runs``."""
    created = kube.create(GME, xmem.namespace, records.new(workload, fingerprint, [GPU], IMAGE))
    status = records.from_record(_record(fingerprint, total, high), xmem.namespace)["status"]
    status["estimates"][0]["lowBytes"] = total  # the range's low end: here the point
    if runs:
        status["runs"] = runs
    kube.replace_status(GME, dict(created, status=status))


def _dry_run(xmem: Any, body: Dict[str, Any]) -> Dict[str, Any]:
    """The Job as the webhook admits it, created with --dry-run=server (nothing is stored)."""
    done = _kubectl(xmem, "create", "--dry-run=server", "-o", "json", "-f", "-",
                    stdin=json.dumps(body))
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def _request(obj: Dict[str, Any]) -> Optional[int]:
    value = (obj["spec"]["template"]["metadata"].get("annotations") or {}).get(
        labels.REQUEST_BYTES)
    return None if value is None else int(value)


def test_positions_learned_from_finished_runs_narrow_a_new_jobs_request_at_create(xmem):
    cluster = xmem.cluster
    # The memory outside the allocator is pinned at the records' own 300 MiB
    # (tests/support/estimates.record_dict): the runs below also teach an outside-allocator
    # figure once the controller has read them, at a moment the test does not choose, and the
    # webhook's request and the controller's summary would then be taken on either side of it.
    # Pinned, both apply no correction whenever they size, and only the range narrows.
    body = policy(xmem.policy_name, gpus=(GPU,), granularity="1Mi",
                  learnedOverhead={"minJobs": 3, "maxCorrection": "2Gi",
                                   "pinned": [{"gpu": GPU, "outsideAllocator": "300Mi"}]})
    cluster.apply(body)
    settings = Policy.from_object(body).for_namespace(xmem.namespace)
    capacity = gpus.lookup(GPU).capacity_bytes
    xmem.serve()
    xmem.controller(f"controller-{xmem.namespace}", "--no-leader-election")
    kube = Kube(cluster.api, backoff=0.05)

    # The new Job's fingerprint, as the webhook computes it (a server-side dry run holds it).
    new = job("new", xmem.namespace)
    fingerprint = _dry_run(xmem, new)["metadata"]["annotations"][labels.FINGERPRINT]

    # 1. Three earlier jobs finished; their runs landed 10-30 % of the way up their range.
    for index, above in enumerate(LANDED):
        name, uid = f"earlier-{index}", f"00000000-0000-4000-8000-00000000000{index}"
        workload = {"apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": name, "uid": uid, "namespace": xmem.namespace}}
        run = observed_peaks.run_entry(
            workload, "Job", True, GPU, EARLIER, None, 1,
            ObservedPeak(EARLIER + above * MiB, Source.HAMI, 1), f"2026-12-06T20:0{index}:00Z")
        _recorded(kube, xmem, workload, f"{index:x}" * 32, EARLIER, EARLIER + 1000 * MiB, [run])

    def positions() -> Optional[List[Dict[str, Any]]]:
        found = cluster.get("xmem.io/v1alpha1", "GPUAdmissionPolicy", xmem.policy_name)
        return ((found or {}).get("status") or {}).get("rangePositions") or None

    assert wait_for(positions, 30, "the learned range positions on the policy") == [
        {"gpu": GPU, "positionPercent": 30, "jobs": 3, "namespaces": 1, "above": 0}]
    shown = _kubectl(xmem, "get", "gap", xmem.policy_name, "-o", "yaml")
    assert shown.returncode == 0, shown.stderr
    status = yaml.safe_load(shown.stdout)["status"]
    print(yaml.safe_dump({"status": status}, sort_keys=False))
    assert status["rangePositions"][0]["positionPercent"] == 30
    listed = _kubectl(xmem, "get", "gap", xmem.policy_name).stdout
    print(listed)
    assert "A100-80GB range 30% (3 jobs)" in listed.splitlines()[1]

    # 2. The new Job's estimate is recorded (a 2 GiB range): the webhook sizes it at CREATE
    #    with 30 % of that range, not all of it.
    _recorded(kube, xmem, new, fingerprint, NEW, NEW + NEW_RANGE, [])
    narrowed_high = NEW + -(-30 * NEW_RANGE // 100)
    narrowed = size_request(NEW, settings, capacity, narrowed_high)
    whole = size_request(NEW, settings, capacity, NEW + NEW_RANGE)
    assert (narrowed, whole) == (4916 * MiB, 6349 * MiB)  # 4096 * 1.05 + 614.4, + 2048
    wait_for(lambda: _request(_dry_run(xmem, new)) == narrowed, 30,
             "the webhook to hold the estimate and the positions")
    created = _kubectl(xmem, "create", "-f", "-", stdin=json.dumps(new))
    assert created.returncode == 0, created.stderr
    print(created.stderr)
    assert _request(xmem.job("new")) == narrowed
    assert "Warning: xmem: jobs with a range on A100-80GB landed at most 30% of the way to its " \
           "high end (3 job(s) in 1 namespace(s)): the request covers 4.6 GiB of the range's " \
           "6.0 GiB" in created.stderr

    # 3. The GME's summary, written by the controller, gives the same request.
    gme = wait_for(lambda: (lambda g: g if (g.get("status") or {}).get("requestBytes") else None)(
        cluster.get("xmem.io/v1alpha1", "GPUMemoryEstimate", records.name_for(fingerprint),
                    xmem.namespace)), 30, "the controller's summary on the new Job's estimate")
    assert gme["status"]["requestBytes"] == narrowed
    listed = _kubectl(xmem, "get", "gme", "-n", xmem.namespace, "-o", "wide",
                      records.name_for(fingerprint)).stdout
    print(listed)
    header, line = listed.splitlines()[:2]
    assert header.split()[7:9] == ["REQUEST", "RANGE"] and line.split()[7:9] == ["4.8Gi", "4.0-6.0Gi"]
