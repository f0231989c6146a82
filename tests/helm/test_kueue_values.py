"""The chart's Kueue option: off by default (no Kueue object, no Kueue rights); on, it creates the
AdmissionCheck the controller serves, tells the controller its controllerName and the webhook
Kueue's user, and grants reads of AdmissionChecks and Workloads and writes of their status only."""

from __future__ import annotations

from localkube.kueue import home as kueue_home
from tests.helm.chart import NAMESPACE, RELEASE, find, one, render
from tests.helm.test_least_privilege import CONTROLLER_SA, READ, _grants, _rules_of
from tests.support.schemas import validate_custom
from xmem_admission.cluster.controller.admission_checks import CONTROLLER_NAME

ON = {"kueue": {"enabled": True}}


def _env(objects, component: str) -> dict:
    deployment = one(objects, "Deployment", f"{RELEASE}-xmem-admission-{component}")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_by_default_nothing_of_kueue_is_rendered_or_granted() -> None:
    objects = render({})
    assert find(objects, "AdmissionCheck") == []
    assert "XMEM_KUEUE_CONTROLLER_NAME" not in _env(objects, "controller")
    groups = {g for _, g, _, _ in _grants(_rules_of(objects, CONTROLLER_SA))}
    assert "kueue.x-k8s.io" not in groups


def test_enabled_it_renders_the_admission_check_kueue_accepts_and_tells_the_controller() -> None:
    objects = render(ON)
    check = one(objects, "AdmissionCheck", "xmem-gpu-memory")
    assert check["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert check["spec"]["controllerName"] == CONTROLLER_NAME
    # Kueue's own CRD, from its module (``make tools``, scripts/build-kueue.sh).
    validate_custom(check, kueue_home() / "crds" / "kueue.x-k8s.io_admissionchecks.yaml")
    assert _env(objects, "controller")["XMEM_KUEUE_CONTROLLER_NAME"] == CONTROLLER_NAME
    assert _env(objects, "webhook")["XMEM_KUEUE_USERS"] == \
        "system:serviceaccount:kueue-system:kueue-controller-manager"


def test_enabled_the_controller_reads_kueue_objects_and_writes_only_their_status() -> None:
    grants = _grants(_rules_of(render(ON), CONTROLLER_SA))
    kueue = {(s, r, v) for s, g, r, v in grants if g == "kueue.x-k8s.io"}
    assert kueue == {("", r, v) for r in ("admissionchecks", "workloads") for v in READ} | {
        ("", "admissionchecks/status", "update"), ("", "workloads/status", "update")}


def test_names_and_users_follow_the_values() -> None:
    objects = render({"kueue": {"enabled": True, "admissionCheckName": "gpu-memory",
                                "controllerName": "example.com/xmem",
                                "users": ["system:serviceaccount:queues:kueue"]}}, namespace=NAMESPACE)
    assert one(objects, "AdmissionCheck", "gpu-memory")["spec"]["controllerName"] == \
        "example.com/xmem"
    assert _env(objects, "webhook")["XMEM_KUEUE_USERS"] == "system:serviceaccount:queues:kueue"


def test_without_the_controller_no_admission_check_is_left_unserved() -> None:
    objects = render({"kueue": {"enabled": True}, "controller": {"enabled": False}})
    assert find(objects, "AdmissionCheck") == []
