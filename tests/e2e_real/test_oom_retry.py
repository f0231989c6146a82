"""A Job that runs out of GPU memory is retried bigger, on the real control
plane: the real Job controller makes the pods, the real scheduler binds them to a process node
that advertises GPUs, the pod's container (tests/e2e_real/scripts/oom_job.py) prints PyTorch's
traceback for ``torch.OutOfMemoryError`` on stderr and exits 1, the node copies the log's tail
into the termination message as the kubelet does for FallbackToLogsOnError (which the webhook
gave the pod; nothing in the test writes a message), the controller records the OOM on the
GPUMemoryEstimate with an Event, and the Job controller's replacement pod is sized bigger at
Pod CREATE: HAMi's gpumem, KAI's gpu-memory, MIG's next profile up; with restartPolicy
OnFailure the controller deletes the pod that would restart in place. A Job that needs more
than the policy's cap ends with the reason.

Four Jobs share one training container (one estimation): what each needs and which GPU it is
pinned to (so which backend sizes it) come from its pod labels and template annotations.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import httpx

from localkube.controlplane import wait_for
from tests.e2e_real.support import oom_job, policy
from tests.e2e_real.test_what_a_real_api_server_found import _metrics_port
from tests.support.harness import metric_sum
from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.quantity import GiB, MiB
from xmem_admission.contract import gpus

CAP = 12 * GiB
# name: (pinned GPU, its backend, what the step needs on the GPU)
JOBS = {
    # The first pod's request (the estimate of a small model, about the policy's 1 GiB minimum)
    # holds the weights (half) but not the activations: the message's figures are the need.
    "hami": ("A100-80GB", "HAMi", int(1.2 * GiB)),
    "kai": ("H100-80GB", "KAI", int(1.2 * GiB)),
    # More than the A100-40GB's smallest slice (1g.5gb, 4.74 GiB) holds, so the first pod fails
    # on its slice: the retry moves to the next profile up.
    "mig": ("A100-40GB", "MIGMixed", 6 * GiB),
    # Needs more than the policy's cap (oomRetry.maxRequest 12Gi): one retry, then the reason.
    "never-fits": ("A100-80GB", "HAMi", 20 * GiB),
    # restartPolicy OnFailure: the controller deletes the pod, so that the next one is admitted.
    "on-failure": ("A100-80GB", "HAMi", int(1.2 * GiB)),
}


def _condition(obj: Dict[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def _pods(xmem: Any, name: str) -> List[Dict[str, Any]]:
    pods = xmem.pods(f"job-name={name}")
    return sorted(pods, key=lambda p: p["metadata"]["creationTimestamp"])


def _request(pod: Dict[str, Any]) -> int:
    return int(pod["metadata"]["annotations"][labels.REQUEST_BYTES])


def _limits(pod: Dict[str, Any]) -> Dict[str, str]:
    return pod["spec"]["containers"][0]["resources"].get("limits") or {}


def _form(backend: str, pod: Dict[str, Any]) -> str:
    """The pod's request as its backend wrote it."""
    if backend == "HAMi":
        return _limits(pod)["nvidia.com/gpumem"]
    if backend == "KAI":
        return pod["metadata"]["annotations"]["gpu-memory"]
    return ",".join(k for k in _limits(pod) if k.startswith("nvidia.com/mig-"))


def _entry(xmem: Any, uid: str) -> Optional[Dict[str, Any]]:
    for gme in xmem.gmes():
        for entry in (gme.get("status") or {}).get("oomRetries") or []:
            if entry["workload"]["uid"] == uid:
                return dict(entry)
    return None


def _ended_with_the_reason(xmem: Any, done: Dict[str, Any], second: Dict[str, Any]) -> None:
    """The Job that needs more than the cap: retried once (capped), then the terminal reason
    on the GME and an Event; the Job ends by its backoffLimit."""
    assert _condition(done, "Failed")
    uid, name = done["metadata"]["uid"], done["metadata"]["name"]
    last = wait_for(lambda: (lambda found: found if found and found.get("gaveUp") else None)(
        _entry(xmem, uid)), 60, "the terminal reason")
    assert last["ooms"] == 2 and last["failedRequestBytes"] == _request(second) <= CAP
    assert "more than the most a retry may ask for" in last["gaveUp"]
    gave_up = wait_for(lambda: [e["message"] for e in xmem.events(name)
                                if e["reason"] == "OutOfGPUMemoryGaveUp"], 30, "the Event")
    assert last["gaveUp"] in gave_up[0]


