"""What the request becomes for each backend, on pods the real Job controller creates and the
real scheduler places on kwok GPU nodes; and bin-packing, the point of the product: jobs sized by
their estimates share GPU nodes that whole-GPU requests would each take alone."""

from __future__ import annotations

import json
from typing import Any, Callable, Dict

from kubernetes import client

from localkube.controlplane import wait_for
from localkube.kwok import gpu_node
from tests.e2e_real.support import code_map, job, policy, template_annotations
from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.quantity import GiB, MiB, ceil_div

Check = Callable[[Dict[str, Any], int], bool]


def _limits(spec: Dict[str, Any]) -> Dict[str, str]:
    return spec["containers"][0]["resources"].get("limits") or {}


def _affinity_gt(spec: Dict[str, Any]) -> str:
    terms = (((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    for term in terms:
        for expression in term.get("matchExpressions") or []:
            if expression["key"] == "nvidia.com/gpu.memory" and expression["operator"] == "Gt":
                return str(expression["values"][0])
    return ""


# backend -> does this pod (metadata + spec) carry the request in the backend's form?
FORMS: Dict[str, Check] = {
    "HAMi": lambda pod, req: _limits(pod["spec"]).get("nvidia.com/gpumem") == str(ceil_div(req, MiB)),
    "Volcano": lambda pod, req: _limits(pod["spec"]).get("volcano.sh/vgpu-memory") == str(
        ceil_div(req, MiB)) and _limits(pod["spec"]).get("volcano.sh/vgpu-number") == "1"
        and "nvidia.com/gpu" not in _limits(pod["spec"]),
    "GPUShare": lambda pod, req: _limits(pod["spec"]).get("aliyun.com/gpu-mem") == str(
        ceil_div(req, GiB)),
    "KAI": lambda pod, req: (pod["metadata"].get("annotations") or {}).get("gpu-memory") == str(
        ceil_div(req, MiB)) and "nvidia.com/gpu" not in _limits(pod["spec"]),
    "MIGMixed": lambda pod, req: _limits(pod["spec"]).get("nvidia.com/mig-1g.10gb") == "1"
        and "nvidia.com/gpu" not in _limits(pod["spec"]),
    "MIGSingle": lambda pod, req: _affinity_gt(pod["spec"]) == str(ceil_div(req, MiB) - 1),
}


def _create(cluster: Any, obj: Dict[str, Any], dry_run: bool = False) -> Dict[str, Any]:
    batch = client.BatchV1Api(cluster.api)
    kwargs = {"dry_run": "All"} if dry_run else {}
    return json.loads(batch.create_namespaced_job(obj["metadata"]["namespace"], obj,
                                                  _preload_content=False, **kwargs).data)


def test_each_backend_gives_the_jobs_pod_its_form_of_the_request_and_it_is_scheduled(xmem):
    """One estimation (HAMi), then the policy's backend changes and each new Job with the same
    training is sized at CREATE in that backend's form; the pod the Job controller creates
    carries it, and the scheduler places it on a GPU node advertising those resources."""
    cluster = xmem.cluster
    cluster.apply(gpu_node("backends-0", labels={"pool": "backends"}, mig={"1g.10gb": 7}))
    selector = {"pool": "backends"}
    xmem.serve()
    xmem.controller("", "--no-leader-election")
    _create(cluster, job("estimated", xmem.namespace, node_selector=selector))
    request = int(template_annotations(xmem.wait_released("estimated"))[labels.REQUEST_BYTES])

    for backend, form in FORMS.items():
        name = f"job-{backend.lower()}"
        cluster.apply(policy(xmem.policy_name, backend=backend))

        def sized_in_form(name=name, form=form):
            template = _create(cluster, job(name, xmem.namespace, node_selector=selector),
                               dry_run=True)["spec"]["template"]
            return form(template, request)

        wait_for(sized_in_form, 60, f"the webhook to size Jobs for {backend}", interval=0.5)
        created = _create(cluster, job(name, xmem.namespace, node_selector=selector))
        assert not created["spec"].get("suspend"), backend

        def scheduled_pod(name=name):
            pods = xmem.pods(f"job-name={name}")
            return pods[0] if pods and pods[0]["spec"].get("nodeName") else None

        pod = wait_for(scheduled_pod, 60, f"the {backend} pod to be scheduled")
        assert form(pod, request), (backend, pod["spec"], pod["metadata"].get("annotations"))
        assert pod["spec"]["nodeName"] == "backends-0"
        assert pod["metadata"]["annotations"][labels.REQUEST_BYTES] == str(request)


JOBS = 6


def test_six_jobs_sized_by_estimate_share_one_gpu_node_where_whole_gpus_need_six(xmem):
    """Six single-GPU training Jobs on A100-80GB nodes (HAMi: each GPU split ten ways,
    nvidia.com/gpumem in MiB), placed by the real kube-scheduler with its bin-packing profile.

    Whole-GPU requests (nvidia.com/gpumem = the whole card): 6 GPU nodes.
    Requests sized by xmem's estimate: 1 GPU node.
    """
    cluster = xmem.cluster
    for pool in ("whole", "packed"):
        for i in range(JOBS):
            cluster.apply(gpu_node(f"{pool}-{i}", labels={"pool": pool}))
    whole_mib = cluster.get("v1", "Node", "whole-0")["metadata"]["labels"]["nvidia.com/gpu.memory"]
    plain = f"{xmem.namespace}-whole"
    cluster.ensure_namespace(plain)  # not opted in: the requests stay as written
    cluster.apply(code_map(plain))
    try:
        for i in range(JOBS):
            _create(cluster, job(f"whole-{i}", plain, opt_in=False, node_selector={"pool": "whole"},
                                 gpu_resources={"nvidia.com/gpumem": whole_mib}))
        xmem.serve()
        xmem.controller("", "--no-leader-election")
        for i in range(JOBS):
            held = _create(cluster, job(f"packed-{i}", xmem.namespace,
                                        node_selector={"pool": "packed"}))
            assert held["spec"]["suspend"] is True

        def nodes_of(namespace, prefix):
            pods = [p for p in cluster.list("v1", "Pod", namespace)
                    if p["metadata"].get("labels", {}).get("job-name", "").startswith(prefix)]
            placed = [p["spec"].get("nodeName") for p in pods]
            return placed if len(placed) == JOBS and all(placed) else None

        whole_nodes = set(wait_for(lambda: nodes_of(plain, "whole-"), 120,
                                   "the whole-GPU pods to be scheduled"))
        packed_nodes = set(wait_for(lambda: nodes_of(xmem.namespace, "packed-"), 240,
                                    "the estimated pods to be scheduled"))
        request = int(template_annotations(xmem.job("packed-0"))[labels.REQUEST_BYTES])
        print(f"{JOBS} jobs: whole-GPU requests on {len(whole_nodes)} GPU nodes, "
              f"requests of {ceil_div(request, MiB)} MiB on {len(packed_nodes)}")
        assert len(whole_nodes) == JOBS
        assert len(packed_nodes) == 1
        assert len(xmem.gmes()) == 1  # one estimation for six Jobs of the same training
    finally:
        cluster.delete("v1", "Namespace", plain)
        for pool in ("whole", "packed"):
            for i in range(JOBS):
                cluster.delete("v1", "Node", f"{pool}-{i}")
