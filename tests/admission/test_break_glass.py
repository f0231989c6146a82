"""The break-glass path (docs/operations.md, "Break-glass"): an admin's annotation
``xmem.io/break-glass: "<reason>"`` admits a workload unchanged where the policy enforces, with a
warning, a counter and audit annotations; anyone else's is ignored and the answer says why.

Every case goes through ``Webhook.review`` with AdmissionReview bodies as the API server sends
them (``userInfo.groups`` is what decides), and one through ``xmem serve`` in its own process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import httpx
import orjson
import pytest
import yaml

from tests.support.builders import make_job, make_pod, make_pytorchjob, review
from tests.support.estimates import record_for
from tests.support.harness import (
    Answer,
    Certificates,
    LocalWebhook,
    ServeProcess,
    make_policy,
    metric,
)
from xmem_admission.cluster import labels
from xmem_admission.cluster.admission.trust import Trust

ADMINS = "xmem-admins"
REASON = "INC-4711: estimator down, release run now"
GPUS = ("A100-80GB", "H100-80GB")
TOO_BIG = {"A100-80GB": 95.0, "H100-80GB": 95.3}  # fits no GPU of the policy
COUNTER = "xmem_admission_break_glass_total"


def as_user(body: Dict[str, Any], user: str, *groups: str) -> Dict[str, Any]:
    """The review as the API server sends it for this user and these groups."""
    body["request"]["userInfo"] = {"username": user,
                                   "groups": [*groups, "system:authenticated"]}
    return body


def admin(body: Dict[str, Any]) -> Dict[str, Any]:
    return as_user(body, "oncall@example.com", ADMINS)


def glass_job(name: str = "train", reason: str = REASON):
    return make_job(name).opt_in().gpus(1).annotation(labels.BREAK_GLASS, reason)


def both(local: LocalWebhook, body: Dict[str, Any]) -> List[Answer]:
    """The mutating answer, then the validating one for the object as mutated (the API
    server's order)."""
    mutated = local.send(body, "mutate")
    after = dict(body, request=dict(body["request"], object=mutated.patched()))
    return [mutated, local.send(after, "validate")]


def counted(local: LocalWebhook, kind: str = "Job", namespace: str = "ml") -> float:
    value = local.webhook.metrics.registry.get_sample_value(
        COUNTER, {"namespace": namespace, "kind": kind})
    return value or 0.0


@pytest.fixture()
def enforced(local: LocalWebhook) -> LocalWebhook:
    local.use(make_policy(enforcement="Enforce"))
    local.webhook.trust = Trust(break_glass_groups=(ADMINS,))
    return local


def test_an_admins_job_is_admitted_unchanged_under_enforce_and_counted_once(
        enforced: LocalWebhook):
    mutated, validated = both(enforced, admin(review(glass_job().obj())))

    job = mutated.patched()
    assert mutated.allowed and validated.allowed
    assert "suspend" not in job["spec"]  # not held
    template = job["spec"]["template"]["metadata"]["annotations"]
    assert template == {labels.BREAK_GLASS: REASON}  # the only change: its pods are exempt too
    for answer in (mutated, validated):
        assert any(w.startswith("xmem: break-glass by oncall@example.com: admitted unchanged")
                   and REASON in w for w in answer.warnings), answer.warnings
        assert answer.response["auditAnnotations"] == {
            "break-glass-by": "oncall@example.com", "break-glass-reason": REASON}
    assert counted(enforced) == 1


def test_the_same_job_from_someone_outside_the_groups_is_held_and_told_why(
        enforced: LocalWebhook):
    answer = enforced.send(review(glass_job().obj()), "mutate")  # alice, no admin group

    assert answer.allowed and answer.patched()["spec"]["suspend"] is True
    assert answer.warnings[0] == (
        "xmem: xmem.io/break-glass is not honoured: alice is in none of the webhook's "
        "break-glass groups; the policy applies as usual")
    assert "auditAnnotations" not in answer.response
    assert counted(enforced) == 0


def test_without_a_configured_group_nobody_breaks_the_glass(local: LocalWebhook):
    local.use(make_policy(enforcement="Enforce"))

    answer = local.send(admin(review(glass_job().obj())), "mutate")

    assert answer.patched()["spec"]["suspend"] is True
    assert "names no break-glass group (xmem serve --break-glass-group)" in answer.warnings[0]


@pytest.mark.parametrize("reason", ["", "   "])
def test_an_admins_annotation_without_a_reason_is_not_honoured(enforced: LocalWebhook,
                                                                reason: str):
    answer = enforced.send(admin(review(glass_job(reason=reason).obj())), "mutate")

    assert answer.patched()["spec"]["suspend"] is True
    assert "it needs a reason" in answer.warnings[0]


@pytest.mark.parametrize("who, allowed", [("admin", True), ("tenant", False)])
def test_an_estimate_that_fits_no_gpu_is_refused_unless_an_admin_breaks_the_glass(
        enforced: LocalWebhook, who: str, allowed: bool):
    job = glass_job("huge").obj()
    enforced.record(record_for(job, TOO_BIG, GPUS))
    body = admin(review(job)) if who == "admin" else review(job)

    validated = both(enforced, body)[1]

    assert validated.allowed is allowed
    if not allowed:
        assert "fits no GPU of the policy" in validated.status["message"]


def test_an_admin_bare_pod_without_an_estimate_is_admitted_where_it_would_be_refused(
        enforced: LocalWebhook):
    pod = make_pod("debug").opt_in().gpus(1)

    refused = enforced.send(review(pod.obj()), "mutate")
    mutated, validated = both(
        enforced, admin(review(pod.annotation(labels.BREAK_GLASS, REASON).obj())))

    assert not refused.allowed and "no recorded GPU memory estimate" in refused.status["message"]
    assert mutated.allowed and mutated.ops == [] and validated.allowed
    assert counted(enforced, "Pod") == 1


def test_the_pods_of_a_break_glass_job_are_not_sized_even_when_an_estimate_exists(
        enforced: LocalWebhook):
    job = admin(review(glass_job().obj()))
    template = enforced.send(job, "mutate").patched()["spec"]["template"]
    enforced.record(record_for(job["request"]["object"], {"A100-80GB": 20.0, "H100-80GB": 20.0},
                               GPUS))
    pod = make_pod("train-x7k2p").opt_in().gpus(1).owned_by("Job", "train").obj()
    pod["metadata"]["annotations"] = dict(template["metadata"]["annotations"])
    plain = make_pod("other-x7k2p").opt_in().gpus(1).owned_by("Job", "other").obj()

    exempt = both(enforced, review(pod))  # from the Job controller, as the API server says
    sized = enforced.send(review(plain), "mutate")

    assert all(a.allowed and a.ops == [] for a in exempt)
    assert labels.REQUEST_BYTES in sized.patched()["metadata"]["annotations"]
    assert counted(enforced, "Pod") == 0  # the Job was counted, not each of its pods


def test_a_tenant_cannot_write_the_exemption_into_its_own_pod_template(enforced: LocalWebhook):
    job = make_job("sneaky").opt_in().gpus(1).template_annotation(labels.BREAK_GLASS, "me")

    answer = enforced.send(review(job.obj()), "mutate")

    patched = answer.patched()
    assert patched["spec"]["suspend"] is True
    assert labels.BREAK_GLASS not in patched["spec"]["template"]["metadata"].get(
        "annotations", {})


def test_a_tenants_own_pod_claiming_the_exemption_is_judged_as_any_other(
        enforced: LocalWebhook):
    pod = make_pod("notebook").opt_in().gpus(1).annotation(labels.BREAK_GLASS, "please")

    answer = enforced.send(review(pod.obj()), "mutate")

    assert not answer.allowed
    assert "is not honoured: alice is in none" in answer.warnings[0]


def _held(job: Dict[str, Any]) -> Dict[str, Any]:
    """The Job as the webhook held it and the API server stored it."""
    job["spec"]["suspend"] = True
    job["metadata"]["annotations"] = {
        labels.HELD_REASON: labels.HeldReason.ESTIMATING.value,
        labels.HELD_SINCE: "2026-01-31T12:00:00Z", labels.FINGERPRINT: "f" * 64}
    return job


def _updated(old: Dict[str, Any], suspend: bool, in_template: bool) -> Dict[str, Any]:
    new = orjson.loads(orjson.dumps(old))
    new["metadata"]["annotations"][labels.BREAK_GLASS] = REASON
    new["spec"]["suspend"] = suspend
    if in_template:
        new["spec"]["template"]["metadata"].setdefault("annotations", {})[
            labels.BREAK_GLASS] = REASON
    return new


@pytest.mark.parametrize("suspend, in_template, missing", [
    (True, False, ["spec.suspend: false",
                   "spec.template.metadata.annotations[xmem.io/break-glass]"]),
    (False, False, ["spec.template.metadata.annotations[xmem.io/break-glass]"]),
    (True, True, ["spec.suspend: false"]),
])
def test_breaking_the_glass_on_a_held_job_must_release_it_in_the_same_update(
        enforced: LocalWebhook, suspend: bool, in_template: bool, missing: List[str]):
    old = _held(make_job("held").opt_in().gpus(1).obj())

    answer = enforced.send(admin(review(_updated(old, suspend, in_template), "UPDATE",
                                        old=old)), "validate")

    assert not answer.allowed
    message = answer.status["message"]
    assert "is held by xmem until its GPU memory is estimated" in message
    assert all(m in message for m in missing), message
    assert counted(enforced) == 0


def test_an_admin_releases_a_held_job_in_one_update_where_a_tenant_is_refused(
        enforced: LocalWebhook):
    old = _held(make_job("held").opt_in().gpus(1).obj())
    new = _updated(old, suspend=False, in_template=True)

    released = enforced.send(admin(review(new, "UPDATE", old=old)), "validate")
    tenant = enforced.send(review(new, "UPDATE", old=old), "validate")

    assert released.allowed
    assert any("released from its hold" in w for w in released.warnings)
    assert counted(enforced) == 1
    assert not tenant.allowed
    assert "only the xmem controller releases it" in tenant.status["message"]


def test_a_held_pytorchjob_names_its_own_suspend_field_and_templates(enforced: LocalWebhook):
    old = make_pytorchjob("ddp").opt_in().workers(2).gpus(1).obj()
    old["spec"].setdefault("runPolicy", {})["suspend"] = True
    old["metadata"]["annotations"] = {labels.HELD_REASON: "Estimating"}
    new = orjson.loads(orjson.dumps(old))
    new["metadata"]["annotations"][labels.BREAK_GLASS] = REASON

    answer = enforced.send(admin(review(new, "UPDATE", old=old)), "validate")

    message = answer.status["message"]
    assert "spec.runPolicy.suspend: false" in message
    assert "spec.pytorchReplicaSpecs.Master.template.metadata.annotations" in message


def _trainjob(annotations: Dict[str, str]) -> Dict[str, Any]:
    obj = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
           "metadata": {"name": "llm", "namespace": "ml", "labels": {labels.OPT_IN: "true"},
                        "annotations": annotations},
           "spec": {"runtimeRef": {"name": "torch-distributed"}}}
    body = review(obj, kind="TrainJob")
    gvk = {"group": "trainer.kubeflow.org", "version": "v1alpha1", "kind": "TrainJob"}
    body["request"]["kind"] = body["request"]["requestKind"] = gvk
    return body


