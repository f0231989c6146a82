"""Estimation pods run the tenants' code on the cluster's CPUs: the policy caps how many run at
once (per namespace, and in the cluster); the others wait their turn and nothing is lost."""

from __future__ import annotations

from typing import List

from tests.controller.support import TINY_GPT, Harness, policy_spec, training_job
from xmem_admission.cluster.controller import estimation_pods


def _running(harness: Harness) -> int:
    return sum(1 for pod in harness.estimation_pods() if estimation_pods.running(pod))


def test_estimation_pods_beyond_the_namespace_cap_wait_their_turn(harness: Harness):
    harness.use(policy_spec(estimation={"maxConcurrentPerNamespace": 1}))
    at_creation: List[int] = []

    def observe(method: str, path: str, code: int) -> None:
        if method == "POST" and path == f"/api/v1/namespaces/{harness.namespace}/pods" and code == 201:
            at_creation.append(_running(harness))

    harness.proxy.on_request(observe)
    harness.controller()
    # Two programs (the second checkpoints its layers), so neither rides in the other's pod.
    for name, extra in (("first", []), ("second", ["--grad-ckpt"])):
        harness.submit(training_job(name, args=[*TINY_GPT, *extra]))
    for name in ("first", "second"):
        harness.wait_released(name, 180)
    assert len(at_creation) == 2  # both were estimated, one after the other
    assert max(at_creation) == 1, at_creation  # never two at once
