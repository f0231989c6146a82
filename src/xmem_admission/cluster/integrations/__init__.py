"""Workload kinds the webhook understands, each behind the ``Integration`` interface.

``for_kind(group, version, kind)`` finds the integration for an AdmissionReview's ``kind``;
``ALL`` lists them (the Helm chart's webhook rules and the controller's watches follow it).
"""

from __future__ import annotations

from typing import Optional, Tuple

from xmem_admission.cluster.integrations.base import Integration, TemplateRef
from xmem_admission.cluster.integrations.job import JobIntegration
from xmem_admission.cluster.integrations.pod import PodIntegration
from xmem_admission.cluster.integrations.pytorchjob import PyTorchJobIntegration

ALL: Tuple[Integration, ...] = (JobIntegration(), PodIntegration(), PyTorchJobIntegration())

_BY_KIND = {(i.group, version, i.kind): i for i in ALL for version in i.versions}


def for_kind(group: str, version: str, kind: str) -> Optional[Integration]:
    """The integration for a group/version/kind, or None when the webhook does not handle it."""
    return _BY_KIND.get((group, version, kind))


__all__ = ["ALL", "Integration", "TemplateRef", "for_kind"]
