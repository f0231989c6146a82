"""Who may do what through the webhook, read from the AdmissionReview's ``userInfo``.

The estimation pod runs the user's own code, and a workload's annotations are the user's to
write, so nothing a tenant submits can be taken at its word. Five kinds of requester:

- **the xmem controller** (its service account, ``controller_users``): the only one whose
  ``xmem.io/`` annotations are honoured on a workload, and the only one that may change them
  or release (unsuspend) a held workload;
- **workload controllers** (the Job controller, the training operator, JobSet's and Kubeflow
  Trainer's controllers: ``workload_controllers``, exact user names or prefixes ending in
  ``*``): the pods they create copy a pod template that the webhook reviewed, so a Pod they
  create for a Job or PyTorchJob carries trusted sizing annotations, and only a Pod they create
  counts as owned (a user can write any ownerReference); a JobSet Trainer creates for a
  TrainJob, or a Job JobSet creates for a JobSet, is part of the workload that owns it and
  passes unchanged;
- **Kueue** (``kueue_users``): with the policy's ``integration: Kueue``, Kueue starts a queued
  workload by unsuspending it and writing the AdmissionCheck's podSetUpdates (the sizing
  annotations the xmem controller computed) into its pod templates; on a workload that names a
  Kueue queue it may do both, as the xmem controller may;
- **break-glass admins** (members of ``break_glass_groups``, from ``userInfo.groups``): their
  annotation ``xmem.io/break-glass: "<reason>"`` admits a workload unchanged even where the
  policy enforces (``break_glass``); nobody is one unless the webhook names a group;
- **everyone else**: their ``xmem.io/`` sizing annotations are stripped at CREATE (or the
  request is denied, per the policy's ``untrustedAnnotations``), changing them later or
  unsuspending a held workload is refused when the policy enforces.

Kubernetes names the built-in controllers ``system:serviceaccount:kube-system:<name>`` when the
controller manager runs with ``--use-service-account-credentials`` (kubeadm's default) and
``system:kube-controller-manager`` otherwise; a tenant cannot obtain either identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Tuple

from xmem_admission.cluster import labels

DEFAULT_CONTROLLER_USER = "system:serviceaccount:xmem-system:xmem-xmem-admission-controller"  # deploy/
DEFAULT_WORKLOAD_CONTROLLERS = (
    "system:kube-controller-manager",
    "system:serviceaccount:kube-system:*",
    "system:serviceaccount:kubeflow:training-operator",
    # Kubeflow Trainer v2's controller manager (manifests/base/rbac/service_account.yaml,
    # namespace kubeflow-system from manifests/overlays/manager, v2.3.0) and JobSet's
    # (config/components/rbac/service_account.yaml with config/default's namespace
    # jobset-system and namePrefix jobset-, v0.12.0; Trainer's manifests install it into
    # kubeflow-system under the same name).
    "system:serviceaccount:kubeflow-system:kubeflow-trainer-controller-manager",
    "system:serviceaccount:jobset-system:jobset-controller-manager",
    "system:serviceaccount:kubeflow-system:jobset-controller-manager",
)
# Kueue's service account as its release manifests name it: controller-manager
# (config/components/rbac/service_account.yaml) with config/default/kustomization.yaml's
# namespace kueue-system and namePrefix kueue- (sigs.k8s.io/kueue v0.17.0).
DEFAULT_KUEUE_USERS = ("system:serviceaccount:kueue-system:kueue-controller-manager",)
JOB_CONTROLLER = "system:serviceaccount:kube-system:job-controller"


def _matches(user: str, patterns: Iterable[str]) -> bool:
    for pattern in patterns:
        if pattern.endswith("*") and user.startswith(pattern[:-1]) or user == pattern:
            return True
    return False


@dataclass(frozen=True)
class Trust:
    """The identities the webhook trusts (see the module docstring)."""

    controller_users: Tuple[str, ...] = (DEFAULT_CONTROLLER_USER,)
    workload_controllers: Tuple[str, ...] = DEFAULT_WORKLOAD_CONTROLLERS
    kueue_users: Tuple[str, ...] = DEFAULT_KUEUE_USERS
    break_glass_groups: Tuple[str, ...] = ()

    def is_controller(self, user: str) -> bool:
        return bool(user) and user in self.controller_users

    def is_kueue(self, user: str) -> bool:
        return bool(user) and user in self.kueue_users

    def is_workload_controller(self, user: str) -> bool:
        return bool(user) and _matches(user, self.workload_controllers)

    def may_break_glass(self, groups: Iterable[str]) -> bool:
        """Whether a requester in these groups may exempt a workload (exact group names)."""
        return any(group in self.break_glass_groups for group in groups)


def xmem_annotations(meta: object) -> Dict[str, Any]:
    """The ``xmem.io/`` annotations of an object's (or a pod template's) metadata."""
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    if not isinstance(annotations, dict):
        return {}
    return {k: v for k, v in annotations.items() if isinstance(k, str)
            and k.startswith(labels.PREFIX)}
