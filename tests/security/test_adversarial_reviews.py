"""10,000 adversarial AdmissionReviews against the real server over TLS, the policy enforcing.

Each review is a valid Job, PyTorchJob or Pod (sent by a tenant, the Job controller or the xmem
controller, created or updated) with one to four attacks applied: quantities and counts out of
any range or in other scripts' digits, forged ``xmem.io/`` annotations and owners, GPUs hidden
in init and ephemeral containers, parts replaced by values of the wrong type, names and label
values of tens of kilobytes, thousands of variables, deep nesting. Whatever arrives, the server
must answer HTTP 200
with a well-formed review, never fail open (an opted-in object it cannot read is refused where
the policy enforces), never hit an internal error, and spend under 100 ms of CPU on any one
review (the server's own histogram of each review's CPU time; a review of at most 256 KiB,
nearly every one here, is answered on the event loop).
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import random
from typing import Any, Dict, List, Tuple

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.builders import make_job, make_pod, make_pytorchjob, review
from tests.support.builders import templates_of as _templates
from tests.support.harness import Certificates, ServeProcess, metric_sum
from xmem_admission.cluster.admission.trust import DEFAULT_CONTROLLER_USER, JOB_CONTROLLER

EXAMPLES = int(os.environ.get("XMEM_FUZZ_EXAMPLES", "10000"))  # reviews; CI: the default
BATCH = 5  # reviews per hypothesis example: the engine's own cost per example is the larger
LOOP_BUDGET_SECONDS = 0.1

QUANTITIES = [
    "1e8000000", "1e999999999", "-1e999999999", "9" * 64, "9" * 65, "1" + "0" * 4400, "\u00b2",
    "\u0661\u0662", "\uff11", "1 ", " 1", "", "0x10", "NaN", "Infinity", "1e-31", "0e999999999",
    "0.1e99999999", "7Ei", "8Ei", "1.5", "-1", "+1", "1Ki" * 20, "1e", ".", "1..2", "1e+5E5",
    10**30, -(10**30), 1.5e308, -1, 0, True, None, [], {}, [1], {"a": 1}, 2**63, 2**64,
]
LONG = ["x" * 60_000, "a-" * 20_000, "\u00e9" * 20_000]
XMEM_KEYS = ["xmem.io/request-bytes", "xmem.io/estimate-bytes", "xmem.io/gpu-model",
             "xmem.io/held-reason", "xmem.io/held-since", "xmem.io/user-suspended",
             "xmem.io/fingerprint"]
POD_ANNOTATIONS = ["gpu-memory", "gpu-fraction", "gpu-fraction-num-devices",
                   "gpu-fraction-container-name"]
GPU_RESOURCES = ["nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage",
                 "nvidia.com/mig-3g.40gb", "volcano.sh/vgpu-number", "volcano.sh/vgpu-memory",
                 "aliyun.com/gpu-mem"]
JUNK = [None, True, 1, -1, 2**70, 1.5, "x", "", [], {}, [None], {"": None}, [[[[[]]]]]]
USERS = ["alice", JOB_CONTROLLER, DEFAULT_CONTROLLER_USER, "", "system:serviceaccount:x:y"]

# What an attack draws from. One hypothesis draw per review (a seed) drives a plain
# random.Random: 10,000 reviews in seconds of generation, each reproducible from its seed.
VALUES = QUANTITIES + LONG + JUNK
TEXTS = [v for v in QUANTITIES + LONG if isinstance(v, str)]
CHOICES = {
    "gpu": GPU_RESOURCES, "xmem": XMEM_KEYS, "pod-annotation": POD_ANNOTATIONS, "long": LONG,
    "junk": JUNK, "env-name": JUNK + ["HOSTNAME", "X"], "env-count": [300, 3000],
    "owner-kind": ["ConfigMap", "Job", "PyTorchJob", "X" * 5000], "owner-name": ["owner"] + LONG,
    "depth": [100, 600], "kind": ["Job", "Pod", "OwnedPod", "PyTorchJob"], "gpus": [1, 2, 4],
    "operation": ["CREATE", "UPDATE"], "user": USERS, "endpoint": ["mutate", "validate"],
    "scope": ["", "/object", "/namespace"], "value": VALUES, "text": TEXTS}
ATTACK_NAMES = ("resource", "request", "xmem-annotation", "workload-annotation", "kai-annotation",
                "gpu-count-label", "long-name", "long-label", "owner", "init-gpu",
                "ephemeral-gpu", "env", "many-env", "junk-container", "junk-spec",
                "junk-metadata", "junk-template-metadata", "deep", "suspend", "deleting")


class Chooser:
    """Picks from ``CHOICES`` with a seeded generator; lists and dicts come back fresh (a
    shared one could end up inside itself)."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def __call__(self, what: str) -> Any:
        picked = self.random.choice(CHOICES[what])
        return copy.deepcopy(picked) if isinstance(picked, (list, dict)) else picked

    def attacks(self) -> List[str]:
        return self.random.sample(ATTACK_NAMES, self.random.randint(1, 4))


