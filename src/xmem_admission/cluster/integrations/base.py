"""The small interface every workload kind implements, and the registry of kinds (Kueue's shape).

An integration knows its API resource (group, versions, plural), where a kind keeps its pod
templates, whether and how it can be held (suspended) before any pod exists, and who owns it.
Everything else (opt-in, estimates, backends, patches) is kind-independent and lives in
``xmem_admission.cluster.admission`` and ``xmem_admission.cluster.controller``.

Each kind's module registers its integration once, on import, with ``@register`` (Kueue's
``jobframework.RegisterIntegration``); ``xmem_admission.cluster.integrations`` imports them all,
and the webhook (``for_kind``) and the controller (``registered()``) read the registry.

Templates are addressed by path so that mutations can go through a ``jsonpatch.Draft`` and the
patch stays exact; a bare Pod is its own template (path ``()``: it has ``metadata`` and ``spec``).

Most kinds carry their pod templates; a Kubeflow ``TrainJob`` does not: they come from the
runtime it references, with its own trainer fields laid over them. Such a kind says so
(``resolves``) and implements ``resolve(obj, reader)``, which reads what it needs through the
API (``Reader``: the controller's ``Kube``) and returns the object as ``pod_templates`` reads
it; ``unresolved`` turns a resolved object back into what may be written to the API server.
The webhook and the controller call both (``resolved``) for every kind; for the others they
return the object itself.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Type,
    TypeVar,
)

from xmem_admission.cluster.kube.client import Kind
from xmem_admission.cluster.kube.jsonpatch import Draft, Path, dotted
from xmem_admission.cluster.kube.resources import Slot, gpu_containers
from xmem_admission.cluster.policy import fingerprint
from xmem_admission.cluster.policy.store import WorkloadRef
from xmem_admission.contract.errors import InvalidObjectError


@dataclass(frozen=True)
class TemplateRef:
    """One pod template of a workload: its role name, where it is, and its content."""

    role: str  # "" for a Job or Pod, the replica type ("Master", "Worker") for a PyTorchJob
    path: Tuple[Any, ...]
    template: Mapping[str, Any]

    def at(self, *rest: Any) -> Tuple[Any, ...]:
        """The path of something inside this template (``ref.at("metadata", "labels")``)."""
        return self.path + rest

    def field(self, *rest: Any) -> str:
        """Kubernetes-style field path of something inside this template, for messages."""
        return dotted(self.at(*rest))


class Reader(Protocol):
    """What ``Integration.resolve`` reads through: the API server (``kube.client.Kube``)."""

    def get(self, kind: Kind, namespace: str, name: str) -> Dict[str, Any]: ...

    def get_cluster(self, kind: Kind, name: str) -> Dict[str, Any]: ...


class NotResolved(InvalidObjectError):
    """A workload's pod templates could not be resolved (its runtime is missing, or the API
    could not be read): the message says which object and why."""


# A GPU pod template and its GPU containers: (slot, container, GPU count) each.
GpuTemplate = Tuple[TemplateRef, List[Tuple[Slot, Mapping[str, Any], int]]]


def object_at(obj: Mapping[str, Any], path: Path) -> Mapping[str, Any]:
    """The object at ``path``, which must be there and be a mapping; errors name the field."""
    node: Any = obj
    for depth, part in enumerate(path):
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            raise InvalidObjectError(f"{dotted(path[: depth + 1])}: required")
        if not isinstance(node, dict):
            raise InvalidObjectError(f"{dotted(path[: depth + 1])}: expected an object")
    mapping: Mapping[str, Any] = node
    return mapping


class Integration(abc.ABC):
    """One workload kind: its API resource, its pod templates, how it is held."""

    group: ClassVar[str]
    versions: ClassVar[Tuple[str, ...]]
    kind: ClassVar[str]
    plural: ClassVar[str]
    # Whether it can be held (suspended) until an estimate exists; a Pod cannot.
    can_hold: ClassVar[bool]
    # Where the suspend flag lives, for kinds that can be held.
    suspend_path: ClassVar[Tuple[str, ...]] = ()
    # The status conditions (status "True") that say the workload ended, and how.
    completed_conditions: ClassVar[Tuple[str, ...]] = ()
    failed_conditions: ClassVar[Tuple[str, ...]] = ()
    # Whether the pod templates live outside the object and must be resolved first (a TrainJob:
    # its runtime's): the webhook then writes nothing into them at admission (the paths it
    # would write do not exist in the object), and the controller sizes them through
    # ``unresolved``'s write.
    resolves: ClassVar[bool] = False
    # Whether rank 0's world (``rank0_environment``) is part of the fingerprint: for a kind
    # whose world is not written in its templates (a JobSet's replicas x parallelism), so that
    # a 16-pod JobSet never shares the estimate of a Job running the same template.
    world_in_fingerprint: ClassVar[bool] = False

    # The label the kind's controllers give each pod naming the pod template it was made from
    # (its role); "" for a kind with one pod template.
    role_label: ClassVar[str] = ""

    @property
    def resource(self) -> Kind:
        """Where the kind lives in the REST tree (its first version): what the controller watches."""
        return Kind(self.group, self.versions[0], self.plural, self.kind)

    @abc.abstractmethod
    def pod_templates(self, obj: Mapping[str, Any]) -> List[TemplateRef]:
        """Every pod template, in a stable order (the fingerprint depends on it)."""

    def resolve(self, obj: Dict[str, Any], reader: Optional[Reader]) -> Dict[str, Any]:
        """The object as ``pod_templates`` reads it; the object itself for kinds that carry
        their templates. Raises ``NotResolved`` when what it references cannot be read."""
        return obj

    def unresolved(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        """A resolved object (possibly changed) as it may be written to the API server."""
        return obj

    def is_suspended(self, obj: Mapping[str, Any]) -> bool:
        node: Any = obj
        for part in self.suspend_path:
            node = node.get(part) if isinstance(node, dict) else None
        return node is True

    def suspend(self, draft: Draft) -> None:
        """Hold the workload: its controller creates no pods while this is set."""
        if not self.can_hold:
            raise TypeError(f"{self.kind} cannot be held")
        draft.set(self.suspend_path, True)

    def unsuspend(self, draft: Draft) -> None:
        """Release the workload (the controller's step once it is estimated or given up on)."""
        if not self.can_hold:
            raise TypeError(f"{self.kind} cannot be held")
        draft.set(self.suspend_path, False)

    def finished(self, obj: Mapping[str, Any]) -> Optional[bool]:
        """True once the workload completed, False once it failed, None while it runs (or for
        kinds that never finish as a whole)."""
        status = obj.get("status")
        conditions = status.get("conditions") if isinstance(status, dict) else None
        true = {c.get("type") for c in conditions or [] if isinstance(c, dict)
                and c.get("status") == "True"}
        if true & set(self.completed_conditions):
            return True
        if true & set(self.failed_conditions):
            return False
        return None

    def owner(self, obj: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
        """The controlling ownerReference (or the first one), None for a bare object."""
        refs = (obj.get("metadata") or {}).get("ownerReferences") or []
        if not isinstance(refs, list) or not refs:
            return None
        for ref in refs:
            if isinstance(ref, dict) and ref.get("controller") is True:
                return ref
        first = refs[0]
        return first if isinstance(first, dict) else None

    def rank0_environment(self, obj: Mapping[str, Any]) -> Dict[str, str]:
        """The distributed environment the workload's controller gives its rank-0 process,
        which the estimation pod traces (one process, no GPU). Empty for kinds whose
        processes get none from their controller (a Job's torchrun command carries its world
        on its command line, read by the probe)."""
        return {}

    def unit_environment(self, obj: Mapping[str, Any], roles: Sequence[str]) -> Dict[str, str]:
        """``rank0_environment`` for the pods of the templates named by ``roles`` only (an
        estimation unit of a workload whose GPU templates run different programs); kinds whose
        world does not depend on which template give the workload's."""
        return self.rank0_environment(obj)

    def role_of(self, pod: Mapping[str, Any]) -> Optional[str]:
        """The role of the pod template one of the workload's pods was made from (its
        ``role_label``), None when the kind has one template or the pod carries no such label."""
        if not self.role_label:
            return None
        value = ((pod.get("metadata") or {}).get("labels") or {}).get(self.role_label)
        return value if isinstance(value, str) and value else None

    def workload_ref(self, obj: Mapping[str, Any], namespace: str) -> WorkloadRef:
        meta = obj.get("metadata") or {}
        name = meta.get("name") or meta.get("generateName") or ""
        return WorkloadRef(namespace=namespace, kind=self.kind, name=str(name))


def controlling_owner(obj: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The ownerReference with ``controller: true``, None when there is none."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    for ref in refs if isinstance(refs, list) else []:
        if isinstance(ref, dict) and ref.get("controller") is True:
            return ref
    return None


def part_of_held_workload(obj: Mapping[str, Any]) -> Optional[str]:
    """The kind of the holdable workload that controls this one (a JobSet a TrainJob made, a
    Job a JobSet made), None when it is a workload of its own: such a part is estimated and
    sized as its owner, never held or estimated again."""
    ref = controlling_owner(obj)
    if ref is None:
        return None
    group = str(ref.get("apiVersion") or "").rpartition("/")[0]
    kind = str(ref.get("kind") or "")
    found = any(i.can_hold and i.kind == kind and i.group == group for i in _REGISTRY)
    return kind if found else None


# How the owner walk reads an object: (kind, namespace, name) -> the object, or None.
Lookup = Callable[[str, str, str], Optional[Mapping[str, Any]]]
# Controllers between a pod and the workload xmem holds: a TrainJob's JobSet and its Jobs.
MAX_OWNER_DEPTH = 4


@dataclass(frozen=True)
class HeldOwner:
    """The workload xmem holds and sizes that a pod (or a part) belongs to."""

    integration: Integration
    obj: Mapping[str, Any]
    # The uids of the objects between the pod and the workload, the pod's controlling owner
    # first (a TrainJob's pod: its Job, then the JobSet); empty when the workload controls the
    # pod itself.
    parts: Tuple[str, ...]


def held_owner(obj: Mapping[str, Any], lookup: Lookup) -> Optional[HeldOwner]:
    """Walk ``obj``'s controlling owner references up to the workload xmem holds (a kind of the
    registry that is not itself a part of another held workload: ``part_of_held_workload``),
    each owner read through ``lookup`` and matched by uid. None when a reference leaves the
    registry, an owner is gone or was replaced, or the chain is longer than a workload's."""
    namespace = str((obj.get("metadata") or {}).get("namespace") or "")
    parts: List[str] = []
    node = obj
    for _ in range(MAX_OWNER_DEPTH):
        ref = controlling_owner(node)
        if ref is None:
            return None
        group = str(ref.get("apiVersion") or "").rpartition("/")[0]
        integration = next((i for i in _REGISTRY if i.can_hold and i.kind == ref.get("kind")
                            and i.group == group), None)
        if integration is None:
            return None
        found = lookup(integration.kind, namespace, str(ref.get("name") or ""))
        if found is None or (found.get("metadata") or {}).get("uid") != ref.get("uid"):
            return None
        if part_of_held_workload(found) is None:
            return HeldOwner(integration, found, tuple(parts))
        parts.append(str(ref.get("uid")))
        node = found
    return None


def fingerprint_of(integration: Integration, obj: Mapping[str, Any], gpu_keys: Iterable[str],
                   groups: Optional[Sequence[Sequence[Any]]] = None,
                   versions: Optional[fingerprint.Versions] = None) -> str:
    """The workload's fingerprint (``policy.fingerprint``), the one key the webhook looks
    estimates up by and the controller records them under: its pod templates' GPU containers
    (``groups`` when the caller has them, one list per template), the versions of the
    ConfigMaps they read (``versions``: a lookup in the workload's namespace) and, for a kind
    that asks, rank 0's world."""
    refs = integration.pod_templates(obj)
    if groups is None:
        groups = [list(gpu_containers(ref.template)) for ref in refs]
    world = integration.rank0_environment(obj) if integration.world_in_fingerprint else None
    inputs = fingerprint.inputs_of([ref.template for ref in refs], versions)
    return fingerprint.of_containers(groups, gpu_keys, world, inputs)


@dataclass(frozen=True)
class Unit:
    """One program of a workload to estimate: the fingerprint its estimate is recorded under,
    and its GPU templates (indices into ``gpu_templates``)."""

    fingerprint: str
    templates: Tuple[int, ...]


def estimation_units(integration: Integration, obj: Mapping[str, Any],
                     gpu_keys: Iterable[str],
                     versions: Optional[fingerprint.Versions] = None) -> List[Unit]:
    """What to estimate for a workload: one unit, under the workload's own fingerprint, when
    every GPU template runs the same program (a Job; a PyTorchJob's master and workers; a
    JobSet's identical replicated Jobs), which is how every workload was always estimated;
    else one unit per distinct program (a JobSet whose replicated Jobs run different images),
    each under the fingerprint of its template alone in its own world, in the order the
    programs first appear. Each template is then sized from its own unit's estimate."""
    keys = sorted(set(gpu_keys))
    templates = gpu_templates(integration, obj)
    inputs = [fingerprint.inputs_of([ref.template], versions) for ref, _ in templates]
    programs = [fingerprint.of_containers([containers], keys, inputs=used)
                for (_, containers), used in zip(templates, inputs)]
    if len(set(programs)) <= 1:
        return [Unit(fingerprint_of(integration, obj, keys, versions=versions),
                     tuple(range(len(templates))))]
    out: List[Unit] = []
    for program in dict.fromkeys(programs):
        indices = tuple(i for i, p in enumerate(programs) if p == program)
        roles = [templates[i][0].role for i in indices]
        world = integration.unit_environment(obj, roles) \
            if integration.world_in_fingerprint else None
        fp = fingerprint.of_containers([templates[indices[0]][1]], keys, world,
                                       inputs[indices[0]])
        out.append(Unit(fp, indices))
    return out


def unit_of(integration: Integration, obj: Mapping[str, Any], units: Sequence[Unit],
            pod: Mapping[str, Any]) -> Optional[Unit]:
    """The estimation unit (``estimation_units`` of ``obj``, resolved) whose program one of the
    workload's pods runs: the only one, else the one holding the template of the pod's role
    (``Integration.role_of``); None when the pod names no template of a unit."""
    if len(units) == 1:
        return units[0]
    role = integration.role_of(pod)
    if role is None:
        return None
    templates = gpu_templates(integration, obj)
    for unit in units:
        if any(templates[i][0].role.lower() == role.lower() for i in unit.templates):
            return unit
    return None


def gpu_templates(integration: Integration, obj: Mapping[str, Any]) -> List[GpuTemplate]:
    """The pod templates that use GPUs, each with its GPU containers (webhook and controller)."""
    out: List[GpuTemplate] = []
    for ref in integration.pod_templates(obj):
        containers = list(gpu_containers(ref.template))
        if containers:
            out.append((ref, containers))
    return out


# --- the registry ---------------------------------------------------------------------------

_REGISTRY: List[Integration] = []
_BY_GVK: Dict[Tuple[str, str, str], Integration] = {}

_Kind = TypeVar("_Kind", bound=Type[Integration])


def register(cls: _Kind) -> _Kind:
    """Class decorator: add the kind to the registry, once (a second kind of a name is a bug)."""
    integration = cls()
    if any(existing.kind == integration.kind for existing in _REGISTRY):
        raise ValueError(f"integration for {integration.kind} registered twice")
    _REGISTRY.append(integration)
    for version in integration.versions:
        _BY_GVK[(integration.group, version, integration.kind)] = integration
    return cls


def registered() -> Tuple[Integration, ...]:
    """Every registered integration, in registration order."""
    return tuple(_REGISTRY)


def for_kind(group: str, version: str, kind: str) -> Optional[Integration]:
    """The integration for a group/version/kind, or None when the webhook does not handle it."""
    return _BY_GVK.get((group, version, kind))
