"""Every attack a tenant with an ordinary namespace-scoped role tried, tried again:
each must fail. Two tenants, alice in team-a and bob in team-b, both namespaces enforcing; xmem
runs as the chart installs it (see tenants.py).
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict

import pytest
from kubernetes.client.exceptions import ApiException

from localkube.controlplane import wait_for
from tests.security.tenants import GPUS, job, restricted
from tests.support.builders import make_pod
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.policy import fingerprint


def _refused(call: Any) -> ApiException:
    """The API server's refusal of a call, with its Status message as ``message``."""
    with pytest.raises(ApiException) as caught:
        call()
    error = caught.value
    error.message = json.loads(error.body)["message"]
    return error


def _held(obj: Dict[str, Any]) -> bool:
    annotations = obj["metadata"].get("annotations") or {}
    return obj["spec"].get("suspend") is True and labels.HELD_REASON in annotations


def _template_annotations(obj: Dict[str, Any]) -> Dict[str, str]:
    return obj["spec"]["template"]["metadata"].get("annotations") or {}


def test_a_tenant_cannot_touch_another_tenants_namespace(tenants):
    alice = tenants.tenants["alice"]
    error = _refused(lambda: alice.create_job(job("intruder", "team-b"), namespace="team-b"))
    assert error.status == 403 and 'User "alice" cannot create resource "jobs"' in error.message


@pytest.mark.parametrize("forged_gib", [1.0, 500.0], ids=["tiny", "huge"])
def test_an_estimate_forged_by_team_as_code_never_sizes_or_denies_team_bs_job(tenants, forged_gib):
    """alice copies bob's Job (same image, command, args, env: same fingerprint) into team-a,
    where her own code writes the estimation result. It sizes her namespace's workloads (that
    is her word about her own code) and never bob's: his Job is held and estimated for itself."""
    alice, bob = tenants.tenants["alice"], tenants.tenants["bob"]
    name = f"copy-{int(forged_gib)}"
    alice.create_job(job(name, "team-a", forged_gib))
    gme = wait_for(lambda: next((g for g in tenants.gmes("team-a") if g["spec"]["workload"]["name"]
                                 == name and (g.get("status") or {}).get("phase") == "Succeeded"),
                                None), 120, "alice's forged estimate to be recorded")
    assert gme["status"]["estimates"][0]["totalBytes"] == int(forged_gib * (1 << 30))

    def sized_or_denied_in_team_a() -> Any:
        # dryRun: no side effects, so it can be asked until the webhook's store has the record
        try:
            created = alice.create_job(job(f"{name}-again", "team-a", forged_gib), dry_run=True)
        except ApiException as exc:
            return exc if "fits no GPU" in json.loads(exc.body)["message"] else None
        return created if not created["spec"].get("suspend") else None

    wait_for(sized_or_denied_in_team_a, 30, "the webhook to use the record in team-a")
    victim = bob.create_job(job(f"victim-{int(forged_gib)}", "team-b", forged_gib))
    assert _held(victim), victim["metadata"]
    assert labels.REQUEST_BYTES not in _template_annotations(victim)


def test_a_pod_squatting_the_estimation_pods_name_is_never_adopted(tenants):
    """alice creates a pod with the estimation labels and a forged result, named as an
    estimation pod of her Job would be (``<workload>-xmem-<hash>``), before her Job: the
    controller's pod name holds the estimate's uid, which nobody knows before the controller
    creates the estimate, so it makes its own pod and never reads hers."""
    alice = tenants.tenants["alice"]
    squatted = job("squatted", "team-a", 2.0)
    code = tenants.get("v1", "ConfigMap", "code", "team-a")["metadata"]  # her own: she may read

    def versions(kind: str, name: str) -> Any:
        return (code["uid"], code["resourceVersion"]) if (kind, name) == ("ConfigMap", "code") \
            else None
    fp = fingerprint.of_templates([squatted["spec"]["template"]], GPUS, versions)
    gme_name = records.name_for(fp)
    guesses = [f"squatted-xmem-{n:08x}" for n in (0, 1)] + [f"{gme_name}-1"]
    for guess in guesses:
        squatter = make_pod(guess, "team-a").obj()
        squatter["metadata"]["labels"] = {records.FINGERPRINT_LABEL: fp,
                                          records.MANAGED_BY[0]: records.MANAGED_BY[1],
                                          records.COMPONENT[0]: records.COMPONENT[1]}
        squatter["spec"]["containers"][0].update(command=["python", "-c", "pass"], args=[],
                                                 resources={})
        alice.create_pod(restricted(squatter))
    alice.create_job(squatted)

    def own_pod() -> Any:
        pods = tenants.cluster.list("v1", "Pod", "team-a",
                                    f"{records.FINGERPRINT_LABEL}={fp}")
        return [p for p in pods if p["metadata"]["name"] not in guesses
                and any(o.get("kind") == "GPUMemoryEstimate"
                        for o in p["metadata"].get("ownerReferences") or [])] or None

    [pod] = wait_for(own_pod, 60, "the controller's own estimation pod")
    assert pod["metadata"]["name"].startswith("squatted-xmem-")
    [gme] = [g for g in tenants.gmes("team-a") if g["metadata"]["name"] == gme_name]
    assert (gme.get("status") or {}).get("reason") != "PodNameTaken"
    for guess in guesses:  # hers, untouched
        assert tenants.get("v1", "Pod", guess, "team-a")


def test_a_hand_set_request_bytes_of_one_byte_is_stripped_and_the_job_held(tenants):
    alice = tenants.tenants["alice"]
    sneaky = job("one-byte", "team-a", 3.0)
    sneaky["spec"]["template"]["metadata"]["annotations"] = {
        labels.REQUEST_BYTES: "1", labels.ESTIMATE_BYTES: "1"}
    created = alice.create_job(sneaky)
    assert _held(created)
    assert labels.REQUEST_BYTES not in _template_annotations(created)
    assert labels.ESTIMATE_BYTES not in _template_annotations(created)