BASES = {"Job": make_job("j").opt_in(), "Pod": make_pod("p").opt_in(),
         "OwnedPod": make_pod("p").owned_by("Job", "j").opt_in(),
         "PyTorchJob": make_pytorchjob("t").opt_in()}
BASE_JSON = {(kind, gpus): orjson.dumps(builder.gpus(gpus).obj())
             for kind, builder in BASES.items() for gpus in (1, 2, 4)}
MANY_ENV = {n: [{"name": f"E{i}", "value": "v"} for i in range(n)] for n in (300, 3000)}


def _container(obj: Dict[str, Any]) -> Dict[str, Any]:
    return _templates(obj)[0]["spec"]["containers"][0]


def _meta(obj: Dict[str, Any], which: str) -> Dict[str, Any]:
    return _templates(obj)[0].setdefault("metadata", {}).setdefault(which, {})


def _deep(depth: int) -> Any:
    node: Any = "leaf"
    for _ in range(depth):
        node = [node]
    return node


DEEP = {depth: _deep(depth) for depth in CHOICES["depth"]}  # never mutated: shared


def attack(name: str, obj: Dict[str, Any], draw: Chooser) -> None:
    """Apply one attack to a workload, in place."""
    if name in ("resource", "request"):
        section = "limits" if name == "resource" else "requests"
        _container(obj)["resources"].setdefault(section, {})[draw("gpu")] = draw("value")
    elif name == "xmem-annotation":
        _meta(obj, "annotations")[draw("xmem")] = draw("text")
    elif name == "workload-annotation":
        obj["metadata"].setdefault("annotations", {})[draw("xmem")] = draw("text")
    elif name == "kai-annotation":
        _meta(obj, "annotations")[draw("pod-annotation")] = draw("text")
    elif name == "gpu-count-label":
        _meta(obj, "labels")["aliyun.com/gpu-count"] = draw("text")
    elif name == "long-name":
        obj["metadata"]["name"] = draw("long")
    elif name == "long-label":
        obj["metadata"].setdefault("labels", {})[draw("long")] = "v"
    elif name == "owner":
        obj["metadata"]["ownerReferences"] = [{
            "apiVersion": "v1", "kind": draw("owner-kind"), "name": draw("owner-name"),
            "uid": "u", "controller": True}]
    elif name == "init-gpu":
        _templates(obj)[0]["spec"]["initContainers"] = [dict(
            _container(obj), name="init", resources={"limits": {"nvidia.com/gpu": draw("value")}})]
    elif name == "ephemeral-gpu":
        _templates(obj)[0]["spec"]["ephemeralContainers"] = [
            {"name": "debug", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    elif name == "env":
        _container(obj)["env"] = [{"name": draw("env-name"), "value": draw("value")},
                                  {"name": "Y", "valueFrom": {"x": draw("value")}}]
    elif name == "many-env":
        _container(obj)["env"] = MANY_ENV[draw("env-count")]
    elif name == "junk-container":
        _templates(obj)[0]["spec"]["containers"].append(draw("junk"))
    elif name == "junk-spec":
        _templates(obj)[0]["spec"] = draw("junk")
    elif name == "junk-metadata":
        obj["metadata"] = draw("junk")
    elif name == "junk-template-metadata":
        _templates(obj)[0]["metadata"] = draw("junk")
    elif name == "deep":
        obj["spec"]["extra"] = DEEP[draw.random.choice(CHOICES["depth"])]
    elif name == "suspend":
        obj["spec"]["suspend"] = draw("junk")
    elif name == "deleting":
        obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"


def _encode(document: Dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(document)
    except TypeError:  # an integer beyond 64 bits: valid JSON, as a hostile client may send
        return json.dumps(document).encode()


def adversarial(seed: int) -> Tuple[bytes, str]:
    """One adversarial review (body, path), from its seed."""
    choose = Chooser(seed)
    kind = choose("kind")
    base = BASE_JSON[(kind, choose("gpus"))]
    obj = orjson.loads(base)
    for name in choose.attacks():
        try:
            attack(name, obj, choose)
        except (TypeError, KeyError, AttributeError, IndexError):
            pass  # an earlier attack already broke the part this one aims at: fine
    operation = choose("operation")
    document = review(obj, operation=operation,
                      old=orjson.loads(base) if operation == "UPDATE" else None,
                      kind="Pod" if kind == "OwnedPod" else kind, user=choose("user"))
    return _encode(document), f"/{choose('endpoint')}{choose('scope')}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """``xmem serve`` in its own process (as in a pod), enforcing, with a keep-alive client."""
    root = tmp_path_factory.mktemp("fuzz")
    certs = Certificates(root)
    policy = {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
              "metadata": {"name": "default"},
              "spec": {"targets": [{"gpu": g, "backend": "HAMi"} for g in ("A100-80GB",
                                                                         "H100-80GB")],
                       "enforcement": "Enforce"}}
    (root / "policy.yaml").write_text(json.dumps(policy))
    served = ServeProcess(root, certs, "--policy", str(root / "policy.yaml"))
    connection = http.client.HTTPSConnection("localhost", served.port,
                                             context=certs.client_context(), timeout=30)
    try:
        yield served, connection
    finally:
        connection.close()
        served.close()


@settings(max_examples=-(-EXAMPLES // BATCH), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.integers(0, 2**63 - 1), min_size=BATCH, max_size=BATCH))
def test_no_adversarial_review_gets_an_http_error_fails_open_or_stalls_the_loop(server, seeds):
    _served, connection = server
    for seed in seeds:
        _send(connection, *adversarial(seed))


def _send(connection: http.client.HTTPSConnection, body: bytes, path: str) -> None:
    connection.request("POST", path, body, {"Content-Type": "application/json"})
    reply = connection.getresponse()
    data = reply.read()
    if reply.getheader("Connection", "").lower() == "close":
        connection.close()
    assert reply.status == 200, (reply.status, data[:300])
    answer = orjson.loads(data)["response"]
    assert isinstance(answer["allowed"], bool) and isinstance(answer["uid"], str)
    if not answer["allowed"]:
        assert 400 <= answer["status"]["code"] < 500 and answer["status"]["message"]
    for warning in answer.get("warnings", []):
        assert "fails open" not in warning and "internal error" not in warning, warning
        assert len(warning) <= 256


def test_the_fuzzed_server_never_failed_open_never_erred_and_never_stalled(server):
    """Runs after the fuzz (file order): what the server itself counted over all of it, the CPU
    time of each review among it (its own thread's: other work on the machine does not count)."""
    served, _ = server
    text = served.metrics()
    assert metric_sum(text, "xmem_admission_requests_total") >= EXAMPLES
    assert metric_sum(text, "xmem_admission_requests_total", decision="failed-open") == 0
    assert metric_sum(text, "xmem_policy_errors_total", reason="internal") == 0
    reviews = metric_sum(text, "xmem_admission_cpu_seconds_count")
    within = metric_sum(text, "xmem_admission_cpu_seconds_bucket", le=str(LOOP_BUDGET_SECONDS))
    assert reviews >= EXAMPLES and within == reviews, (within, reviews)
    assert served.process.poll() is None
