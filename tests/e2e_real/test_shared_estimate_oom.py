"""An estimate shared over an option that was judged memory-neutral, and a job sized from it that
runs out of GPU memory anyway: the safety net (``controller.trials``), on the real control plane.

Four Jobs run tests/e2e_real/scripts/oom_job.py on the GPU process node, one program whose
literal variable ``HOLD_SECONDS`` differs (an option of the trial family: ``$HOLD_SECONDS``).
What the step needs on the GPU comes from a pod label the probe cannot see, as a real program's
data-dependent memory would. ``hold-0`` and ``hold-1`` are both traced (they differ in
``$HOLD_SECONDS`` alone, so their traces teach it) and allocate identically: the option is judged
neutral. ``hold-2`` is then sized from an estimate of theirs, without an estimation pod, and runs
out of GPU memory at that size: it is retried bigger as any Job is, and its estimate records that
``$HOLD_SECONDS`` is not neutral after all. ``hold-3`` is therefore traced, not shared.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from localkube.controlplane import wait_for
from tests.e2e_real.support import oom_job, policy
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import trials
from xmem_admission.cluster.kube.quantity import GiB

GPU = "A100-80GB"
SMALL = int(0.3 * GiB)  # fits the first request (the policy's 1 GiB minimum)
LARGE = int(1.2 * GiB)  # does not: the weights fit, the activations do not (one retry)


def _condition(obj: Dict[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def _estimate(xmem: Any, name: str) -> Dict[str, Any]:
    job = xmem.wait_released(name, timeout=240)
    estimate = job["metadata"]["annotations"]["xmem.io/estimate-name"]
    found = xmem.cluster.get("xmem.io/v1alpha1", "GPUMemoryEstimate", estimate, xmem.namespace)
    assert found is not None, estimate
    return dict(found)


def test_a_shared_estimate_that_runs_out_is_retried_and_its_option_is_no_longer_neutral(
        xmem, gpu_process_node) -> None:
    cluster = xmem.cluster
    cluster.apply(policy(xmem.policy_name, targets=[{"gpu": GPU, "backend": "HAMi"}],
                         oomRetry={"maxRequest": "12Gi"}))
    xmem.serve()
    xmem.controller(f"controller-{xmem.namespace}", "--no-leader-election")

    def submit(name: str, hold: int, need: int) -> None:
        cluster.apply(oom_job(name, xmem.namespace, GPU, need, "HAMi", hold_seconds=hold))

    submit("hold-0", 0, SMALL)
    submit("hold-1", 1, SMALL)
    first, second = _estimate(xmem, "hold-0"), _estimate(xmem, "hold-1")
    for traced in (first, second):
        assert "sharedFrom" not in traced["status"] and traced["status"]["podName"]
    assert first["spec"]["trial"]["family"] == second["spec"]["trial"]["family"]
    assert first["status"]["allocationDigest"] == second["status"]["allocationDigest"]

    submit("hold-2", 2, LARGE)
    shared = _estimate(xmem, "hold-2")
    assert shared["status"]["sharedFrom"]["options"] == ["$HOLD_SECONDS"]
    assert "podName" not in shared["status"]  # no estimation pod
    said = [e["message"] for e in xmem.events("hold-2") if e["reason"] == trials.SHARED_EVENT]
    assert said and "differs only in $HOLD_SECONDS" in said[0]

    def ended(name: str) -> Optional[Dict[str, Any]]:
        obj = xmem.job(name)
        return obj if _condition(obj, "Complete") or _condition(obj, "Failed") else None

    done = wait_for(lambda: ended("hold-2"), 240, "hold-2 to end")
    assert _condition(done, "Complete"), done["status"]  # the retry, bigger, completed
    pods = sorted(xmem.pods("job-name=hold-2"), key=lambda p: p["metadata"]["creationTimestamp"])
    assert len(pods) == 2
    assert int(pods[1]["metadata"]["annotations"][labels.REQUEST_BYTES]) > \
        int(pods[0]["metadata"]["annotations"][labels.REQUEST_BYTES])
    refuted = cluster.get("xmem.io/v1alpha1", "GPUMemoryEstimate", shared["metadata"]["name"],
                          xmem.namespace)
    assert refuted is not None and refuted["status"]["sharedFrom"]["refuted"]
    warned = [e["message"] for e in xmem.events("hold-2")
              if e["reason"] == trials.SHARED_EVENT and e["type"] == "Warning"]
    assert warned and "$HOLD_SECONDS no longer judged memory-neutral" in warned[0]

    submit("hold-3", 3, SMALL)
    again = _estimate(xmem, "hold-3")
    assert "sharedFrom" not in again["status"] and again["status"]["podName"]
    assert trials.SHARED_EVENT not in {e["reason"] for e in xmem.events("hold-3")}
