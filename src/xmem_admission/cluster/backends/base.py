"""The interface every backend implements: write a request in its form, read one back.

A backend never overrides a request that already exists in its form: that is a request set by
hand (validation then checks it against the estimate) or one the webhook wrote earlier (so a
second pass changes nothing, which is what makes reinvocation give an empty patch).
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, List, Mapping, Optional, Sequence, Tuple

from xmem_admission.cluster.integrations.base import TemplateRef
from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import MiB, ceil_div
from xmem_admission.cluster.kube.resources import (
    Slot,
    container_resources,
    resource_value,
    slot_field,
)
from xmem_admission.cluster.policy.model import BackendName
from xmem_admission.contract import gpus
from xmem_admission.contract.errors import InvalidObjectError, QuantityError

# (slot, container, GPU count) as resources.gpu_containers yields them.
GpuContainer = Tuple[Slot, Mapping[str, Any], int]


@dataclass(frozen=True)
class Existing:
    """A request already present in a backend's form."""

    what: str  # as a person would write it: "nvidia.com/gpumem: 8000"
    bytes_per_gpu: Optional[int]  # None when it cannot be converted (an unknown MIG profile)
    field: str  # field path, relative to the template, for validation messages


@dataclass
class Applied:
    """What ``apply`` wrote (for the kubectl warning) and anything the user should know."""

    written: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)


@contextmanager
def quantity_at(where: str) -> Iterator[None]:
    """Turn a quantity that does not parse into ``InvalidObjectError`` naming ``where`` it stands.

    A malformed hand-set request is the object's fault (the API server answers 400 with the
    field), not the webhook's; every backend reads its form through this so the message agrees.
    """
    try:
        yield
    except QuantityError as exc:
        raise InvalidObjectError(f"{where}: {exc}") from None


def resource_request(
    container: Mapping[str, Any], slot: Slot, name: str, unit: int, cards: int = 1
) -> Optional[Existing]:
    """A request written as an extended resource (``name``: N ``unit``s for ``cards`` GPUs)."""
    value = resource_value(container, name)
    if value is None:
        return None
    field = f"{slot_field(slot)}.resources.limits[{name}]"
    with quantity_at(field):
        size = quantity.parse_count(value) * unit // cards
    return Existing(f"{name}: {value}", size, field)


def mib(request_bytes: int) -> int:
    """Whole MiB holding a request (HAMi, Volcano and KAI count in MiB)."""
    return ceil_div(request_bytes, MiB)


def drop_resource(draft: Draft, ref: TemplateRef, slot: Slot, name: str) -> None:
    """Remove a resource from a container's limits and requests, where present."""
    limits, requests = container_resources(draft.get(ref.at("spec", *slot)))
    for kind, present in (("limits", limits), ("requests", requests)):
        if name in present:
            draft.delete(ref.at("spec", *slot, "resources", kind, name))


def set_limit(draft: Draft, ref: TemplateRef, slot: Slot, name: str, value: str) -> None:
    """Set an extended resource in limits (requests default to limits for extended resources)."""
    draft.set(ref.at("spec", *slot, "resources", "limits", name), value)
    limits, requests = container_resources(draft.get(ref.at("spec", *slot)))
    if name in requests:  # requests must equal limits for extended resources
        draft.set(ref.at("spec", *slot, "resources", "requests", name), value)


class Backend(abc.ABC):
    """One way of expressing a GPU memory request."""

    name: ClassVar[BackendName]

    @abc.abstractmethod
    def existing(
        self, template: Mapping[str, Any], slot: Slot, container: Mapping[str, Any], gpu: gpus.GPU
    ) -> Optional[Existing]:
        """The request this container already has in this backend's form, if any."""

    @abc.abstractmethod
    def apply(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        """Write ``request_bytes`` per GPU into every listed container that has no request yet."""

    def pending(
        self, ref: TemplateRef, containers: Sequence[GpuContainer], gpu: gpus.GPU
    ) -> List[GpuContainer]:
        """The containers without a request in this backend's form (the ones ``apply`` writes)."""
        return [c for c in containers if self.existing(ref.template, c[0], c[1], gpu) is None]

    def written_bytes(self, request_bytes: int, gpu: gpus.GPU) -> Optional[int]:
        """What ``existing`` reads back from the form ``apply`` writes for ``request_bytes``
        (None: this backend writes no form). A form that reads back as anything else was not
        written by xmem for that request."""
        return mib(request_bytes) * MiB

    def rewrite(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        """Write ``request_bytes`` over the form these containers carry, one xmem wrote for a
        smaller request (a retry after a CUDA out-of-memory failure: a repeat job's template
        carries the form from Job CREATE). Nothing for a backend without a form."""
        return Applied()


class ContainerBackend(Backend):
    """A backend whose form lives in each container, so ``apply`` writes pending ones one by one.

    One ``apply`` for all of them keeps their order the same: nothing pending writes and warns
    nothing; a refusal (a pod the form cannot express) writes nothing in any container, so the
    pod keeps whole GPUs rather than a half-converted mix; otherwise every pending one is written.
    """

    def apply(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        pending = self.pending(ref, containers, gpu)
        if not pending:
            return Applied()
        refusal = self.refusal(pending, request_bytes, gpu)
        if refusal is not None:
            return Applied(warnings=[refusal])
        return Applied(written=[self.write(draft, ref, c, request_bytes, gpu) for c in pending])

    def refusal(
        self, pending: Sequence[GpuContainer], request_bytes: int, gpu: gpus.GPU
    ) -> Optional[str]:
        """Why this pod cannot take the form (the warning), or None to write every container."""
        return None

    @abc.abstractmethod
    def write(
        self, draft: Draft, ref: TemplateRef, target: GpuContainer, request_bytes: int, gpu: gpus.GPU
    ) -> str:
        """Write one pending container's request; returns what was written, for the warning."""

    def withdraw(self, draft: Draft, ref: TemplateRef, target: GpuContainer) -> None:
        """Remove what ``write`` wrote that a later ``write`` would not overwrite (``rewrite``)."""

    def rewrite(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        refusal = self.refusal(containers, request_bytes, gpu)
        if refusal is not None:
            return Applied(warnings=[refusal])
        written = []
        for target in containers:
            self.withdraw(draft, ref, target)
            written.append(self.write(draft, ref, target, request_bytes, gpu))
        return Applied(written=written)
