"""Property tests: the mutation is pure and idempotent, whatever the workload looks like.

For generated workloads (three kinds, one to four GPUs, seven backends, sidecars, requests set by
hand, estimates present or not, pinned GPU models, policies with any margin or overcommit):
- reviewing the object never changes the dict that was sent (the mutation is pure);
- the patch applies cleanly (jsonpatch library) and the result validates as Kubernetes 1.35 does;
- reviewing the patched object again gives an empty patch (reinvocation is a no-op).
"""

from __future__ import annotations

import copy
from typing import Any, Dict

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.builders import make_job, make_pod, make_pytorchjob, review
from tests.support.estimates import record_for
from tests.support.harness import LocalWebhook, make_policy
from tests.support.schemas import validate_object
from xmem_admission.cluster import labels

BACKENDS = ("Annotation", "HAMi", "Volcano", "GPUShare", "KAI", "MIGMixed", "MIGSingle")
GPU_SETS = (("A100-80GB", "H100-80GB"), ("H100-80GB",), ("A100-40GB", "A30"), ("H200",))
HAND_SET = {
    "HAMi": ("nvidia.com/gpumem", "8000"),
    "Volcano": ("volcano.sh/vgpu-memory", "9000"),
    "GPUShare": ("aliyun.com/gpu-mem", "10"),
    "MIGMixed": ("nvidia.com/mig-3g.40gb", "1"),
}


@st.composite
def cases(draw: Any) -> Dict[str, Any]:
    backend = draw(st.sampled_from(BACKENDS))
    gpu_set = draw(st.sampled_from(GPU_SETS))
    kind = draw(st.sampled_from(("Job", "PyTorchJob", "Pod", "OwnedPod")))
    gpus = draw(st.integers(1, 4))
    builder: Any = {
        "Job": lambda: make_job("j"),
        "PyTorchJob": lambda: make_pytorchjob("p").workers(draw(st.integers(1, 8))),
        "Pod": lambda: make_pod("bare"),
        "OwnedPod": lambda: make_pod("owned-x1").owned_by("Job", "j"),
    }[kind]()
    builder.opt_in().gpus(gpus).image(draw(st.sampled_from(("a:1", "b:2")))).env(
        "BATCH", str(draw(st.integers(1, 512))))
    if draw(st.booleans()):
        builder.sidecar("logger", gpus=draw(st.integers(0, 1)))
    if draw(st.booleans()) and backend in HAND_SET:
        builder.limit(*HAND_SET[backend])
    if draw(st.booleans()):
        builder.template_annotation(labels.GPU_MODEL, draw(st.sampled_from(gpu_set + ("T4",))))
    if draw(st.booleans()):
        builder.template_annotation(labels.REQUEST_BYTES, str(draw(st.integers(1, 80)) << 30))
    if kind == "Job" and draw(st.booleans()):
        builder.suspended()
    obj = builder.obj()
    spec = {
        "safetyMarginPercent": draw(st.sampled_from((0, 5, 13, 100))),
        "overcommitPercent": draw(st.sampled_from((0, 10, 50))),
        "granularity": draw(st.sampled_from(("1Mi", "256Mi", "1Gi", "3Gi"))),
        "minimumRequest": draw(st.sampled_from(("0", "1Gi", "20Gi"))),
        "enforcement": draw(st.sampled_from(("Warn", "Enforce"))),
    }
    totals = None
    if draw(st.booleans()):
        totals = {g: draw(st.floats(0.5, 200.0)) for g in gpu_set}
    return {"obj": obj, "backend": backend, "gpus": gpu_set, "spec": spec, "totals": totals,
            "dry_run": draw(st.booleans()), "scope": draw(st.sampled_from(("", "namespace")))}


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_reviewing_a_patched_workload_again_gives_an_empty_patch(case: Dict[str, Any]) -> None:
    webhook = LocalWebhook(make_policy(case["backend"], case["gpus"], **case["spec"]))
    obj = case["obj"]
    if case["totals"] is not None:
        webhook.record(record_for(obj, case["totals"], case["gpus"]))
    sent = copy.deepcopy(obj)
    first = webhook.send(review(obj, dry_run=case["dry_run"]), scope=case["scope"])
    assert obj == sent, "the mutation changed its input"
    event("denied" if not first.allowed else ("patched" if first.ops else "unchanged"))
    if not first.allowed:
        assert first.status["code"] == 403 and first.ops == []
        return
    assert all(len(w) < 120 for w in first.warnings)
    patched = first.patched()
    validate_object_latest(patched)
    second = webhook.send(review(patched), scope=case["scope"])
    assert second.allowed
    assert second.ops == [], second.ops


def validate_object_latest(obj: Dict[str, Any]) -> None:
    if obj["kind"] == "PyTorchJob":
        validate_object(obj)
    else:
        from tests.support.schemas import validate_builtin

        validate_builtin(obj, versions=("1.35",))
