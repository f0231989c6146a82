"""The labels and annotations xmem reads and writes on Kubernetes objects, in one place.

The webhook, the controller and the Helm chart all name these keys; keeping them here means a
rename cannot leave one side behind. Everything lives under the ``xmem.io/`` prefix.

Where each one goes:

- ``xmem.io/estimate: "true"`` (label): the opt-in, on a namespace or on a workload. The webhook
  copies it into pod templates so that the pods of a held workload reach the webhook too (the
  webhook configuration's objectSelector only sees the pod's own labels).
- On a held workload (Job, PyTorchJob): ``held-reason`` (a ``HeldReason``), ``held-since``
  (RFC 3339, UTC), ``fingerprint`` (see ``xmem_admission.cluster.policy.fingerprint``), and ``user-suspended``
  when the workload was already suspended by its owner (the controller must then not release it).
- On pod templates and pods: ``request-bytes`` (the sized request per GPU, the one number every
  backend converts), ``gpu-model`` (catalogue key of the GPU it was sized for), and
  ``estimate-bytes`` (the raw estimate before margin and rounding, for dashboards and validation).
- ``xmem.io/break-glass: "<reason>"`` (annotation): an admin's emergency exemption of one
  workload (``xmem_admission.cluster.admission.break_glass``); honoured only when the requester
  is in one of the webhook's break-glass groups, then copied by the webhook into the workload's
  GPU pod templates, where only xmem writes it, so that its pods are exempt too.
"""

from __future__ import annotations

import enum

PREFIX = "xmem.io/"

OPT_IN = PREFIX + "estimate"
OPT_IN_VALUE = "true"

HELD_REASON = PREFIX + "held-reason"
HELD_SINCE = PREFIX + "held-since"
FINGERPRINT = PREFIX + "fingerprint"
USER_SUSPENDED = PREFIX + "user-suspended"

REQUEST_BYTES = PREFIX + "request-bytes"
GPU_MODEL = PREFIX + "gpu-model"
ESTIMATE_BYTES = PREFIX + "estimate-bytes"
# On a pod sized after its workload ran out of GPU memory: how many OOMs in a row its request
# grew from (informational; the request itself is ``request-bytes``).
OOM_RETRY = PREFIX + "oom-retry"

# An admin's break-glass (its value is the reason): admitted unchanged, never held or sized.
BREAK_GLASS = PREFIX + "break-glass"

# Kueue's label naming the LocalQueue a workload is submitted to (Kueue's
# constants.QueueLabel, pkg/controller/constants/constants.go in sigs.k8s.io/kueue v0.17.0): with
# the policy's ``integration: Kueue``, a workload carrying it is Kueue's to hold.
KUEUE_QUEUE_NAME = "kueue.x-k8s.io/queue-name"

# The annotations that mark a workload as held by xmem (the controller removes them on release).
HELD_ANNOTATIONS = (HELD_REASON, HELD_SINCE, USER_SUSPENDED)


class HeldReason(str, enum.Enum):
    """Why a workload is held; machine-readable so the controller can act on it."""

    AWAITING_ESTIMATE = "AwaitingEstimate"  # the webhook found no recorded estimate
    ESTIMATING = "Estimating"  # the controller has started an estimation pod
    ESTIMATION_FAILED = "EstimationFailed"  # policy keeps it held after a failed estimation


def kueue_queue(labels: object) -> str:
    """The Kueue LocalQueue a label map names ('' when none)."""
    value = labels.get(KUEUE_QUEUE_NAME) if isinstance(labels, dict) else None
    return value if isinstance(value, str) else ""


def is_opted_in(labels: object) -> bool:
    """True when a label map carries the opt-in label with the value ``"true"``."""
    return isinstance(labels, dict) and labels.get(OPT_IN) == OPT_IN_VALUE