def _replaced_by_a_bigger_pod(xmem: Any, done: Dict[str, Any]) -> None:
    """restartPolicy OnFailure: the pod that ran out (its container restarting in place, at
    the same size) is deleted by the controller; the Job controller's new pod is bigger."""
    assert _condition(done, "Complete"), done["status"]
    entry = _entry(xmem, done["metadata"]["uid"])
    assert entry is not None and entry["ooms"] == 1
    [survivor] = [p for p in _pods(xmem, done["metadata"]["name"])
                  if p["metadata"]["name"] != entry["pod"]]
    assert wait_for(lambda: xmem.cluster.get("v1", "Pod", entry["pod"], xmem.namespace) is None,
                    60, "the OOMed pod to be gone")
    assert survivor["status"]["phase"] == "Succeeded"
    assert entry["failedRequestBytes"] < _request(survivor) == entry["requestBytes"]
    assert int(_form("HAMi", survivor)) * MiB >= _request(survivor)


def test_a_job_out_of_gpu_memory_is_retried_bigger_in_each_backend_until_the_cap(
        xmem, gpu_process_node):
    cluster = xmem.cluster
    cluster.apply(policy(xmem.policy_name, targets=[
        {"gpu": "A100-80GB", "backend": "HAMi"}, {"gpu": "H100-80GB", "backend": "KAI"},
        {"gpu": "A100-40GB", "backend": "MIGMixed"}], oomRetry={"maxRequest": "12Gi"}))
    xmem.serve()
    name = f"controller-{xmem.namespace}"
    xmem.controller(name, "--no-leader-election")
    for job_name, (gpu, backend, need) in JOBS.items():
        enforcer = "mig" if backend.startswith("MIG") else backend
        if job_name == "on-failure":  # container restarts count towards backoffLimit too
            body = oom_job(job_name, xmem.namespace, gpu, need, enforcer, "OnFailure", 4)
        else:
            body = oom_job(job_name, xmem.namespace, gpu, need, enforcer)
        cluster.apply(body)

    def ended(job_name: str) -> Optional[Dict[str, Any]]:
        obj = xmem.job(job_name)
        return obj if _condition(obj, "Complete") or _condition(obj, "Failed") else None

    for job_name, (_gpu, backend, _need) in JOBS.items():
        done = wait_for(lambda job_name=job_name: ended(job_name), 240, f"job {job_name} to end")
        if job_name == "on-failure":
            _replaced_by_a_bigger_pod(xmem, done)
            continue
        first, second = _pods(xmem, job_name)
        message = first["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
        assert "torch.OutOfMemoryError: CUDA out of memory." in message, message
        assert first["spec"]["containers"][0]["terminationMessagePolicy"] == \
            "FallbackToLogsOnError"
        assert _request(second) > _request(first), job_name
        assert second["metadata"]["annotations"][labels.OOM_RETRY] == "1"
        events = {e["reason"]: e["message"] for e in xmem.events(job_name)}
        if job_name == "never-fits":
            _ended_with_the_reason(xmem, done, second)
            continue
        assert _condition(done, "Complete"), (job_name, done["status"])
        assert second["status"]["phase"] == "Succeeded"
        entry = _entry(xmem, done["metadata"]["uid"])
        assert entry is not None and entry["failedRequestBytes"] == _request(first)
        assert entry["ooms"] == 1 and entry["requestBytes"] == _request(second)
        assert _form(backend, second) != _form(backend, first)
        assert "ran out of GPU memory" in events["OutOfGPUMemory"]
        if backend == "HAMi":
            assert int(_form(backend, second)) * MiB >= _request(second)
        if backend == "MIGMixed":
            a100 = gpus.lookup("A100-40GB")
            before = gpus.smallest_mig_profile(a100, _request(first))
            after = gpus.smallest_mig_profile(a100, _request(second))
            assert before is not None and after is not None
            assert _form(backend, first) == f"nvidia.com/mig-{before.name}"
            assert _form(backend, second) == f"nvidia.com/mig-{after.name}"
            assert after.memory_bytes > before.memory_bytes
            assert entry["migProfile"] == after.name
    port = _metrics_port(xmem, name)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert metric_sum(text, "xmem_controller_oom_underestimates_caught_total") == 6
    assert metric_sum(text, "xmem_controller_oom_retries_total") == 5
    assert metric_sum(text, "xmem_controller_oom_gave_up_total") == 1
    # OOMs avoided on the second try: the four Jobs that completed after a bigger retry (the
    # controller counts each when it sees the Job end); never-fits failed.
    wait_for(lambda: metric_sum(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text,
                                "xmem_controller_oom_avoided_total") == 4, 60, "OOMs avoided")
    outcomes = {e["workload"]["name"]: e.get("outcome")
                for gme in xmem.gmes() for e in gme["status"].get("oomRetries") or []}
    assert outcomes == {"hami": "Completed", "kai": "Completed", "mig": "Completed",
                        "on-failure": "Completed", "never-fits": "Failed"}
    avoided = [e for e in xmem.events("hami") if e["reason"] == "OutOfGPUMemoryAvoided"]
    assert avoided and "completed after 1 CUDA out-of-memory failure(s)" in avoided[0]["message"]
