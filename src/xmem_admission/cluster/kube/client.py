"""The controller's access to the Kubernetes API: the official client, and nothing clever.

Every call goes through the official ``kubernetes`` client's typed APIs (``BatchV1Api``,
``CoreV1Api``, ``CoordinationV1Api``, ``CustomObjectsApi``); objects travel as plain dicts
(``_preload_content=False`` on reads, dict bodies on writes) because the integrations, the
fingerprint and the sizing code all work on dicts, and a dict round-trips every field, known to
the client's models or not.

Failures are sorted the way a controller must treat them:

- 409 (``Conflict``: someone wrote the object since we read it; ``AlreadyExists``) and 404 are
  raised as ``ApiError`` for the caller to handle: a conflict is never retried blindly, the
  reconcile starts over from fresh state;
- 429 and 5xx, connection errors and timeouts are retried here with exponential backoff
  (``Retry-After`` honoured), then raised as ``Unavailable`` so the work item is requeued.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from xmem_admission.contract.errors import KubeApiError as ApiError
from xmem_admission.contract.errors import KubeUnavailable as Unavailable

log = logging.getLogger(__name__)

Obj = Dict[str, Any]
RETRYABLE = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the REST tree."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


# The controller's own resources. Workload kinds (Job, PyTorchJob, ...) are not listed here:
# each integration owns its resource (``xmem_admission.cluster.integrations``).
GME = Kind("xmem.io", "v1alpha1", "gpumemoryestimates", "GPUMemoryEstimate")
POD = Kind("", "v1", "pods", "Pod")
EVENT = Kind("", "v1", "events", "Event")
LEASE = Kind("coordination.k8s.io", "v1", "leases", "Lease")
POLICY = Kind("xmem.io", "v1alpha1", "gpuadmissionpolicies", "GPUAdmissionPolicy")
CONFIG_MAP = Kind("", "v1", "configmaps", "ConfigMap")
NAMESPACE = Kind("", "v1", "namespaces", "Namespace")
# What a metadata-only list and watch ask for (client-go's metadata informers): every object as
# a PartialObjectMetadata, its name, uid and resourceVersion without its data.
METADATA_LIST = {"Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"}
METADATA_WATCH = {"Accept": "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"}

# Built-in API groups, served by the client's typed APIs (attribute of ``Kube``); every other
# group is a custom resource, reached through ``CustomObjectsApi``.
_TYPED_APIS = {("", "v1"): "core", ("batch", "v1"): "batch",
               ("coordination.k8s.io", "v1"): "coordination"}


def _error(exc: Any) -> ApiError:
    reason, message = getattr(exc, "reason", "") or "", ""
    try:
        body = json.loads(exc.body or "{}")
        reason, message = body.get("reason") or reason, body.get("message") or ""
    except (ValueError, TypeError, AttributeError):
        message = str(getattr(exc, "body", "") or "")
    return ApiError(int(exc.status or 0), str(reason), message)


class Kube:
    """A thin, retrying facade over the official client for the kinds the controller touches."""

    def __init__(self, api_client: Any, attempts: int = 5, backoff: float = 0.2,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.attempts = attempts
        self.backoff = backoff
        self.sleep = sleep
        self.retries = 0  # calls that were retried (tests and debugging)

    # --- the retry loop ---------------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call an API method; JSON answers come back as dicts, text as str."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as TransportError

        delay = self.backoff
        for attempt in range(self.attempts):
            try:
                response = fn(*args, _preload_content=False, **kwargs)
                data = response.data
                kind = (response.headers or {}).get("Content-Type", "")
                if "json" in kind:
                    return json.loads(data) if data else None
                return data.decode("utf-8", "replace") if isinstance(data, bytes) else data
            except ApiException as exc:
                if exc.status not in RETRYABLE:
                    raise _error(exc) from None
                wait = delay
                retry_after = (exc.headers or {}).get("Retry-After") if exc.headers else None
                if retry_after and str(retry_after).isdigit():
                    wait = max(wait, float(retry_after))
                problem = f"HTTP {exc.status}"
            except (OSError, ValueError, TransportError) as exc:  # refused, reset, timed out,
                # or urllib3's own retries given up (MaxRetryError): the server is unreachable
                wait, problem = delay, f"{type(exc).__name__}: {exc}"
            if attempt + 1 == self.attempts:
                raise Unavailable(f"{getattr(fn, '__name__', fn)}: {problem}")
            self.retries += 1
            log.debug("retrying %s after %s (%.1fs)", getattr(fn, "__name__", fn), problem, wait)
            self.sleep(min(wait, 30.0))
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    def request(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Obj:
        """``call`` for the methods whose answer is a JSON object (reads and writes)."""
        obj: Obj = self.call(fn, *args, **kwargs)
        return obj

    # --- generic object access --------------------------------------------------------------

    def _typed(self, kind: Kind, method: str) -> Optional[Callable[..., Any]]:
        """A built-in kind's typed method (``method`` names the kind ``{}``: ``read_namespaced_{}``
        is ``read_namespaced_job`` for a Job), None for a custom resource."""
        api = _TYPED_APIS.get((kind.group, kind.version))
        if api is None:
            return None
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", kind.kind).lower()  # ConfigMap: config_map
        fn: Callable[..., Any] = getattr(getattr(self, api), method.format(snake))
        return fn

    def list_all(self, kind: Kind, label_selector: str = "",
                 headers: Optional[Dict[str, str]] = None, page_size: int = 0) -> Obj:
        """A cluster-wide list (the informers' first step); ``headers``: a metadata-only list
        (``METADATA_LIST``); ``page_size``: walk it in pages (``list_pages``), all items in one."""
        if page_size <= 0:
            extra: Dict[str, Any] = {"label_selector": label_selector} if label_selector else {}
            if headers:
                extra["_headers"] = headers
            return self.request(self.list_function(kind), **extra)
        items: List[Obj] = []
        version = ""
        for page in self.list_pages(kind, label_selector, headers, page_size):
            if page.get("restarted"):
                items = []
            items.extend(page.get("items") or [])
            version = str((page.get("metadata") or {}).get("resourceVersion") or version)
        return {"items": items, "metadata": {"resourceVersion": version}}

    def list_pages(self, kind: Kind, label_selector: str = "",
                   headers: Optional[Dict[str, str]] = None, page_size: int = 500,
                   restarts: int = 3) -> Iterator[Obj]:
        """A cluster-wide list in pages of ``page_size`` (``limit`` and ``continue``), as
        client-go's pager walks one: each page is yielded as the server sent it. A continue
        token the server no longer honours (410 Expired: its snapshot was compacted) starts
        the listing over, at most ``restarts`` times; the first page of a new start carries
        ``"restarted": True`` so that the reader drops what it took from the earlier pages."""
        base: Dict[str, Any] = {"limit": page_size}
        if label_selector:
            base["label_selector"] = label_selector
        if headers:
            base["_headers"] = headers
        fn = self.list_function(kind)
        token, restarted, tries = "", False, 0
        while True:
            try:
                page = self.request(fn, **dict(base, _continue=token) if token else base)
            except ApiError as exc:
                if exc.status != 410 or not token or tries >= restarts:
                    raise
                tries += 1
                log.info("listing %s again from its start: %s", kind.plural, exc.message)
                token, restarted = "", True
                continue
            if restarted:
                page = dict(page, restarted=True)
                restarted = False
            yield page
            token = str((page.get("metadata") or {}).get("continue") or "")
            if not token:
                return

    def list_function(self, kind: Kind) -> Callable[..., Any]:
        """The list method a ``watch.Watch().stream`` drives for this kind."""
        if kind == NAMESPACE:  # cluster-scoped: no "for all namespaces" form
            return self._typed(kind, "list_{}") or self.core.list_namespace
        typed = self._typed(kind, "list_{}_for_all_namespaces")
        if typed is not None:
            return typed

        def custom(**kwargs: Any) -> Any:
            return self.custom.list_cluster_custom_object(kind.group, kind.version, kind.plural,
                                                          **kwargs)

        custom.__doc__ = ":return: object"  # the watch reads the return type from the docstring
        return custom

    def get(self, kind: Kind, namespace: str, name: str) -> Obj:
        typed = self._typed(kind, "read_namespaced_{}")
        if typed is not None:
            return self.request(typed, name, namespace)
        return self.request(self.custom.get_namespaced_custom_object, kind.group, kind.version,
                            namespace, kind.plural, name)

    def replace(self, kind: Kind, obj: Obj) -> Obj:
        """PUT with the object's resourceVersion: 409 when someone wrote it since."""
        m = obj["metadata"]
        typed = self._typed(kind, "replace_namespaced_{}")
        if typed is not None:
            return self.request(typed, m["name"], m["namespace"], obj)
        return self.request(self.custom.replace_namespaced_custom_object, kind.group,
                            kind.version, m["namespace"], kind.plural, m["name"], obj)

    def create(self, kind: Kind, namespace: str, obj: Obj) -> Obj:
        typed = self._typed(kind, "create_namespaced_{}")
        if typed is not None:
            return self.request(typed, namespace, obj)
        return self.request(self.custom.create_namespaced_custom_object, kind.group,
                            kind.version, namespace, kind.plural, obj)

    def replace_status(self, kind: Kind, obj: Obj) -> Obj:
        m = obj["metadata"]
        return self.request(self.custom.replace_namespaced_custom_object_status, kind.group,
                            kind.version, m["namespace"], kind.plural, m["name"], obj)

    def get_cluster(self, kind: Kind, name: str) -> Obj:
        """GET a cluster-scoped custom resource."""
        return self.request(self.custom.get_cluster_custom_object, kind.group, kind.version,
                            kind.plural, name)

    def replace_cluster_status(self, kind: Kind, obj: Obj) -> Obj:
        """PUT a cluster-scoped custom resource's status, with its resourceVersion."""
        return self.request(self.custom.replace_cluster_custom_object_status, kind.group,
                            kind.version, kind.plural, obj["metadata"]["name"], obj)

    def config_map_version(self, namespace: str, name: str) -> Optional[Tuple[str, str]]:
        """A ConfigMap's (uid, resourceVersion) read now, its metadata only; None when absent."""
        try:
            found = self.request(self.core.read_namespaced_config_map, name, namespace,
                                 _headers=METADATA_WATCH)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        m = found.get("metadata") or {}
        return str(m.get("uid") or ""), str(m.get("resourceVersion") or "")

    def delete_pod(self, namespace: str, name: str, uid: Optional[str] = None) -> None:
        body = {"preconditions": {"uid": uid}} if uid else None
        try:
            self.call(self.core.delete_namespaced_pod, name, namespace, body=body,
                      propagation_policy="Background")
        except ApiError as exc:
            if not (exc.not_found or exc.conflict):
                raise

    def pod_log(self, namespace: str, name: str, container: str, lines: int) -> str:
        """The last lines a container printed ('' when the kubelet has none)."""
        try:
            text = self.call(self.core.read_namespaced_pod_log, name, namespace,
                             container=container, tail_lines=lines, limit_bytes=64 * 1024)
        except ApiError:
            return ""
        return text if isinstance(text, str) else json.dumps(text)

    # --- leases -----------------------------------------------------------------------------

    def read_lease(self, namespace: str, name: str) -> Obj:
        return self.get(LEASE, namespace, name)

    def create_lease(self, namespace: str, lease: Obj) -> Obj:
        return self.create(LEASE, namespace, lease)

    def replace_lease(self, lease: Obj) -> Obj:
        return self.replace(LEASE, lease)
