"""Turning xmem off for one workload in a labelled namespace (docs/operations.md, "Turning it
off"): the workload's own label ``xmem.io/estimate: "false"`` opts it out where the namespace's
policy warns; where it enforces, the admin's namespace label wins and the answer says so."""

from __future__ import annotations

from tests.support.builders import make_job, make_pod, review
from tests.support.harness import LocalWebhook, make_policy
from xmem_admission.cluster import labels


def _opted_out_job(name: str = "train", namespace: str = "ml"):
    return make_job(name, namespace).label(labels.OPT_IN, "false").gpus(1)


def test_a_job_labelled_false_in_a_labelled_namespace_is_admitted_unchanged(local: LocalWebhook):
    job = _opted_out_job().obj()

    for endpoint in ("mutate", "validate"):
        answer = local.send(review(job), endpoint, "namespace")
        assert answer.allowed and answer.ops == [], endpoint
        assert not answer.warnings, endpoint


def test_a_bare_pod_labelled_false_gets_no_warning_about_its_missing_estimate(
        local: LocalWebhook):
    pod = make_pod("notebook").gpus(1)
    opted_out = make_pod("notebook").label(labels.OPT_IN, "false").gpus(1)

    for endpoint in ("mutate", "validate"):
        assert local.send(review(pod.obj()), endpoint, "namespace").warnings, endpoint
        answer = local.send(review(opted_out.obj()), endpoint, "namespace")
        assert answer.allowed and answer.ops == [] and not answer.warnings, endpoint


def test_the_same_job_without_the_label_is_held(local: LocalWebhook):
    answer = local.send(review(make_job("train").gpus(1).obj()), "mutate", "namespace")

    assert answer.allowed and answer.patched()["spec"]["suspend"] is True


def test_under_enforce_the_opt_out_is_not_honoured_and_the_answer_says_why(local: LocalWebhook):
    local.use(make_policy(enforcement="Enforce"))

    answer = local.send(review(_opted_out_job().obj()), "mutate", "namespace")

    assert answer.allowed and answer.patched()["spec"]["suspend"] is True  # held as any other
    assert any("xmem.io/estimate=false is not honoured" in w and "namespace ml" in w
               for w in answer.warnings), answer.warnings


def test_an_override_that_enforces_in_one_namespace_keeps_the_opt_out_elsewhere(
        local: LocalWebhook):
    local.use(make_policy(overrides=[{"namespaces": ["prod-*"], "enforcement": "Enforce"}]))

    sandbox = local.send(review(_opted_out_job("a", "sandbox").obj()), "mutate", "namespace")
    prod = local.send(review(_opted_out_job("b", "prod-ml").obj()), "mutate", "namespace")

    assert sandbox.ops == []
    assert prod.patched()["spec"]["suspend"] is True


def test_the_label_false_does_not_opt_a_workload_in_through_the_object_entry(local: LocalWebhook):
    answer = local.send(review(_opted_out_job("c", "elsewhere").obj()), "mutate", "object")

    assert answer.allowed and answer.ops == []
