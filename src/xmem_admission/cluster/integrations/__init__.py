"""Workload kinds the webhook and the controller understand, each behind ``Integration``.

Importing this package imports every kind's module, and each registers itself once
(``base.register``): ``ALL`` is the registry, in registration order (the Helm chart's webhook
rules follow it, the controller watches the kinds in it that can be held), and
``for_kind(group, version, kind)`` finds the integration for an AdmissionReview's ``kind``.
"""

from __future__ import annotations

from typing import Tuple

# Imported for their registration; the order is the registry's order.
from xmem_admission.cluster.integrations import job, pod, pytorchjob  # noqa: F401

# isort: split
# The training stacks that run on JobSet (jobset.py, trainjob.py), after the kinds above.
from xmem_admission.cluster.integrations import jobset, trainjob  # noqa: F401
from xmem_admission.cluster.integrations.base import (
    GpuTemplate,
    HeldOwner,
    Integration,
    Lookup,
    NotResolved,
    Reader,
    TemplateRef,
    Unit,
    estimation_units,
    fingerprint_of,
    for_kind,
    gpu_templates,
    held_owner,
    part_of_held_workload,
    registered,
    unit_of,
)

ALL: Tuple[Integration, ...] = registered()

__all__ = ["ALL", "GpuTemplate", "HeldOwner", "Integration", "Lookup", "NotResolved", "Reader",
           "TemplateRef", "Unit", "estimation_units", "fingerprint_of", "for_kind",
           "gpu_templates", "held_owner", "part_of_held_workload", "registered", "unit_of"]