def test_a_request_annotation_that_is_not_ascii_digits_is_refused_not_failed_open(tenants):
    alice = tenants.tenants["alice"]
    pod = restricted(make_pod("superscript", "team-a").gpus(1)
                     .template_annotation(labels.REQUEST_BYTES, "\u00b2").obj())
    error = _refused(lambda: alice.create_pod(pod))
    assert error.status == 403 and "no recorded GPU memory estimate" in error.message


def test_a_gpu_asked_for_only_by_an_init_container_is_held_like_any_other(tenants):
    alice = tenants.tenants["alice"]
    sneaky = job("init-gpu", "team-a", 4.0)
    spec = sneaky["spec"]["template"]["spec"]
    main = spec["containers"][0]
    init = dict(main, name="warmup")
    main["resources"] = {"limits": {"cpu": "1", "memory": "1Gi"}}
    spec["initContainers"] = [init]
    created = alice.create_job(sneaky)
    assert _held(created)


def test_an_owner_reference_to_the_tenants_own_configmap_does_not_exempt_a_bare_pod(tenants):
    alice = tenants.tenants["alice"]
    owner = alice.core.create_namespaced_config_map("team-a", {"metadata": {"name": "owner"}})
    pod = restricted(make_pod("orphan", "team-a").gpus(1).obj())
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap",
                                           "name": "owner", "uid": owner.metadata.uid,
                                           "controller": True}]
    error = _refused(lambda: alice.create_pod(pod))
    assert error.status == 403 and "no recorded GPU memory estimate for this bare Pod" in error.message


def test_a_preset_held_reason_still_suspends_the_job(tenants):
    alice = tenants.tenants["alice"]
    sneaky = job("pre-held", "team-a", 5.0)
    sneaky["metadata"]["annotations"] = {labels.HELD_REASON: "AwaitingEstimate"}
    sneaky["spec"]["suspend"] = False
    assert _held(alice.create_job(sneaky))


def test_a_forged_held_since_does_not_cut_the_hold_short(tenants):
    """A held-since far in the past would put the hold past maxHoldSeconds at once; the hold
    runs from the Job's creation instead, so it is estimated, not released unchanged."""
    alice = tenants.tenants["alice"]
    sneaky = job("old-hold", "team-a", 6.0)
    sneaky["metadata"]["annotations"] = {labels.HELD_SINCE: "2000-01-01T00:00:00Z"}
    alice.create_job(sneaky)
    wait_for(lambda: labels.HELD_REASON not in (tenants.job("old-hold", "team-a")["metadata"]
                                                .get("annotations") or {}), 120,
             "the controller to release the Job")
    released = tenants.job("old-hold", "team-a")
    assert int(_template_annotations(released)[labels.REQUEST_BYTES]) >= 6 << 30  # estimated


def test_a_tenant_cannot_unsuspend_a_held_job(tenants):
    alice = tenants.tenants["alice"]
    alice.create_job(job("impatient", "team-a", 7.0))
    error = _refused(lambda: alice.patch_job("impatient", {"spec": {"suspend": False}}))
    assert error.status == 403 and "only the xmem controller releases it" in error.message
    assert _held(tenants.job("impatient", "team-a"))


def test_a_tenant_cannot_write_sizing_annotations_into_a_held_jobs_template(tenants):
    alice = tenants.tenants["alice"]
    alice.create_job(job("rewritten", "team-a", 8.0))
    patch = {"spec": {"template": {"metadata": {"annotations": {labels.REQUEST_BYTES: "1"}}}}}
    error = _refused(lambda: alice.patch_job("rewritten", patch))
    assert error.status == 403 and "only the xmem controller changes this annotation" in error.message
    unheld = {"metadata": {"annotations": {labels.HELD_REASON: None}}}
    error = _refused(lambda: alice.patch_job("rewritten", unheld))
    assert error.status == 403


def test_a_tenant_may_still_label_a_held_job(tenants):
    alice = tenants.tenants["alice"]
    alice.create_job(job("labelled", "team-a", 9.0))
    patched = alice.patch_job("labelled", {"metadata": {"labels": {"owner": "alice"}}})
    assert patched["metadata"]["labels"]["owner"] == "alice" and _held(patched)


def test_a_gpu_count_label_with_a_huge_exponent_is_refused_at_once(tenants):
    """The label value 1e8000000 is valid; computing it blocked a replica for seconds."""
    alice = tenants.tenants["alice"]
    pod = restricted(make_pod("exponent", "team-a").limit("aliyun.com/gpu-mem", "8")
                     .label("aliyun.com/gpu-count", "1e8000000").obj())
    started = time.monotonic()
    error = _refused(lambda: alice.create_pod(pod))
    assert time.monotonic() - started < 5  # the API server's wait, webhook included
    assert error.status == 422 and "fails closed" in error.message and "too large" in error.message


def test_a_tenant_cannot_write_an_estimate(tenants):
    alice = tenants.tenants["alice"]
    forged = {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUMemoryEstimate",
              "metadata": {"name": "gme-" + "f" * 32},
              "spec": {"fingerprint": "f" * 32, "workload": {"kind": "Job", "name": "x"},
                       "gpus": list(GPUS)}}
    error = _refused(lambda: alice.custom.create_namespaced_custom_object(
        "xmem.io", "v1alpha1", "team-a", "gpumemoryestimates", forged))
    assert error.status == 403
    assert json.loads(error.body)["reason"] == "Forbidden"
