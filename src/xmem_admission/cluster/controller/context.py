"""What every reconcile step needs, in one object: API, caches, policy, metrics, settings.

The reconcilers (``estimation_pods`` for GPUMemoryEstimates and their pods, ``workloads`` for held
workloads) are functions of this context and a key; all their state lives in the API objects
the caches mirror, which is what makes a restarted controller pick up where it left off.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Set, Tuple

from xmem_admission.cluster.controller.line_state import Line
from xmem_admission.cluster.controller.metrics import ControllerMetrics
from xmem_admission.cluster.controller.waiters import Waiters
from xmem_admission.cluster.integrations.base import Integration
from xmem_admission.cluster.kube.client import EVENT, Kind, Kube, Obj
from xmem_admission.cluster.kube.informer import Informer, WorkQueue
from xmem_admission.cluster.observations import PeakReader, PrometheusSource
from xmem_admission.contract.errors import KubeApiError, KubeUnavailable

log = logging.getLogger(__name__)

EVENT_MESSAGE_LIMIT = 1024  # events.k8s.io caps a note at 1 KiB; keep core Events as short


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@dataclass
class Workload:
    """One workload kind the controller releases: its integration and its cache."""

    integration: Integration
    informer: Informer

    @property
    def kind(self) -> Kind:
        """Where the kind lives in the REST tree (the integration's resource)."""
        return self.integration.resource


@dataclass
class Context:
    """See the module docstring."""

    kube: Kube
    policy: Any  # a sources.PolicySource
    workloads: Dict[str, Workload]  # by kind name: "Job", "PyTorchJob"
    estimates: Informer
    pods: Informer
    queue: WorkQueue[Tuple[Any, ...]]  # the controller's work: see manager.QueueKey
    metrics: ControllerMetrics
    probe_image: str
    identity: str = "xmem-controller"
    log_lines: int = 20  # lines of the script's output quoted in a failure Event
    deadline_slack: float = 60.0  # beyond activeDeadlineSeconds before the controller gives up
    max_attempts: int = 3  # estimation pods per attempt lost to eviction or deletion
    now: Callable[[], datetime.datetime] = utcnow
    sized_pods: Optional[Informer] = None  # pods of opted-in workloads (``oom_retries``)
    devices: Optional[Any] = None  # a dra_claims.DeviceView: the cluster's DRA devices
    # Workloads (uids) whose claim templates dra_claims.reconcile has seen to.
    claimed: Set[str] = field(default_factory=set)
    # Finished workloads (uids) looked at with nothing to record: no sized pod, or Prometheus
    # failed (a warning and a metric; never retried, never a write): ``observed_peaks``.
    looked: Set[str] = field(default_factory=set)
    # Which held workloads wait on which estimate (``estimate_cache``): no owner references.
    waiters: Waiters = field(default_factory=Waiters)
    # Every ConfigMap's name, uid and resourceVersion (metadata only): the fingerprint reads
    # the versions of those a GPU container mounts or reads (``policy.fingerprint``).
    config_maps: Optional[Informer] = None
    # The line estimations wait in for a pod slot (``estimation_line``, ``line_state``).
    line: Line = field(default_factory=Line)
    _readers: Dict[Any, PeakReader] = field(default_factory=dict)

    def peak_reader(self, prometheus: Any) -> PeakReader:
        """The reader for the policy's ``rightSizing.prometheus`` (one per setting)."""
        reader = self._readers.get(prometheus)
        if reader is None:
            source = PrometheusSource(
                prometheus.url, bearer_token_file=prometheus.bearer_token_file,
                ca_file=prometheus.ca_file, tenant=prometheus.tenant,
                timeout_seconds=prometheus.timeout_seconds,
                slack_seconds=prometheus.slack_seconds)
            reader = PeakReader(source, metrics=self.metrics.peaks)
            self._readers = {prometheus: reader}  # the previous setting's reader is dropped
        return reader

    def versions(self, namespace: str) -> Optional[Callable[[str, str], Optional[Tuple[str, str]]]]:
        """The ConfigMap versions the fingerprint reads in ``namespace`` (None: names only)."""
        return self.config_maps.versions(namespace) if self.config_maps is not None else None

    def fresh_versions(self, namespace: str) -> Optional[Callable[[str, str],
                                                                 Optional[Tuple[str, str]]]]:
        """The same lookup from the API, now (each ConfigMap's metadata read once): for when
        the cache may lag an edit the webhook already saw."""
        if self.config_maps is None:
            return None
        seen: Dict[str, Optional[Tuple[str, str]]] = {}

        def lookup(kind: str, name: str) -> Optional[Tuple[str, str]]:
            if kind != "ConfigMap":
                return None
            if name not in seen:
                seen[name] = self.kube.config_map_version(namespace, name)
            return seen[name]
        return lookup

    def settings(self, namespace: str) -> Optional[Any]:
        """The policy's settings for a namespace, or None while no policy is loaded."""
        policy = self.policy.current()
        return policy.for_namespace(namespace) if policy is not None else None

    def emit(self, obj: Obj, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on an object (best effort: a lost Event never blocks a reconcile)."""
        m = obj["metadata"]
        if len(message) > EVENT_MESSAGE_LIMIT:
            message = message[: EVENT_MESSAGE_LIMIT // 2 - 4] + " ... " + \
                message[-(EVENT_MESSAGE_LIMIT // 2 - 4):]
        stamp = self.now().strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{m['name']}.{uuid.uuid4().hex[:16]}",
                         "namespace": m["namespace"]},
            "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
                               "name": m["name"], "namespace": m["namespace"],
                               "uid": m.get("uid"), "resourceVersion": m.get("resourceVersion")},
            "reason": reason, "message": message, "type": type_, "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": "xmem-controller"},
            "reportingComponent": "xmem.io/controller", "reportingInstance": self.identity,
        }
        try:
            self.kube.create(EVENT, m["namespace"], body)
        except (KubeApiError, KubeUnavailable) as exc:
            log.warning("event %s on %s/%s not recorded: %s", reason, m["namespace"],
                        m["name"], exc)
