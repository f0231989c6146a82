"""Authentication and RBAC for the stand-in API server, as kube-apiserver does them.

Users: every bearer token names one (``ApiServer.add_user``); the server's own token is a
superuser, as are the stand-in's own components (Job controller, node), which a real cluster
authorizes through the controller manager's and kubelet's own roles. Everyone else is
authorized by the ``rbac.authorization.k8s.io/v1`` objects stored in the server, evaluated as
the RBAC authorizer does: a request (verb, API group, resource and subresource, namespace,
name) is allowed when a rule of a Role bound in its namespace, or of a ClusterRole bound in its
namespace or cluster-wide, matches it; subjects are users, groups and service accounts
(``system:serviceaccount:<ns>:<name>``, in the groups ``system:serviceaccounts`` and
``system:serviceaccounts:<ns>``). Not modelled: aggregated ClusterRoles, nonResourceURLs,
escalation checks on creating roles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from tests.fakekube.objects import Resource

GROUP = "rbac.authorization.k8s.io"
RESOURCES = [
    Resource(GROUP, "v1", "Role", "roles", True),
    Resource(GROUP, "v1", "ClusterRole", "clusterroles", False),
    Resource(GROUP, "v1", "RoleBinding", "rolebindings", True),
    Resource(GROUP, "v1", "ClusterRoleBinding", "clusterrolebindings", False),
]


@dataclass(frozen=True)
class User:
    """Who a request comes from: the AdmissionReview's ``userInfo``."""

    username: str
    groups: Tuple[str, ...] = ("system:authenticated",)
    superuser: bool = False

    def info(self) -> Dict[str, Any]:
        return {"username": self.username, "groups": list(self.groups)}


def service_account(namespace: str, name: str, superuser: bool = False) -> User:
    return User(f"system:serviceaccount:{namespace}:{name}",
                ("system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                 "system:authenticated"), superuser)


ADMIN = User("standin-admin", ("system:masters", "system:authenticated"), superuser=True)


@dataclass(frozen=True)
class Attributes:
    """What a request asks to do."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    def describe(self) -> str:
        what = self.resource + (f"/{self.subresource}" if self.subresource else "")
        where = f' in the namespace "{self.namespace}"' if self.namespace else \
            " at the cluster scope"
        return f'cannot {self.verb} resource "{what}" in API group "{self.group}"{where}'


def _hit(values: Any, value: str) -> bool:
    return isinstance(values, list) and ("*" in values or value in values)


def _rule_allows(rule: Dict[str, Any], attrs: Attributes) -> bool:
    resource = attrs.resource + (f"/{attrs.subresource}" if attrs.subresource else "")
    resources = rule.get("resources") or []
    names = rule.get("resourceNames") or []
    return (_hit(rule.get("verbs"), attrs.verb) and _hit(rule.get("apiGroups"), attrs.group)
            and ("*" in resources or resource in resources
                 or (attrs.subresource and f"*/{attrs.subresource}" in resources))
            and (not names or attrs.name in names))


def _subject_is(subject: Dict[str, Any], user: User) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == user.username
    if kind == "Group":
        return subject.get("name") in user.groups
    if kind == "ServiceAccount":
        return user.username == f"system:serviceaccount:{subject.get('namespace')}:" \
            f"{subject.get('name')}"
    return False


@dataclass
class Authorizer:
    """RBAC over the objects a ``Storage`` holds (see the module docstring)."""

    storage: Any
    by_kind: Dict[str, Resource] = field(default_factory=lambda: {r.kind: r for r in RESOURCES})

    def _objects(self, kind: str, namespace: Optional[str]) -> List[Dict[str, Any]]:
        items, _ = self.storage.list(self.by_kind[kind], namespace)
        return items

    def _rules(self, kind: str, namespace: str, name: str) -> List[Dict[str, Any]]:
        res = self.by_kind[kind]
        role = self.storage.find(res, namespace if res.namespaced else "", name)
        return list((role or {}).get("rules") or [])

    def allowed(self, user: User, attrs: Attributes) -> bool:
        if user.superuser or "system:masters" in user.groups:
            return True
        bindings = [(b, "") for b in self._objects("ClusterRoleBinding", None)]
        if attrs.namespace:
            bindings += [(b, attrs.namespace) for b in self._objects("RoleBinding",
                                                                     attrs.namespace)]
        for binding, namespace in bindings:
            if not any(_subject_is(s, user) for s in binding.get("subjects") or []):
                continue
            ref = binding.get("roleRef") or {}
            rules = self._rules(ref.get("kind", ""), namespace, ref.get("name", ""))
            if any(_rule_allows(rule, attrs) for rule in rules):
                return True
        return False
