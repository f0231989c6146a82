"""The webhooks' matchConditions, evaluated with a real CEL implementation (the C++ one Google
publishes as cel-expr-python; the API server runs the Go one, same language): workloads that ask
for no GPU are skipped before the API server calls us, and no workload the webhook would act on
is ever skipped, whatever form its GPU request takes (every backend's, before and after the
webhook rewrote it)."""

from __future__ import annotations

import copy
import itertools
from typing import Any, Dict, List

import pytest

from tests.helm.chart import VALUE_SETS, find, render
from tests.support.builders import make_job, make_jobset, make_pod, make_pytorchjob
from tests.support.builders import templates_of as _templates
from xmem_admission.cluster import integrations
from xmem_admission.cluster.integrations.base import gpu_templates

cel = pytest.importorskip(
    "cel_expr_python.cel",
    reason="cel-expr-python (test extra, Python >= 3.11) is not installed: `make venv`",
)


def _expressions(values: Dict[str, Any]) -> List[str]:
    out = []
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for config in find(render(values), kind):
            for hook in config["webhooks"]:
                out.extend(c["expression"] for c in hook.get("matchConditions", []))
    return out


@pytest.fixture(scope="module")
def condition():
    expressions = _expressions({})
    assert len(expressions) == 4, "one matchCondition per webhook entry"
    assert len(set(expressions)) == 1, "every entry skips the same workloads"
    # The API server's environment declares object, oldObject, request, authorizer; compiling
    # with `object` alone proves the expression needs nothing else.
    env = cel.NewEnv(variables={"object": cel.Type.DYN})
    program = env.compile(expressions[0])

    def evaluate(obj: Dict[str, Any]) -> bool:
        value = program.eval(data={"object": obj}).value()
        assert isinstance(value, bool), f"matchCondition gave {value!r}, not a bool"
        return value

    return evaluate


def _webhook_sees_gpu(obj: Dict[str, Any]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    integration = integrations.for_kind(group, version, obj["kind"])
    return integration is not None and bool(gpu_templates(integration, obj))


def _kai_pod(name: str) -> Dict[str, Any]:
    return make_pod(name).opt_in().template_annotation("gpu-memory", "20480").obj()


CASES = {
    "Job asking for a whole GPU": (make_job("a").opt_in().gpus(1).obj(), True),
    "Job asking for none": (make_job("b").opt_in().obj(), False),
    "Job asking in requests only": (make_job("c").limit("nvidia.com/gpu", "1", request=True).obj(), True),
    "Job with a GPU sidecar only": (make_job("d").sidecar(gpus=1).obj(), True),
    "Pod under HAMi": (make_pod("e").gpus(1).limit("nvidia.com/gpumem", "20480").obj(), True),
    "Pod under MIG mixed": (make_pod("f").gpus(1, resource="nvidia.com/mig-3g.40gb").obj(), True),
    "Pod under Volcano vGPU": (make_pod("g").gpus(1, resource="volcano.sh/vgpu-number")
                               .limit("volcano.sh/vgpu-memory", "20480").obj(), True),
    "Pod under gpushare": (make_pod("h").limit("aliyun.com/gpu-mem", "20").obj(), True),
    "Pod under KAI (annotation, no resource)": (_kai_pod("i"), True),
    "Pod asking for none": (make_pod("j").obj(), False),
    "PyTorchJob with GPU workers": (make_pytorchjob("k").workers(2).gpus(1).obj(), True),
    "PyTorchJob on CPUs": (make_pytorchjob("l").workers(2).obj(), False),
    "JobSet with GPU replicated Jobs": (make_jobset("m").gpus(1).obj(), True),
    "JobSet on CPUs": (make_jobset("n").obj(), False),
}


def test_a_trainjob_is_always_sent_since_its_templates_are_its_runtimes(condition) -> None:
    """Its runtime may ask for the GPUs, which no expression over the TrainJob can see."""
    trainjob = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                "metadata": {"name": "llm"},
                "spec": {"runtimeRef": {"name": "torch-distributed"}}}
    assert condition(trainjob) is True


@pytest.mark.parametrize("case", sorted(CASES))
def test_match_condition_calls_the_webhook_only_for_gpu_workloads(condition, case: str) -> None:
    obj, uses_gpu = CASES[case]
    assert condition(obj) is uses_gpu
    assert _webhook_sees_gpu(obj) is uses_gpu, "the case itself is mislabelled"


def test_objects_without_pod_templates_are_skipped(condition) -> None:
    assert condition({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"},
                      "data": {}}) is False
    job = make_job("no-template").obj()
    del job["spec"]["template"]
    assert condition(job) is False
    pytorchjob = make_pytorchjob("no-replica-template").workers(1).obj()
    for replica in pytorchjob["spec"]["pytorchReplicaSpecs"].values():
        del replica["template"]
    assert condition(pytorchjob) is False


def test_no_workload_the_webhook_acts_on_is_ever_skipped(condition) -> None:
    """Every combination of GPU forms over Jobs, Pods and PyTorchJobs: when the webhook's own
    code finds a GPU template, the condition lets the call through (skipping it would admit the
    workload without its estimate). The converse may not hold (nvidia.com/gpu: 0 costs a call)."""
    forms = [None, ("nvidia.com/gpu", "1"), ("nvidia.com/gpu", "0"),
             ("nvidia.com/mig-1g.10gb", "2"), ("volcano.sh/vgpu-number", "1"),
             ("aliyun.com/gpu-mem", "8"), ("nvidia.com/gpumem", "1024")]
    annotations = [None, {"gpu-fraction": "0.5"}]
    builders = [lambda: make_job("j"), lambda: make_pod("p"), lambda: make_pytorchjob("t").workers(1),
                lambda: make_jobset("s")]
    checked = 0
    for build, main, side, note in itertools.product(builders, forms, forms, annotations):
        builder = build()
        if main:
            builder = builder.limit(*main)
        if side:
            builder = builder.sidecar()
        obj = copy.deepcopy(builder.obj())
        if side:
            for template in _templates(obj):
                template["spec"]["containers"][-1].setdefault("resources", {}).setdefault(
                    "limits", {})[side[0]] = side[1]
        if note:
            for template in _templates(obj):
                template.setdefault("metadata", {}).setdefault("annotations", {}).update(note)
        if _webhook_sees_gpu(obj):
            assert condition(obj), f"skipped a GPU workload: {obj}"
        checked += 1
    assert checked == 4 * 7 * 7 * 2



def test_match_conditions_can_be_turned_off() -> None:
    assert _expressions(VALUE_SETS["minimal"]) == []
