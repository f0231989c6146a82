"""Label and field selectors, parsed and matched the way the API server does.

Label selectors (``labelSelector=``) take the full syntax of ``k8s.io/apimachinery/pkg/labels``:
equality (``a=b``, ``a==b``, ``a!=b``), sets (``a in (x,y)``, ``a notin (x)``) and existence
(``a``, ``!a``), comma-separated and ANDed. Field selectors (``fieldSelector=``) take ``=``, ``==``
and ``!=`` on the field labels a kind supports; any other field is a 400, as on a real server,
so a controller cannot come to rely on a selector a cluster would refuse.

``LabelSelector.from_object`` also reads the structured form (``matchLabels`` and
``matchExpressions``) that webhook configurations and owners' selectors use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from tests.fakekube.status import bad_request

_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Requirement:
    """One clause of a label selector."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: Tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        if self.op == "exists":
            return present
        return not present  # "!"


@dataclass(frozen=True)
class LabelSelector:
    """A parsed label selector; the empty selector matches everything."""

    requirements: Tuple[Requirement, ...] = ()

    def matches(self, labels: Optional[Mapping[str, str]]) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    @classmethod
    def parse(cls, text: Optional[str]) -> LabelSelector:
        """Parse the string form (``app=x,tier in (a,b),!legacy``)."""
        if not text:
            return cls()
        out: List[Requirement] = []
        for clause in _split_clauses(text):
            out.append(_parse_clause(clause, text))
        return cls(tuple(out))

    @classmethod
    def from_object(cls, selector: Optional[Mapping[str, Any]]) -> LabelSelector:
        """Read a ``metav1.LabelSelector`` (matchLabels + matchExpressions)."""
        if not selector:
            return cls()
        out: List[Requirement] = []
        for key, value in sorted((selector.get("matchLabels") or {}).items()):
            out.append(Requirement(key, "=", (str(value),)))
        ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
        for expression in selector.get("matchExpressions") or []:
            op = ops.get(expression.get("operator", ""))
            if op is None:
                raise bad_request(f"invalid label selector operator {expression.get('operator')!r}")
            out.append(Requirement(expression["key"], op, tuple(expression.get("values") or ())))
        return cls(tuple(out))


def _split_clauses(text: str) -> List[str]:
    """Split on commas that are not inside a parenthesised value set."""
    clauses, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            clauses.append(text[start:index])
            start = index + 1
    clauses.append(text[start:])
    return [c.strip() for c in clauses if c.strip()]


def _check_key(key: str, text: str) -> str:
    if not _KEY.match(key) or len(key.split("/")[-1]) > 63:
        raise bad_request(f"unable to parse requirement: invalid label key {key!r} in {text!r}")
    return key


def _check_value(value: str, text: str) -> str:
    if len(value) > 63 or not _VALUE.match(value):
        raise bad_request(f"unable to parse requirement: invalid label value {value!r} in {text!r}")
    return value


def _parse_clause(clause: str, text: str) -> Requirement:
    match = re.match(r"^(\S+)\s+(in|notin)\s*\((.*)\)$", clause)
    if match:
        values = tuple(_check_value(v.strip(), text) for v in match.group(3).split(",") if v.strip())
        if not values:
            raise bad_request(f"unable to parse requirement: empty value set in {text!r}")
        return Requirement(_check_key(match.group(1), text), match.group(2), values)
    for op, name in (("!=", "!="), ("==", "="), ("=", "=")):
        if op in clause:
            key, value = clause.split(op, 1)
            return Requirement(_check_key(key.strip(), text), name, (_check_value(value.strip(), text),))
    if clause.startswith("!"):
        return Requirement(_check_key(clause[1:].strip(), text), "!")
    return Requirement(_check_key(clause, text), "exists")


# --- field selectors ------------------------------------------------------------------------

# The field labels each kind supports beyond metadata.name and metadata.namespace (the
# registry's ``AddFieldLabelConversionFunc`` lists of Kubernetes 1.30).
FIELD_LABELS: Dict[str, Tuple[str, ...]] = {
    "Pod": ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
            "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP",
            "status.nominatedNodeName"),
    "Event": ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
              "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
              "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"),
    "Job": ("status.successful",),
    "Namespace": ("status.phase",),
    "Secret": ("type",),
}


def _field_value(obj: Mapping[str, Any], path: str) -> str:
    node: Any = obj
    if path == "source":  # Event's "source" label is source.component
        node = (obj.get("source") or {}).get("component", "")
        return str(node)
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, bool):
        return "true" if node else "false"
    return "" if node is None else str(node)


def field_selector(text: Optional[str], kind: str) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate for a field selector on objects of ``kind``; unsupported fields are a 400."""
    if not text:
        return lambda obj: True
    allowed = ("metadata.name", "metadata.namespace") + FIELD_LABELS.get(kind, ())
    clauses: List[Tuple[str, bool, str]] = []
    for clause in (c.strip() for c in text.split(",") if c.strip()):
        op = next((o for o in ("!=", "==", "=") if o in clause), None)
        if op is None:
            raise bad_request(f"invalid field selector {clause!r}: needs =, == or !=")
        path, value = clause.split(op, 1)
        equal = op != "!="
        path = path.strip()
        if path not in allowed:
            raise bad_request(f'field label not supported: {path}')
        clauses.append((path, equal, value.strip()))

    def matches(obj: Mapping[str, Any]) -> bool:
        for path, equal, value in clauses:
            if (_field_value(obj, path) == value) != equal:
                return False
        return True

    return matches
