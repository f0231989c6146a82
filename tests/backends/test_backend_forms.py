"""Each backend's own form, unit and edge cases, on the Pod CREATE of a released workload.

The pod carries ``xmem.io/request-bytes`` (as the controller writes it into the held workload's
template) so each case controls the exact request; the webhook is driven over HTTPS and every
patched pod is validated against the Kubernetes 1.30-1.35 schemas.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

from tests.support.builders import PodBuilder, make_pod, review
from tests.support.harness import HttpsWebhook, make_policy
from tests.support.schemas import validate_object
from xmem_admission.cluster import labels
from xmem_admission.contract import gpus

MiB, GiB = 1 << 20, 1 << 30


def released_pod(request_bytes: int, gpu: str = "A100-80GB", count: int = 1) -> PodBuilder:
    builder = make_pod("train-abcde").owned_by("Job", "train").opt_in().gpus(count)
    builder.template_annotation(labels.REQUEST_BYTES, str(request_bytes))
    builder.template_annotation(labels.ESTIMATE_BYTES, str(request_bytes))
    builder.template_annotation(labels.GPU_MODEL, gpu)
    return builder


def mutate(served: HttpsWebhook, backend: str, pod: Dict[str, Any], gpu: str = "A100-80GB") -> Any:
    served.use(make_policy(backend, (gpu,)))
    answer = served.send(review(pod))
    assert answer.allowed, answer.status
    patched = answer.patched()
    validate_object(patched)
    assert served.send(review(patched)).ops == []
    return answer, patched


def limits(pod: Dict[str, Any], index: int = 0) -> Dict[str, str]:
    return pod["spec"]["containers"][index]["resources"]["limits"]


def test_hami_writes_whole_mib_per_vgpu_and_keeps_the_vgpu_count(served: HttpsWebhook) -> None:
    answer, pod = mutate(served, "HAMi", released_pod(10 * GiB + 1, count=2).obj())
    assert limits(pod) == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "2",
                           "nvidia.com/gpumem": "10241"}
    assert any("nvidia.com/gpumem 10241 MiB" in w for w in answer.warnings)


def test_hami_keeps_requests_equal_to_limits_when_the_gpu_is_also_requested(served: HttpsWebhook) -> None:
    pod = released_pod(8 * GiB).limit("nvidia.com/gpu", "1", request=True).obj()
    _, patched = mutate(served, "HAMi", pod)
    assert patched["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert limits(patched)["nvidia.com/gpumem"] == "8192"


def test_volcano_replaces_the_gpu_by_vgpu_number_and_memory_everywhere(served: HttpsWebhook) -> None:
    pod = released_pod(6 * GiB, count=2).limit("nvidia.com/gpu", "2", request=True).obj()
    _, patched = mutate(served, "Volcano", pod)
    resources = patched["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in resources["limits"] and "nvidia.com/gpu" not in resources["requests"]
    assert resources["limits"]["volcano.sh/vgpu-number"] == "2"
    assert resources["limits"]["volcano.sh/vgpu-memory"] == "6144"


def test_gpushare_asks_whole_gib_and_spreads_several_gpus_with_the_count_label(served: HttpsWebhook) -> None:
    _, one = mutate(served, "GPUShare", released_pod(12 * GiB + 300 * MiB).obj())
    assert limits(one)["aliyun.com/gpu-mem"] == "13" and "nvidia.com/gpu" not in limits(one)
    _, two = mutate(served, "GPUShare", released_pod(12 * GiB, count=2).obj())
    assert limits(two)["aliyun.com/gpu-mem"] == "24"
    assert two["metadata"]["labels"]["aliyun.com/gpu-count"] == "2"


def test_kai_annotates_the_pod_and_names_the_container_when_it_is_not_the_first(
    served: HttpsWebhook,
) -> None:
    builder = released_pod(5 * GiB)
    pod = builder.obj()
    pod["spec"]["containers"].insert(0, {"name": "proxy", "image": "envoy:1.30"})
    _, patched = mutate(served, "KAI", pod)
    annotations = patched["metadata"]["annotations"]
    assert annotations["gpu-memory"] == "5120"
    assert annotations["gpu-fraction-container-name"] == "train"
    assert "nvidia.com/gpu" not in limits(patched, 1)


def test_kai_leaves_multi_gpu_containers_with_whole_gpus_and_says_so(served: HttpsWebhook) -> None:
    answer, patched = mutate(served, "KAI", released_pod(5 * GiB, count=2).obj())
    assert limits(patched)["nvidia.com/gpu"] == "2" and "gpu-memory" not in patched["metadata"]["annotations"]
    assert any("KAI gpu-memory share covers one GPU" in w for w in answer.warnings)


def test_mig_mixed_picks_the_smallest_slice_whose_real_memory_holds_the_request(
    served: HttpsWebhook,
) -> None:
    a100 = gpus.lookup("A100-80GB")
    one_g_10 = next(p for p in a100.mig_profiles if p.name == "1g.10gb")
    _, fits = mutate(served, "MIGMixed", released_pod(one_g_10.memory_bytes).obj())
    assert limits(fits)["nvidia.com/mig-1g.10gb"] == "1"
    # one byte more than the slice really has (its name says 10 GB, it holds 9.49 GiB): 1g.20gb
    _, bigger = mutate(served, "MIGMixed", released_pod(one_g_10.memory_bytes + 1, count=3).obj())
    assert limits(bigger)["nvidia.com/mig-1g.20gb"] == "3" and "nvidia.com/gpu" not in limits(bigger)


def test_mig_mixed_keeps_whole_gpus_when_no_slice_holds_the_request(served: HttpsWebhook) -> None:
    answer, patched = mutate(served, "MIGMixed", released_pod(79 * GiB + 500 * MiB).obj())
    assert limits(patched)["nvidia.com/gpu"] == "1"
    assert any("no MIG slice of A100-80GB holds 79.5 GiB" in w for w in answer.warnings)


def test_mig_single_adds_the_slice_size_to_every_existing_node_selector_term(served: HttpsWebhook) -> None:
    pod = released_pod(20 * GiB).node_affinity("topology.kubernetes.io/zone", ["eu-1a"]).obj()
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms["nodeSelectorTerms"].append(
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]})
    _, patched = mutate(served, "MIGSingle", pod)
    got = patched["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    size = {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["20479"]}
    assert got["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In",
                               "values": ["eu-1a"]}, size]},
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}, size]},
    ]


# A sized pod's GPU container reports its log's tail on failure (FallbackToLogsOnError).
MESSAGE_POLICY = "/spec/containers/0/terminationMessagePolicy"


def test_the_annotation_backend_changes_nothing_but_the_annotations(served: HttpsWebhook) -> None:
    pod = released_pod(8 * GiB).obj()
    answer, patched = mutate(served, "Annotation", pod)
    assert [op["path"] for op in answer.ops] == [MESSAGE_POLICY]  # the log's tail
    patched["spec"]["containers"][0].pop("terminationMessagePolicy")
    assert patched == pod


@pytest.mark.parametrize(
    "backend, name, value",
    [
        ("HAMi", "nvidia.com/gpumem", "30000"),
        ("Volcano", "volcano.sh/vgpu-memory", "30000"),
        ("GPUShare", "aliyun.com/gpu-mem", "30"),
        ("MIGMixed", "nvidia.com/mig-3g.40gb", "1"),
    ],
)
def test_a_request_already_in_the_backend_form_is_never_overridden(
    served: HttpsWebhook, backend: str, name: str, value: str
) -> None:
    pod = released_pod(8 * GiB).limit(name, value).obj()
    _, patched = mutate(served, backend, pod)
    assert limits(patched)[name] == value


def test_a_kai_share_set_by_hand_is_kept(served: HttpsWebhook) -> None:
    pod = released_pod(8 * GiB).template_annotation("gpu-fraction", "0.5").obj()
    answer, patched = mutate(served, "KAI", pod)
    assert [op["path"] for op in answer.ops] == [MESSAGE_POLICY]
    assert "gpu-memory" not in patched["metadata"]["annotations"]


def test_hami_memory_percentage_set_by_hand_is_judged_against_the_estimate(served: HttpsWebhook) -> None:
    served.use(make_policy("HAMi", ("A100-80GB",), enforcement="Enforce"))
    pod = released_pod(30 * GiB).limit("nvidia.com/gpumem-percentage", "25").obj()
    answer = served.send(review(pod), endpoint="validate")
    assert not answer.allowed
    assert "nvidia.com/gpumem-percentage: 25 (19.8 GiB per GPU)" in answer.status["message"]