def test_a_trainjob_whose_runtime_cannot_be_read_is_admitted_by_break_glass(
        enforced: LocalWebhook):
    refused = enforced.send(admin(_trainjob({})), "mutate")  # no API to read the runtime from
    mutated, validated = both(enforced, admin(_trainjob({labels.BREAK_GLASS: REASON})))

    assert not refused.allowed and "fails closed" in refused.status["message"]
    assert mutated.allowed and mutated.ops == [] and validated.allowed
    assert counted(enforced, "TrainJob") == 1


def test_a_standing_annotation_does_not_warn_on_someone_elses_later_update(
        enforced: LocalWebhook):
    old = glass_job().obj()
    new = orjson.loads(orjson.dumps(old))
    new["metadata"]["labels"]["team"] = "vision"

    answer = enforced.send(review(new, "UPDATE", old=old), "validate")

    assert answer.allowed and not answer.warnings


def test_a_dry_run_gets_the_same_answer_and_is_not_counted(enforced: LocalWebhook):
    mutated, validated = both(enforced, admin(review(glass_job().obj(), dry_run=True)))

    assert mutated.allowed and validated.allowed and "suspend" not in mutated.patched()["spec"]
    assert counted(enforced) == 0


def test_under_warn_an_admins_job_is_not_held_either(local: LocalWebhook):
    local.webhook.trust = Trust(break_glass_groups=(ADMINS,))

    plain = local.send(review(make_job("a").opt_in().gpus(1).obj()), "mutate")
    glass = local.send(admin(review(glass_job("b").obj())), "mutate")

    assert plain.patched()["spec"]["suspend"] is True
    assert "suspend" not in glass.patched()["spec"]


