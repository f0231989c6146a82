"""The ``DRA`` backend: a released workload's Pod asks for a DRA claim, and the template the
controller creates says what the claim asks, for each driver's convention.

The Pod CREATE goes through the webhook over HTTPS (as tests/backends/test_backend_forms.py); a
patched pod is validated against the Kubernetes 1.34 and 1.35 schemas (``resource.k8s.io/v1``
is GA from 1.34; earlier schemas spell ``resourceClaims`` differently).
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

from tests.backends import test_backend_forms as forms
from tests.support.builders import make_pod, review
from tests.support.estimates import record_for
from tests.support.harness import HttpsWebhook, make_policy
from tests.support.schemas import validate_builtin
from xmem_admission.cluster.backends import dra
from xmem_admission.cluster.policy.model import Dra, DraDriver, Policy
from xmem_admission.contract import gpus
from xmem_admission.contract.errors import PolicyError

MiB, GiB = 1 << 20, 1 << 30
DRA_VERSIONS = ("1.34", "1.35")
JOB = {"apiVersion": "batch/v1", "kind": "Job",
       "metadata": {"name": "train", "uid": "8f4d3c2e-1111-4222-8333-444455556666"}}


def released_pod(request_bytes: int, count: int = 1) -> Any:
    return forms.released_pod(request_bytes, gpu="H200", count=count)


def mutate(served: HttpsWebhook, pod: Dict[str, Any], gpu: str = "H200", **dra_spec: Any) -> Any:
    served.use(make_policy("DRA", (gpu,), dra=dra_spec))
    answer = served.send(review(pod))
    assert answer.allowed, answer.status
    patched = answer.patched()
    validate_builtin(patched, versions=DRA_VERSIONS)
    assert served.send(review(patched)).ops == []
    return answer, patched


def test_a_released_pod_references_its_workloads_template_instead_of_a_whole_gpu(
    served: HttpsWebhook,
) -> None:
    answer, pod = mutate(served, released_pod(18 * GiB).obj())
    assert pod["spec"]["resourceClaims"] == [
        {"name": "xmem-gpu", "resourceClaimTemplateName": "train-xmem-18432mi"}]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["claims"] == [{"name": "xmem-gpu"}]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert any("DRA claim gpu.nvidia.com: memory 18432Mi" in w for w in answer.warnings)


def test_several_gpus_become_one_claim_counting_them(served: HttpsWebhook) -> None:
    _, pod = mutate(served, released_pod(10 * GiB + 1, count=2).obj())
    assert pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == \
        "train-xmem-10241mi-x2"


def test_a_users_own_claim_is_left_and_the_warning_says_so(served: HttpsWebhook) -> None:
    builder = released_pod(8 * GiB)
    pod = builder.obj()
    pod["spec"]["resourceClaims"] = [{"name": "mine", "resourceClaimTemplateName": "big-gpu"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "mine"}]
    answer, patched = mutate(served, pod)
    assert patched["spec"]["resourceClaims"] == [
        {"name": "mine", "resourceClaimTemplateName": "big-gpu"}]
    assert any("claim mine (left as written" in w for w in answer.warnings)


def test_a_users_own_claim_is_pointed_at_the_sized_template_when_policy_replaces(
    served: HttpsWebhook,
) -> None:
    pod = released_pod(8 * GiB).obj()
    pod["spec"]["resourceClaims"] = [{"name": "mine", "resourceClaimTemplateName": "big-gpu"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "mine"}]
    answer, patched = mutate(served, pod, existingClaim="Replace")
    assert patched["spec"]["resourceClaims"] == [
        {"name": "mine", "resourceClaimTemplateName": "train-xmem-8192mi"}]
    assert patched["spec"]["containers"][0]["resources"]["claims"] == [{"name": "mine"}]
    assert any("claim mine now sized by xmem" in w for w in answer.warnings)


def test_a_pod_no_workload_owns_keeps_its_gpu_with_a_warning(served: HttpsWebhook) -> None:
    pod = make_pod("lonely").opt_in().gpus(1).obj()
    served.use(make_policy("DRA", ("H200",)))
    served.record(record_for(pod, {"H200": 8.0}, ("H200",)))
    answer = served.send(review(pod))
    patched = answer.patched() if answer.ops else pod
    assert "resourceClaims" not in patched["spec"]
    assert any("no workload to own" in w for w in answer.warnings), answer.warnings


def test_a_pod_whose_workload_could_get_no_device_keeps_its_gpu(served: HttpsWebhook) -> None:
    builder = released_pod(18 * GiB)
    builder.template_annotation(dra.UNSATISFIABLE, "DeviceClass gpu.nvidia.com does not exist")
    served.use(make_policy("DRA", ("H200",)))
    answer = served.send(review(builder.obj()))
    patched = answer.patched() if answer.ops else builder.obj()
    assert "resourceClaims" not in patched["spec"]
    assert patched["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert any("no claim written (DeviceClass gpu.nvidia.com does not exist)" in w
               for w in answer.warnings), answer.warnings


@pytest.mark.parametrize("driver, klass, requests", [
    ("Nvidia", "gpu.nvidia.com", {"memory": str(18 * GiB)}),
    ("HAMi", "hami-core-gpu.project-hami.io", {"memory": str(18 * GiB), "cores": "30"}),
    # HAMi's devices default cores to all 100: a claim asking none would take the whole GPU
    ("HAMi-no-cores", "hami-core-gpu.project-hami.io", {"memory": str(18 * GiB), "cores": "0"}),
])
def test_the_template_asks_memory_in_bytes_of_the_drivers_class_on_the_estimated_model(
    driver: str, klass: str, requests: Dict[str, str],
) -> None:
    extra = {"cores": 30} if driver == "HAMi" else {}
    driver = driver.replace("-no-cores", "")
    target = make_policy("DRA", ("H200",), dra={"driver": driver, **extra}).defaults.targets[0]
    assert target.dra is not None
    body = dra.claim_template("team-a", JOB, 18 * GiB, 1, target.gpu, target.dra)
    assert body["metadata"]["name"] == "train-xmem-18432mi"
    assert body["metadata"]["ownerReferences"][0]["uid"] == JOB["metadata"]["uid"]
    exactly = body["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["deviceClassName"] == klass
    assert exactly["capacity"]["requests"] == requests
    domain = dra.DOMAINS[DraDriver(driver)]
    assert exactly["selectors"] == [{"cel": {"expression":
                                     f'device.attributes["{domain}"].productName == "NVIDIA H200"'}}]


def test_a_mig_claim_picks_the_smallest_slice_that_holds_the_request_by_its_memory() -> None:
    a100 = gpus.lookup("A100-80GB")
    body = dra.claim_template("team-a", JOB, 15 * GiB, 1, a100,
                              Dra(driver=DraDriver.NVIDIA_MIG, device_class="mig.nvidia.com",
                                  pin_product=False))
    exactly = body["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert "capacity" not in exactly  # a MIG device is not shared: the claim takes it whole
    low, high = (s["cel"]["expression"] for s in exactly["selectors"])
    one_g_20 = next(p for p in a100.mig_profiles if p.name == "1g.20gb")
    three_g_40 = next(p for p in a100.mig_profiles if p.name == "3g.40gb")
    assert low == f'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("{15 * GiB}")) >= 0'
    middle = (one_g_20.memory_bytes + three_g_40.memory_bytes) // 2
    assert high.endswith(f'compareTo(quantity("{middle}")) < 0')
    assert one_g_20.memory_bytes >= 15 * GiB  # 1g.20gb is the slice these bounds let through


@pytest.mark.parametrize("request_bytes, policy, values, expected", [
    (18 * GiB + 1, {"min": MiB, "step": MiB, "max": 143_771 * MiB}, (), 18 * GiB + MiB),
    (512, {"min": MiB, "step": MiB, "max": 143_771 * MiB}, (), MiB),
    (150_000 * MiB, {"min": MiB, "step": MiB, "max": 143_771 * MiB}, (), None),
    (5 * GiB, None, (4 * GiB, 8 * GiB, 16 * GiB), 8 * GiB),
    (5 * GiB, {"min": 0, "step": 4 * GiB}, (), 8 * GiB),
])
def test_a_request_is_rounded_up_as_the_device_request_policy_allows(
    request_bytes: int, policy: Any, values: Any, expected: Any,
) -> None:
    assert dra.round_up(request_bytes, policy, values) == expected


def test_a_long_workload_name_still_makes_a_valid_distinct_template_name() -> None:
    one, two = (dra.template_name(c * 250, 8 * GiB) for c in "ab")
    assert len(one) <= 253 and one != two and dra.request_of(one) == 8 * GiB
    several = dra.template_name("train", 10 * GiB, 4)
    assert (dra.request_of(several), dra.count_of(several)) == (10 * GiB, 4)
    assert dra.count_of(one) == 1


@pytest.mark.parametrize("spec, field", [
    ({"driver": "amd"}, "spec.dra.driver"),
    ({"cores": 30}, "spec.dra.cores"),
    ({"driver": "HAMi", "cores": 130}, "spec.dra.cores"),
    ({"existingClaim": "Grow"}, "spec.dra.existingClaim"),
    ({"deviceClass": ""}, "spec.dra.deviceClass"),
])
def test_bad_dra_settings_are_refused_with_their_field(spec: Dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        make_policy("DRA", ("H200",), dra=spec)


def test_the_mig_form_needs_a_gpu_with_mig() -> None:
    with pytest.raises(PolicyError, match=r"spec\.targets\[0\]\.backend.*no MIG"):
        Policy.from_spec({"targets": [{"gpu": "L4", "backend": "DRA"}],
                          "dra": {"driver": "NvidiaMIG"}})
