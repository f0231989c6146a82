"""The small interface every workload kind implements (Kueue's shape).

An integration knows where a kind keeps its pod templates, whether and how it can be held
(suspended) before any pod exists, and who owns it. Everything else (opt-in, estimates,
backends, patches) is kind-independent and lives in ``xmem_admission.cluster.admission``.

Templates are addressed by path so that mutations can go through a ``patch.Draft`` and the
patch stays exact; a bare Pod is its own template (path ``()``: it has ``metadata`` and ``spec``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, List, Mapping, Optional, Tuple

from xmem_admission.cluster.kube.jsonpatch import Draft, Path, dotted
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


def mapping_at(obj: Mapping[str, Any], path: Path, required: bool = True) -> Optional[Mapping[str, Any]]:
    """The object at ``path``, checked to be a mapping; errors name the field."""
    node: Any = obj
    for depth, part in enumerate(path):
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            if required:
                raise InvalidObjectError(f"{dotted(path[: depth + 1])}: required")
            return None
        if not isinstance(node, dict):
            raise InvalidObjectError(f"{dotted(path[: depth + 1])}: expected an object")
    return node


class Integration(abc.ABC):
    """One workload kind."""

    group: ClassVar[str]
    versions: ClassVar[Tuple[str, ...]]
    kind: ClassVar[str]
    plural: ClassVar[str]
    # Whether it can be held (suspended) until an estimate exists; a Pod cannot.
    can_hold: ClassVar[bool]
    # Where the suspend flag lives, for kinds that can be held.
    suspend_path: ClassVar[Tuple[str, ...]] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.versions[0]}" if self.group else self.versions[0]

    @abc.abstractmethod
    def pod_templates(self, obj: Mapping[str, Any]) -> List[TemplateRef]:
        """Every pod template, in a stable order (the fingerprint depends on it)."""

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
        """Release the workload (the controller's step once an estimate is recorded)."""
        if not self.can_hold:
            raise TypeError(f"{self.kind} cannot be held")
        draft.set(self.suspend_path, False)

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

    def workload_ref(self, obj: Mapping[str, Any], namespace: str) -> WorkloadRef:
        meta = obj.get("metadata") or {}
        name = meta.get("name") or meta.get("generateName") or ""
        return WorkloadRef(namespace=namespace, kind=self.kind, name=str(name))