def test_a_long_multiline_reason_is_one_bounded_printable_line_in_warnings_and_audit(
        enforced: LocalWebhook):
    reason = "line one\nline two \x1b[31m" + "x" * 400

    answer = enforced.send(admin(review(glass_job(reason=reason).obj())), "mutate")

    audit = answer.response["auditAnnotations"]["break-glass-reason"]
    assert "\n" not in audit and "\x1b" not in audit and len(audit) <= 200
    assert audit.startswith("line one line two [31mxxx")
    # the template carries the annotation exactly as the admin wrote it
    assert answer.patched()["spec"]["template"]["metadata"]["annotations"][
        labels.BREAK_GLASS] == reason


def test_xmem_serve_takes_the_groups_from_repeated_flags_or_the_environment(
        tmp_path: Path, certs: Certificates, monkeypatch: pytest.MonkeyPatch):
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
        "metadata": {"name": "default"},
        "spec": {"enforcement": "Enforce", "targets": [{"gpu": "A100-80GB", "backend": "HAMi"}]},
    }))
    monkeypatch.setenv("XMEM_BREAK_GLASS_GROUPS", "sre, " + ADMINS)
    by_env = ServeProcess(tmp_path, certs, "--policy", str(policy), name="env")
    by_flags = ServeProcess(tmp_path, certs, "--policy", str(policy), "--break-glass-group",
                            "sre", "--break-glass-group", "platform", name="flags")

    def send(server: ServeProcess, group: str, endpoint: str = "mutate") -> Answer:
        body = as_user(review(glass_job().obj()), "oncall", group)
        raw = httpx.post(f"https://127.0.0.1:{server.port}/{endpoint}",
                         content=orjson.dumps(body), verify=certs.client_context(), timeout=10)
        return Answer(raw.json(), body)

    try:
        from_env, validated = send(by_env, ADMINS), send(by_env, ADMINS, "validate")
        from_flag, not_listed = send(by_flags, "platform"), send(by_flags, ADMINS)
        text = by_env.metrics()
    finally:
        by_env.close()
        by_flags.close()

    assert "suspend" not in from_env.patched()["spec"] and validated.allowed
    assert "suspend" not in from_flag.patched()["spec"]
    assert not_listed.patched()["spec"]["suspend"] is True  # the flags replace the environment
    assert "break-glass for groups sre, xmem-admins" in (tmp_path / "env.log").read_text()
    assert metric(text, COUNTER, namespace="ml", kind="Job") == 1
