"""Annotation-only: the request stays in ``xmem.io/request-bytes`` and nothing else changes.

For clusters that only want the estimate visible (dashboards, chargeback) or whose scheduler
reads the annotation itself.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from xmem_admission.cluster.backends.base import Applied, Backend, Existing, GpuContainer
from xmem_admission.cluster.integrations.base import TemplateRef
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.resources import Slot
from xmem_admission.cluster.policy.model import BackendName
from xmem_admission.contract import gpus


class AnnotationBackend(Backend):
    name = BackendName.ANNOTATION

    def existing(
        self, template: Mapping[str, Any], slot: Slot, container: Mapping[str, Any], gpu: gpus.GPU
    ) -> Optional[Existing]:
        return None  # the xmem.io/request-bytes annotation is checked for every backend

    def written_bytes(self, request_bytes: int, gpu: gpus.GPU) -> Optional[int]:
        return None  # no form: the annotation is the request

    def apply(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        return Applied()
